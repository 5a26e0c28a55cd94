"""Device LoRA slots reused by adapters of other ranks and targets: what the padded kernel reads past an
adapter's rank is zeros, whatever the slot held before (only the rows a larger adapter left are
zeroed, not the whole slot). On CUDA a load copies from pinned host memory made once per adapter, so
the engine thread does not wait for it (the device script runs this file)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from elastune_worker.engine.model_runner.lora.slots import DeviceLoRAs, HostLoRAs  # noqa: E402
from elastune_worker.engine.model_runner.lora.weights import LoRAWeights  # noqa: E402

ON_GPU = torch.cuda.is_available()
SHAPES = {"q_proj": (12, 12), "v_proj": (12, 6)}
LAYERS = 2


def adapter(name: str, rank: int, targets: tuple[str, ...] = ("q_proj", "v_proj")) -> LoRAWeights:
    gen = torch.Generator().manual_seed(rank)
    w = LoRAWeights(name=name, path="(test)", rank=rank, scaling=1.0)
    for layer in range(LAYERS):
        for t in targets:
            fan_in, fan_out = SHAPES[t]
            w.a[(layer, t)] = torch.randn(rank, fan_in, generator=gen) + 3  # never zero
            w.b_t[(layer, t)] = torch.randn(rank, fan_out, generator=gen) + 3
    return w


def tiers(device: str) -> tuple[DeviceLoRAs, HostLoRAs]:
    weights = {w.name: w for w in (adapter("r8", 8), adapter("r2", 2), adapter("q-only", 4, ("q_proj",)))}
    host = HostLoRAs(8, lambda name, _path: weights[name])
    for name in weights:
        host.register(name, "(test)")
    dev = DeviceLoRAs(1, 8, SHAPES, LAYERS, torch.device(device), torch.float32)
    return dev, host


def slot_matches(dev: DeviceLoRAs, w: LoRAWeights) -> None:
    """The slot holds the adapter's rows and zeros past its rank; targets it lacks are zeros."""
    for key, a in dev.a.items():
        b = dev.b[key]
        if key in w.a:
            torch.testing.assert_close(a[0, : w.rank].cpu(), w.a[key])
            torch.testing.assert_close(b[0, : w.rank].cpu(), w.b_t[key])
            assert not a[0, w.rank :].any() and not b[0, w.rank :].any(), key
        else:
            assert not a[0].any() and not b[0].any(), key


@pytest.mark.parametrize("device", ["cpu", "cuda"] if ON_GPU else ["cpu"])
def test_a_reused_slot_reads_zeros_past_the_new_adapters_rank(device):
    dev, host = tiers(device)
    for name in ("r8", "r2", "q-only", "r8", "q-only", "r2"):  # one slot: each load evicts the last
        dev.activate([name], host, set())
        dev.copies.wait({name})
        slot_matches(dev, host.get(name))
    assert dev.loads == 6 and dev.evictions == 5


@pytest.mark.skipif(not ON_GPU, reason="pinned host memory needs a CUDA device")
def test_on_cuda_loads_copy_from_pinned_memory_made_once_per_adapter():
    dev, host = tiers("cuda")
    dev.dtype = torch.bfloat16  # the device's dtype: staged once, converted
    dev.a = {k: v.to(torch.bfloat16) for k, v in dev.a.items()}
    dev.b = {k: v.to(torch.bfloat16) for k, v in dev.b.items()}
    dev.activate(["r8"], host, set())
    w = host.get("r8")
    staged = w.staged
    assert staged and all(a.is_pinned() and bt.is_pinned() for a, bt in staged.values())
    assert all(a.dtype == torch.bfloat16 for a, _ in staged.values())
    dev.activate(["r2"], host, set())
    dev.activate(["r8"], host, set())  # loaded again: the same pinned copies, not new ones
    assert w.staged is staged
    dev.copies.wait({"r8"})
    torch.cuda.synchronize()
    for key in w.a:
        torch.testing.assert_close(dev.a[key][0, :8].float().cpu(), w.a[key].to(torch.bfloat16).float())
