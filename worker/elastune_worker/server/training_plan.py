"""What one tuning assignment runs, worked out before any step: the validated spec, the dataset split,
the tuning config with its starting prompt (the assignment's, the spec's or the Prompt Bank's), where
checkpoints and the artifact go in this pod, and what the succeeded event reports as the artifact. A
checkpoint under ``checkpoint_dir`` is where the trainer resumes. Every check that can refuse the
assignment runs here, in this order, so its reason reaches the job's status before any tuning."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastune_contract import storage
from elastune_contract.api.constants import s3_credentials
from elastune_contract.api.tuningjob import TuningJobSpec
from elastune_contract.protocol import Assignment, PromptBankReport
from elastune_contract.vocabulary import Reason
from elastune_worker.server.models import LoadedModel
from elastune_worker.server.outcomes import AssignmentFailed
from elastune_worker.storage import ownership, s3
from elastune_worker.tuning.data import load_dataset, split
from elastune_worker.tuning.trainer import OutputNotOurs, TuningConfig, check_output_location


@dataclass
class TrainingPlan:
    assignment: Assignment
    """The assignment with its checkpoint and artifact locations as paths in this pod."""
    spec: TuningJobSpec
    config: TuningConfig
    train: list[Any]
    evals: list[Any]
    bank_report: PromptBankReport | None
    """The Prompt Bank's decision, reported with the first progress event (None: the bank was not asked)."""
    published: str | None
    """The artifact's location as the succeeded event names it: a storage URI (s3://, pvc://), or None
    for the path written."""

    @property
    def lead(self) -> bool:
        """Rank 0 reports progress and the result, and writes the artifact."""
        return self.assignment.rank == 0

    def publish(self, local: str) -> str:
        """The artifact saved at ``local`` as the succeeded event reports it. An s3:// output is uploaded
        first (with the Secret the spec names), so a job's status never names an artifact that is not
        there."""
        if self.published and s3.is_s3(self.published):
            s3.upload(local, self.published, _s3_credentials(self.spec))
        return self.published or local


def plan_training(a: Assignment, loaded: LoadedModel, model: str) -> TrainingPlan:
    """The plan of assignment ``a`` on a worker that holds ``model`` (loaded); raises AssignmentFailed,
    DatasetError or StorageError with the reason when it cannot run."""
    if a.model != model:
        raise AssignmentFailed(
            Reason.INVALID_ASSIGNMENT, f"job needs model {a.model!r}, this worker holds {model!r}"
        )
    published = _published_uri(a.artifact_dir)
    a = _with_local_paths(a)
    if a.rank == 0:  # refused now, not after the tuning budget is spent
        try:
            check_output_location(Path(a.artifact_dir))
        except OutputNotOurs as exc:
            raise AssignmentFailed(Reason.INVALID_SPEC, str(exc)) from exc
    try:
        spec = TuningJobSpec.model_validate(a.spec)
    except ValueError as exc:
        raise AssignmentFailed(Reason.INVALID_SPEC, f"spec does not validate: {exc}") from exc
    out = spec.output
    if out and out.uri and s3.is_s3(out.uri):  # staged at artifact_dir, then uploaded by rank 0
        published = out.uri
        if a.rank == 0:  # a missing bucket or refused credentials fail the job now, not after tuning
            s3.check_bucket(out.uri, _s3_credentials(spec))
    if a.rank == 0 and a.owner_uid:  # before anything is written, so the job's deletion knows its files
        s3_out = out.uri if out and out.uri and s3.is_s3(out.uri) else None
        refused = ownership.claim_attempt(
            a.job, a.owner_uid, a.checkpoint_dir, a.artifact_dir, s3_out, _s3_credentials(spec)
        )
        # Refused: an s3:// prefix not ours (another namespace's marker, or objects without one), or an
        # artifact directory another namespace marked (unmarked local content: check_output_location).
        foreign_dir = a.artifact_dir in refused and ownership.read_local(Path(a.artifact_dir)) is not None
        if s3_out in refused or (s3_out is None and foreign_dir):
            where = s3_out or a.artifact_dir
            raise AssignmentFailed(
                Reason.OUTPUT_NOT_OURS,
                f"output {where} holds what this job did not write (another namespace's job marked it, or "
                "it has files without an owner marker); a job never replaces them: name a new location",
            )
    train, evals = split(load_dataset(a.dataset), a.eval_fraction, a.max_eval, a.seed)
    max_length = _max_length(loaded, spec.hyperparameters.virtual_tokens)
    init_text = a.initial_prompt if a.initial_prompt is not None else spec.initial_prompt
    bank_report = None
    if a.prompt_bank != "never":
        # Every rank runs the same deterministic lookup (same bank, model and eval samples), so all
        # start from the same prompt without another round trip; rank 0 reports it.
        selection = _select_prompt(loaded, a, spec, evals, max_length)
        init_text, bank_report = selection.prompt, selection.to_report()
    config = TuningConfig.from_spec(
        spec,
        eval_every=a.eval_every,
        checkpoint_every=a.checkpoint_every,
        seed=a.seed,
        max_length=max_length,
        init_text=init_text,
    )
    return TrainingPlan(a, spec, config, train, evals, bank_report, published)


