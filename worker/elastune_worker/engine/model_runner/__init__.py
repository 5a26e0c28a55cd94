"""The model side of a step (torch): ``ModelRunner`` builds the flat batch and the attention metadata,
runs one forward of a model (models/) over the paged KV cache (attention) with the batch's LoRA deltas
(lora/) and soft prompts, and samples (sampler). ``cpu_binding`` is here because it decides which CPUs
the runner's torch threads (and the CPU LoRA workers) run on."""
