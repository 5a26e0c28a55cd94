"""Co-serving (FlexLLM): a prompt-learning TuningJob finetuned inside the engine's inference iterations.
``planner`` (pure) decides how many finetuning tokens or layers each iteration takes; ``job`` runs them
(torch); ``task`` is the worker's assignment on the engine's side (start, poll, finish)."""
