"""The one rule behind attention_backend, elementwise_backend and lora_backend (triton_choice.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch

from elastune_worker.engine.model_runner.triton_choice import choose_triton

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _check(answer: str | None, calls: list[int]) -> Callable[[], str | None]:
    def problem() -> str | None:
        calls.append(1)
        return answer

    return problem


def test_the_fallback_and_auto_off_cuda_never_run_the_check() -> None:
    calls: list[int] = []
    assert not choose_triton("x_backend", "torch", CUDA, _check(None, calls), "torch")
    assert not choose_triton("x_backend", "auto", CPU, _check(None, calls), "torch")
    assert calls == []  # a check compiles kernels: nobody pays for it who will not use them


def test_auto_on_cuda_takes_triton_when_its_check_passes_and_falls_back_logged_when_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[int] = []
    assert choose_triton("x_backend", "auto", CUDA, _check(None, calls), "torch")
    with caplog.at_level(logging.WARNING):
        assert not choose_triton("x_backend", "auto", CUDA, _check("it differs", calls), "gather")
    assert calls == [1, 1]
    assert "x_backend: gather serves" in caplog.text and "it differs" in caplog.text


def test_triton_asked_for_must_work_on_any_device() -> None:
    assert choose_triton("x_backend", "triton", CPU, lambda: None, "torch")
    with pytest.raises(ValueError, match="x_backend triton: it differs"):
        choose_triton("x_backend", "triton", CUDA, lambda: "it differs", "torch")
