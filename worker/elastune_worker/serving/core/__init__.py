"""The engine core: ``LLMEngine`` (engine) steps the scheduler and the runner; the scheduler, the paged
KV block manager, the sequences and the queue policies are the pure package ``elastune_batching`` (no
torch: an import-linter contract keeps it so), which the gateway's simulator steps too. The detokenizer
is here because the engine checks stop strings each step; the cost profile because it is measured
through the engine's own ``step``."""
