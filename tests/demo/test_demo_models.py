"""The demo model names reach the worker through the ``elastune.models`` entry points, never an import of
the demo package; without it, a demo name is an error that says what to install or name instead."""

from importlib import metadata
from importlib.metadata import EntryPoint

import pytest

from elastune_worker.server import models
from elastune_worker.server.models import ModelLoadError, named_model_dir, resolve_model


@pytest.mark.parametrize(
    ("name", "builder"),
    [
        ("tiny-gpt2", "elastune_demo.models:tiny_gpt2"),
        ("elastune/tiny-gpt2", "elastune_demo.models:tiny_gpt2"),
        ("tiny-llama", "elastune_demo.models:tiny_llama"),
        ("elastune/tiny-llama", "elastune_demo.models:tiny_llama"),
    ],
)
def test_each_demo_name_is_an_entry_point_of_the_demo_package(name, builder):
    (ep,) = metadata.entry_points(group=models.MODELS_GROUP, name=name)
    assert ep.value == builder
    assert name in models.DEMO_MODEL_NAMES


def test_the_worker_resolves_a_demo_name_to_the_demo_build():
    from elastune_demo.build import ensure_tiny_model

    assert resolve_model("tiny-gpt2") == ensure_tiny_model()


def _registered(monkeypatch, *eps: EntryPoint) -> None:
    monkeypatch.setattr(
        metadata,
        "entry_points",
        lambda group, name: [ep for ep in eps if ep.group == group and ep.name == name],
    )


@pytest.mark.parametrize(
    "registered",
    [
        pytest.param((), id="demo-not-installed"),
        pytest.param(
            (EntryPoint("tiny-llama", "elastune_demo_left_out.models:tiny_llama", models.MODELS_GROUP),),
            id="registered-but-package-left-out-of-the-image",
        ),
    ],
)
def test_a_demo_name_without_the_demo_package_says_what_to_install(monkeypatch, registered):
    _registered(monkeypatch, *registered)
    with pytest.raises(ModelLoadError) as err:
        resolve_model("tiny-llama")
    said = str(err.value)
    assert "elastune_demo" in said and "not installed" in said and "pip install" in said, said
    assert "Hugging Face id" in said, said  # what to name instead


def test_another_package_may_register_a_model_name(monkeypatch, tmp_path):
    _registered(monkeypatch, EntryPoint("house-model", "pathlib:Path.cwd", models.MODELS_GROUP))
    monkeypatch.chdir(tmp_path)
    assert named_model_dir("house-model") == tmp_path
    assert named_model_dir("not-registered") is None
