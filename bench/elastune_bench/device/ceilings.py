"""Part b1: the chip's two ceilings, measured in the same run as the engine they judge.

Copy bandwidth: one large device-to-device tensor copy, counting bytes read and written (the HBM
traffic a decode step's weight and KV reads are compared with). Matrix rate: one square bf16 matrix
product on random data (a prefill's bound). Each the best of several timed repetitions after warm-ups."""

from __future__ import annotations

import time

import torch

from elastune_bench.device.common import device_info, figures, part_args, sizes, sync, write_part


def best_seconds(fn: object, device: str, reps: int, warm: int = 3) -> float:
    assert callable(fn)
    for _ in range(warm):
        fn()
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(device: str, nbytes: int) -> dict[str, float]:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    s = best_seconds(lambda: dst.copy_(src), device, reps=10)
    return {"copy_bytes": nbytes, "copy_seconds": s, "copy_gbps": figures(2 * nbytes / s / 1e9)}


def matmul_rate(device: str, n: int) -> dict[str, float]:
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    s = best_seconds(lambda: a @ b, device, reps=10)
    return {"matmul_n": n, "matmul_seconds": s, "matmul_tflops": figures(2 * n**3 / s / 1e12)}


def main() -> int:
    args = part_args(__doc__.splitlines()[0])
    z = sizes(args.smoke)
    result = {"device": device_info(z.device), **copy_bandwidth(z.device, z.copy_bytes),
              **matmul_rate(z.device, z.matmul_n)}  # fmt: skip
    write_part(args.out, "ceilings", result)
    print(f"ceilings: copy {result['copy_gbps']} GB/s, bf16 matmul {result['matmul_tflops']} TFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