def _select_prompt(
    loaded: LoadedModel, a: Assignment, spec: TuningJobSpec, evals: list[Any], max_length: int
) -> Any:
    """The Prompt Bank's pick for this job, or its own initial prompt with the reason (never raises
    for a missing/empty bank or unusable eval samples: select_initial_prompt falls back)."""
    from elastune_worker.bank import bank_dir, select_initial_prompt

    return select_initial_prompt(
        bank_dir(str(loaded.path.resolve())),
        loaded.model,
        loaded.tokenizer,
        evals,
        spec.initial_prompt,
        mode=a.prompt_bank,
        budget_s=a.bank_budget_s,
        virtual_tokens=spec.hyperparameters.virtual_tokens,
        layout="soft" if spec.method == "promptTuning" else "text",
        max_length=max_length,
    )


def _s3_credentials(spec: TuningJobSpec) -> str | None:
    """The s3:// output's credentials as the storage code takes them: the Secret, the pod's identity
    only when the spec asks for it, else None (refused)."""
    out = spec.output
    return s3_credentials(out.secret_name, out.use_ambient_credentials) if out else None


def _max_length(loaded: LoadedModel, virtual_tokens: int) -> int:
    """Input+target tokens per sample: the default, capped so the virtual tokens still fit the
    model's context (small models have short ones)."""
    config = loaded.model.config
    context = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    default = TuningConfig.max_length
    if context is None:
        return default
    room = context - virtual_tokens
    if room < 16:
        raise AssignmentFailed(
            Reason.INVALID_SPEC,
            f"spec.hyperparameters.virtualTokens ({virtual_tokens}) leaves {room} of the model's "
            f"{context} positions for the input and target; use fewer virtual tokens",
        )
    return min(default, room)


def _with_local_paths(a: Assignment) -> Assignment:
    """The assignment with its checkpoint and artifact locations as paths in this pod: a pvc:// URI is
    the claim's mount, through the one resolver the adapter loader (engine.model_runner.lora.storage)
    reads by."""
    try:
        ckpt, out = (str(storage.local_path(u)) for u in (a.checkpoint_dir, a.artifact_dir))
    except ValueError as exc:
        raise AssignmentFailed(Reason.INVALID_ASSIGNMENT, f"checkpoint or artifact location: {exc}") from exc
    return a.model_copy(update={"checkpoint_dir": ckpt, "artifact_dir": out})


def _published_uri(location: str) -> str | None:
    """What the succeeded event reports for an artifact written to ``location``: a storage URI as given
    (pvc://: readable from any pod that mounts the claim, unlike this pod's path); None for a path or
    file:// URI (the path written is reported, as before)."""
    try:
        loc = storage.parse(location)
    except ValueError:
        return None
    return None if loc.scheme in ("", storage.FILE) else str(loc)
