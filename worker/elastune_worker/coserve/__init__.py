"""Co-serving (FlexLLM): a prompt-learning TuningJob finetuned inside the serving engine's iterations.
``planner`` (pure) decides how many finetuning tokens or layers each iteration takes; ``job`` runs them
(torch, the dedicated trainer's model); ``hook`` plugs both into the engine as its ``StepHook``; ``task``
is the worker's assignment on the engine's side (start, poll, finish) and ``calls`` routes the engine
loop's co-serving calls to it. It imports the engine and tuning; neither imports it."""
