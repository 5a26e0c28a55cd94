"""A pvc:// output is written where the adapter loader reads it (issue 23): the operator's runtime (core
thread + Knative backend, on the Kubernetes API emulator) dispatches a TuningJob whose output is
pvc://shared/prompts/author to a real worker agent tuning the small test model in this process, with
the claims' mount root ($ELASTUNE_PVC_ROOT) a temporary directory. The tuned prompt and the checkpoints
land on the claim; the status publishes the pvc:// URI; the LoRA loader and the control plane's artifact
check resolve that URI to the very directory the tuner wrote.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("kmock")


from elastune_contract.api.constants import PVC_ROOT_ENV  # noqa: E402
from elastune_contract.api.loraadapter import LoRAAdapterSpec  # noqa: E402
from elastune_demo import build as tiny_build  # noqa: E402
from elastune_demo import tasks as tiny_tasks  # noqa: E402
from elastune_operator.control import artifacts  # noqa: E402
from elastune_worker.engine.model_runner.lora.storage import resolve_artifact  # noqa: E402
from elastune_worker.server.agent import Agent, AgentConfig  # noqa: E402
from operator_site import NS, OperatorSite, wait_for  # noqa: E402
from tiny_test_model import TASK, TEST_SPEC  # noqa: E402 - the small model and task of the tuning tests


def test_a_pvc_output_lands_where_the_adapter_loader_reads_it(
    tmp_path: Path, redis_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = str(tiny_build.ensure_tiny_model(spec=TEST_SPEC))
    task = tiny_tasks.make_task(TASK, n_train=16, n_eval=4, seed=1)
    dataset = tiny_tasks.write_jsonl(list(task.train) + list(task.eval), tmp_path / "d.jsonl")
    claims = tmp_path / "pvc"  # every claim of the pool, as the pods mount them
    (claims / "shared").mkdir(parents=True)
    monkeypatch.setenv(PVC_ROOT_ENV, str(claims))

    operator = OperatorSite(tmp_path, redis_server.url, "pvc", model=model)
    try:
        operator.pool("tiny", volumes=[{"claimName": "shared"}])
        operator.job(
            "author",
            output={"uri": "pvc://shared/prompts/author"},
            dataset=str(dataset),
            termination={"maxIterations": 4},
            hyperparameters={"batchSize": 4, "virtualTokens": 4},
        )
        wait_for("the pool to grow", lambda: operator.runtime.backend.pools[f"{NS}/tiny"][1] >= 1)
        agent = Agent(AgentConfig("tiny-pod-1", "tiny", model), operator.bus)
        assert agent.load()
        wid = operator.ready_worker("tiny-pod-1", "tiny")
        a = wait_for("an assignment", lambda: operator.bus.pop_assignment(wid, timeout=0.2))
        assert agent.run_assignment(a) == "succeeded"

        def finished() -> str | None:
            status = operator.conditions("author").get("Succeeded", {}).get("status")
            return None if status in (None, "Unknown") else status

        assert wait_for("the job to finish", finished) == "True", operator.conditions("author")
        uri = operator.status("author")["artifactURI"]
    finally:
        operator.close()

    written = claims / "shared" / "prompts" / "author"
    assert uri == "pvc://shared/prompts/author"  # what a reader in any pod of the pool can use
    assert (written / "adapter_config.json").is_file()
    assert resolve_artifact(uri) == str(written)  # the adapter loader reads what the tuner wrote
    adapter = {"baseModel": model, "artifactURL": uri, "type": "promptTuning"}
    info = artifacts.inspect(LoRAAdapterSpec.model_validate(adapter), 64)
    assert isinstance(info, artifacts.ArtifactInfo) and info.checked, info
    # No output.uri of its own and no jobStorage volume: the checkpoints share the output's claim.
    uid = a.checkpoint_dir.rsplit("/", 1)[-1]
    ckpts = sorted((claims / "shared" / "elastune" / "checkpoints" / NS / "author" / uid).glob("ckpt-*.pt"))
    assert ckpts, sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("ckpt-*.pt"))
    assert not (tmp_path / "pod-tmp").exists()  # nothing in the pod's ephemeral work dir
