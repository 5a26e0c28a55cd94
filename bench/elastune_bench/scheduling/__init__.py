"""The operator's simulator: PromptTuner vs INFless vs ElasticFlow (``scheduler``) and the mixed tuning +
inference workload with and without co-serving (``coserve_sim``)."""
