"""``python -m elastune_worker.storage.cleanup``: the cleanup Job's container (operator k8s/retention.py).

Deletes each target (pvc://claim/path, s3://bucket/prefix) only where its owner marker names the deleted
resource's namespace and uid (ownership.py); a target without one, or with another owner's, is left and
said so. Runs in the resource's namespace with the claims mounted at $ELASTUNE_PVC_ROOT/<claim> and the
S3 Secret at $ELASTUNE_S3_SECRETS_ROOT/<secret>, as the workers see them: the operator itself mounts no
claim and never reads a Secret. Idempotent: a target already gone counts as done, so a retried pod
finishes what an earlier one started.

Exit 0 when nothing is left that was ours; 1 after a storage error, with the last line
``<Reason>: <message>`` (the pod's termination message, FallbackToLogsOnError).
"""

from __future__ import annotations

import argparse
import sys

from elastune_contract import storage
from elastune_contract.vocabulary import Reason
from elastune_worker.storage import ownership, s3


def clean(target: str, namespace: str, uid: str, secret: str | None) -> ownership.Outcome:
    if s3.is_s3(target):
        return ownership.delete_s3(target, secret, namespace, uid)
    return ownership.delete_local(storage.local_path(target), namespace, uid)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--namespace", required=True, help="namespace of the deleted resource")
    p.add_argument("--owner-uid", required=True, help="uid an owner marker must name")
    p.add_argument("--s3-secret", default=None, help="mounted Secret with the S3 credentials")
    p.add_argument("targets", nargs="*", help="pvc:// or s3:// locations")
    args = p.parse_args(argv)
    failed = None
    for target in args.targets:
        try:
            outcome = clean(target, args.namespace, args.owner_uid, args.s3_secret)
        except (s3.StorageError, OSError, ValueError) as exc:
            failed = (
                exc
                if isinstance(exc, s3.StorageError)
                else s3.StorageError(Reason.STORAGE_UNREACHABLE, str(exc))
            )
            print(f"failed {target}: {exc}", flush=True)
            continue
        print(f"{outcome} {target}", flush=True)
    if failed is not None:
        print(f"{failed.reason}: {failed}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
