"""The worker's serving engine: against vLLM (``serve``), multi-LoRA (``lora``), co-serving finetuning
with inference (``coserve``), SSJF ordering (``ssjf``); the model shapes they run (``shapes``)."""
