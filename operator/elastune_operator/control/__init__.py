"""The control core: fleet, TuningJob lifecycle and the round that ties them (no torch, no kopf)."""
