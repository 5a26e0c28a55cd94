"""Elastune's own model implementations over a paged KV cache: Llama-family and GPT-2, loaded from
HF-format directories (config.json + safetensors)."""
