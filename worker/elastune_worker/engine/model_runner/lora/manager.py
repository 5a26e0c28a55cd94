"""The engine's adapters: registration (vLLM's load/unload API), the host and device tiers, and the
slots of a step's adapters."""

from __future__ import annotations

import torch

from elastune_worker.engine.core.config import EngineConfig
from elastune_worker.engine.model_runner.lora.copies import CopyTiming
from elastune_worker.engine.model_runner.lora.slots import DeviceLoRAs, HostLoRAs, Registered
from elastune_worker.engine.model_runner.lora.weights import AdapterError, LoRAWeights, load_lora


class LoRAManager:
    def __init__(
        self,
        config: EngineConfig,
        shapes: dict[str, tuple[int, int]],
        num_layers: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        if not shapes:
            raise AdapterError(
                "LoRA adapters need a Llama-family model (this model type has no LoRA support)"
            )
        self.config = config
        self.shapes, self.num_layers = shapes, num_layers
        self.host = HostLoRAs(config.max_cpu_loras, self._read)
        self.device = DeviceLoRAs(config.max_loras, config.max_lora_rank, shapes, num_layers, device, dtype)

    def time_copies(self, timing: CopyTiming) -> None:
        """Replace how copies are timed (benchmarks and tests on a CPU inject an EmulatedCopies)."""
        self.device.copies = timing

    def _read(self, name: str, path: str) -> LoRAWeights:
        return load_lora(name, path, self.shapes, self.num_layers, self.config.max_lora_rank)

    def register(self, name: str, path: str) -> Registered:
        cached = self.config.lora_load_mode == "cached"
        if cached and name not in self.host.registered and len(self.host.registered) >= self.config.max_loras:
            raise AdapterError(
                f"lora_load_mode cached keeps every adapter on the device: {self.config.max_loras} slots are "
                "taken (raise --max-loras or use another load mode)"
            )
        self.host.register(name, path)
        if cached:  # the oracle: on the device from the start, never loaded while serving
            self.device.activate([name], self.host, set(self.host.registered))
            self.device.wait_copies({name})
        return self.host.registered[name]

    def register_weights(self, weights: LoRAWeights) -> Registered:
        """An adapter already in memory (the start-up profile's synthetic ones): registered without a read."""
        if weights.name in self.host.registered:
            raise AdapterError(f"adapter {weights.name!r} is already loaded")
        reg = self.host.registered[weights.name] = Registered(weights.name, weights.path, weights.rank)
        self.host.cache[weights.name] = weights
        return reg

    def prefetch(self, names: list[str], busy: set[str]) -> None:
        """Start loading adapters that waiting requests need, in queue order, while a slot is free or
        evictable. An adapter the queue needs earlier is never evicted for a later one, resident or
        still copying (else two waiting adapters evict each other every step and neither request
        starts)."""
        for name in dict.fromkeys(names):
            if name in self.device.slot_of:
                busy = busy | {name}
                continue
            if name not in self.host.registered:
                continue
            if not self.device.can_place(busy):
                return
            self.device.activate([name], self.host, busy)
            busy = busy | {name}

    def not_ready(self) -> set[str]:
        """Registered adapters a request cannot start with on the device now (absent or in flight)."""
        loading = self.device.loading()
        return {n for n in self.host.registered if n not in self.device.slot_of or n in loading}

    def unregister(self, name: str, users: int) -> None:
        if name not in self.host.registered:
            raise KeyError(name)
        if users:
            raise AdapterError(
                f"adapter {name!r} is in use by {users} request(s); unload it when they finish"
            )
        self.host.unregister(name)
        self.device.evict(name)

    def has(self, name: str) -> bool:
        return name in self.host.registered

    def tier(self, name: str) -> str:
        if name in self.device.slot_of:
            return "device"
        return "host" if name in self.host.cache else "storage"

    def counters(self) -> dict[str, float]:
        """Cumulative loads, load seconds and evictions of each tier."""
        host, device = self.host, self.device
        return {
            "host_loads": host.loads, "host_load_seconds": host.load_seconds,
            "host_evictions": host.evictions, "device_loads": device.loads,
            "device_load_seconds": device.load_seconds, "device_evictions": device.evictions,
        }  # fmt: skip

    def registration(self, name: str) -> Registered:
        """Its artifact and rank (KeyError when it is not registered)."""
        return self.host.registered[name]

    def activate(self, names: set[str], busy: set[str]) -> dict[str, int]:
        """Device slots of this step's adapters, loading any that is not there (on demand)."""
        return self.device.activate(sorted(names), self.host, busy)
