"""Part b3: transformers' ``generate`` on the same shape (a LlamaForCausalLM of the same config, random
weights made on the device in the target dtype): what a user has without a serving engine. Decode
tokens/s at each batch with the engine benchmark's contexts: (time of prompt + n new tokens - time of
prompt + 1 token) over the batch's n - 1 tokens, greedy, lengths forced (``min_new_tokens``)."""

from __future__ import annotations

import time
from typing import Any

import torch

from elastune_bench.device.common import device_info, figures, part_args, read_part, sizes, sync, write_part


def build(shape: str, device: str, dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    from elastune_worker.modeling.random_init import shape_config

    cfg = {k: v for k, v in shape_config(shape).items() if k != "torch_dtype"}
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in the target dtype on the device: no fp32 copy first
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**cfg))
    finally:
        torch.set_default_dtype(before)
    return model.eval()


def generate_seconds(model: Any, ids: torch.Tensor, new: int) -> float:
    sync(ids.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
    sync(ids.device)
    assert out.shape[1] == ids.shape[1] + new
    return time.perf_counter() - t0


def main() -> int:
    args = part_args(__doc__.splitlines()[0])
    z = sizes(args.smoke)
    dtype = getattr(torch, z.dtype)
    t0 = time.perf_counter()
    model = build(z.shape, z.device, dtype)
    result: dict[str, Any] = {"device": device_info(z.device), "shape": z.shape, "dtype": z.dtype,
                              "build_s": round(time.perf_counter() - t0, 2), "decode": {}}  # fmt: skip
    vocab = model.config.vocab_size
    generate_seconds(model, torch.randint(0, vocab, (1, 16), device=z.device), 2)  # warm-up
    for batch in z.hf_batches:
        ids = torch.randint(0, vocab, (batch, z.context), generator=torch.Generator().manual_seed(batch))
        ids = ids.to(z.device)
        first = generate_seconds(model, ids, 1)
        full = generate_seconds(model, ids, z.hf_new_tokens)
        tokens = batch * (z.hf_new_tokens - 1)
        result["decode"][str(batch)] = {
            "batch": batch, "context": z.context, "new_tokens": z.hf_new_tokens,
            "prompt_s": round(first, 4), "seconds": round(full, 4),
            "tokens_per_s": round(tokens / max(full - first, 1e-9), 1),
        }  # fmt: skip
        print(
            f"transformers generate b={batch}: {result['decode'][str(batch)]['tokens_per_s']} tok/s",
            flush=True,
        )
        write_part(args.out, "hf_generate", result)
    engine = (read_part(args.out, "engine") or {}).get("decode", {})
    for b, r in result["decode"].items():
        if b in engine:
            r["engine_speedup"] = figures(engine[b]["tokens_per_s"] / r["tokens_per_s"])
    write_part(args.out, "hf_generate", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
