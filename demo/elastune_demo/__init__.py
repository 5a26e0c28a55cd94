"""Demo fixtures: tiny, self-made models, their task suite and adapters, and the Prompt Bank demo pieces
(no hub downloads; docs/design.md §6).

Not product code: no product package imports it (an import-linter contract, pyproject.toml). Workers find
its model names through the ``elastune.models`` entry points (``models.py``); ``elastune bank`` runs its
``bank_cli``; the tests and benchmarks import it directly.
"""
