"""Prompt tuning: per-step compute vs gradient sync (``sync``), the Prompt Bank (``bank``)."""
