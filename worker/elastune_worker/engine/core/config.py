"""The engine's settings: one typed object, each field with its unit and why the default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from elastune_worker.engine.core.scheduler_config import BatchingName, QueuePolicyName, SchedulerConfig

LoraKernelName = Literal["padded", "unpadded"]
LoraLoadMode = Literal["cpu_assisted", "async", "ondmd", "cached"]
AttentionBackendName = Literal["auto", "gather", "triton"]
ElementwiseBackendName = Literal["auto", "torch", "triton"]
LoraBackendName = Literal["auto", "torch", "triton"]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    block_size: int = 16
    """Tokens per KV-cache block (vLLM's default): the unit of allocation and of prefix sharing."""
    num_kv_blocks: int | None = None
    """KV-cache size in blocks; None sizes it from ``kv_cache_tokens``."""
    kv_cache_tokens: int | None = None
    """KV-cache size in tokens when ``num_kv_blocks`` is None. None: on CUDA, from the device's free
    memory (``kv_cache_memory_fraction``); on the CPU, 65,536 (32 full 2,048-token contexts)."""
    kv_cache_memory_fraction: float = 0.9
    """CUDA, neither size given: share of the device memory free after the weights and a warm-up
    forward that the KV cache takes, less the warm-up's activation peak (vLLM's gpu_memory_utilization
    plays this part)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (decodes + prefill chunks): bounds a step's latency."""
    max_num_seqs: int = 128
    """Requests in the running batch at most."""
    long_prefill_token_threshold: int = 0
    """Chunk size cap of one request's prefill per step (0: only the budget caps it). Preble uses 512
    so that long prompts cannot starve decodes."""
    enable_prefix_caching: bool = True
    """Share full KV blocks between requests with the same token prefix."""
    queue_policy: QueuePolicyName = "fcfs"
    """Order of the waiting queue: fcfs; priority (lower ``priority`` first, then arrival); sjf (SSJF:
    ``priority`` is the predicted output length, shortest first, with a starvation guard); or fair (VTC
    across tenants, the API keys the gateway names: the backlogged tenant served the fewest weighted
    tokens goes next, so one key flooding the engine cannot starve another). fcfs stays the default: with
    the gateway's fair line in front (its default) the engine's queue holds few requests, and without a
    gateway every request is one tenant's, where fair is fcfs."""
    sjf_max_bypass: int = 64
    """sjf: a waiting request that later arrivals have overtaken this many times goes first (0: off)."""
    sjf_max_wait_s: float = 0.0
    """sjf: a request waiting this many seconds goes first (0: off)."""
    batching: BatchingName = "continuous"
    """When waiting requests join the running batch (the three settings of the SSJF paper):
    continuous (every step, up to ``max_num_seqs``: Orca/vLLM), dynamic (a new batch of up to
    ``max_num_seqs`` forms only once the running set is empty), none (one request at a time)."""
    max_model_len: int | None = None
    """Context length; None takes the model's."""
    enable_lora: bool = False
    """Serve LoRA adapters (device slots are allocated up front, as vLLM's --enable-lora)."""
    max_loras: int = 4
    """Adapters on the device at once; also the most distinct adapters among running requests (a request
    whose adapter would exceed it waits, as in vLLM)."""
    max_cpu_loras: int = 16
    """Adapters kept in host memory (LRU); others are read again from storage when asked for."""
    max_lora_rank: int = 64
    """Largest rank an adapter may have (the device slots' size)."""
    lora_kernel: LoraKernelName = "padded"
    """padded: ranks padded to the batch's max (Punica BGMV); unpadded: per adapter (S-LoRA MBGMV)."""
    lora_backend: LoraBackendName = "auto"
    """How steps launch the LoRA deltas: torch (eager: per adapter, target and layer, four kernels each;
    CUDA graphs: GraphLoRA, every slot over every row, padded kernel only), triton (two segmented launches
    per target and layer, any number of adapters, in eager steps and inside CUDA graphs, either kernel:
    lora/sgmv.py); auto: triton on CUDA after a start-up check against the torch path, torch otherwise."""
    lora_load_mode: LoraLoadMode = "cpu_assisted"
    """How a request whose adapter is not on the device starts (CaraServe §4, §7.1):
    cpu_assisted — admitted at once, its LoRA delta computed on the CPU from the host copy while the
    adapter loads, then on the device (CaraServe); async — waits until the load finished while others run
    (S-LoRA-like); ondmd — the step waits for the load (on demand); cached — every adapter is put on the
    device when registered (the oracle: needs max_loras >= adapters)."""
    lora_cpu_workers: int = 0
    """CaraServe's CPU LoRA processes for cpu_assisted (shared memory, layer-wise sync); 0 computes
    the CPU path in the engine process."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA when available, else CPU."""
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    """auto: float32 on CPU (exact comparisons with transformers), bfloat16 on CUDA."""

    cuda_graphs: bool = True
    """CUDA: run decode-only steps as CUDA graphs captured for a ladder of batch sizes (eager for
    prefill and mixed steps, and everywhere after a failed capture). Ignored on the CPU."""
    cuda_graph_max_batch: int = 256
    """Largest decode batch captured (capped at ``max_num_seqs``); larger decode steps run eager."""
    attention_backend: AttentionBackendName = "auto"
    """gather: contexts copied out of the paged cache, then SDPA; triton: a kernel that reads the cache
    in place (on the CPU only through Triton's interpreter, for tests); auto: triton on CUDA when it
    imports and passes its start-up check, gather otherwise."""
    block_check_interval: int = 16
    """The KV block manager's O(blocks) self-check every this many steps, and whenever nothing is left
    running (SGLang checks its pool when idle). Every step, it was a third of a batch-256 decode step's
    host time (0.9 of 2.9 ms on this CPU), work the GPU waits for; 1 checks every step."""
    elementwise_backend: ElementwiseBackendName = "auto"
    """A Llama layer's residual add + RMSNorm, RoPE with the KV-cache write, and SiLU-and-mul: torch
    (plain ops, 37 kernels a layer in bfloat16), triton (one fused kernel each: 9 a layer; on the CPU
    only through Triton's interpreter, for tests); auto: triton on CUDA when it imports and passes its
    start-up check, torch otherwise. Other model families always use torch ops."""

    def __post_init__(self) -> None:
        if self.cuda_graph_max_batch < 1:
            raise ValueError("cuda_graph_max_batch must be >= 1")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise ValueError("kv_cache_tokens must be >= 1")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError("kv_cache_memory_fraction must be in (0, 1]")
        if self.attention_backend not in ("auto", "gather", "triton"):
            raise ValueError(
                f"attention_backend must be auto, gather or triton, not {self.attention_backend!r}"
            )
        if self.lora_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"lora_backend must be auto, torch or triton, not {self.lora_backend!r}")
        if self.elementwise_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"elementwise_backend must be auto, torch or triton, not {self.elementwise_backend!r}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if self.max_loras < 1 or self.max_cpu_loras < self.max_loras or self.max_lora_rank < 1:
            raise ValueError("need max_loras >= 1, max_cpu_loras >= max_loras and max_lora_rank >= 1")
        if self.lora_cpu_workers < 0:
            raise ValueError("lora_cpu_workers must be >= 0")
        self.scheduler_config()  # validates the scheduling fields (block size, budget, queue, ...)

    def kv_blocks(self) -> int:
        """The size asked for, or the CPU default (on CUDA, the model runner sizes an unset cache)."""
        return self.num_kv_blocks or max(1, (self.kv_cache_tokens or 65_536) // self.block_size)

    def scheduler_config(self) -> SchedulerConfig:
        """What the scheduler reads of these settings (the pure package has no device settings)."""
        return SchedulerConfig(
            num_kv_blocks=self.kv_blocks(),
            block_size=self.block_size,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            enable_prefix_caching=self.enable_prefix_caching,
            queue_policy=self.queue_policy,
            sjf_max_bypass=self.sjf_max_bypass,
            sjf_max_wait_s=self.sjf_max_wait_s,
            batching=self.batching,
            max_loras=self.max_loras,
            block_check_interval=self.block_check_interval,
        )

    def kv_size_given(self) -> bool:
        return self.num_kv_blocks is not None or self.kv_cache_tokens is not None
