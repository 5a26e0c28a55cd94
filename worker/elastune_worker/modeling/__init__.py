"""Model construction that serving and tuning share (neither imports the other): ``random_init``
builds models of a real size from a config alone, with random weights, for the engine's runner and for
transformers' model the trainer tunes."""
