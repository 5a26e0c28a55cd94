"""An S3 emulator for tests: moto's server (``moto_server`` from ``moto[server]``) on a free loopback
port, a real HTTP process speaking the S3 API, as the API emulator stands in for Kubernetes.

Credentials are enforced: the emulator starts open, an IAM user with an S3 policy and its access key
are created, then ``/moto-api/reset-auth`` makes every later request authenticate, so wrong keys get
the InvalidAccessKeyId a real endpoint answers. Use ``S3Emulator.secret_dir`` to lay out a Secret the
way its volume mount does (one file per key).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastune_common.servers import free_port

REGION = "us-east-1"


@dataclass
class S3Emulator:
    endpoint: str
    access_key_id: str
    secret_access_key: str
    proc: subprocess.Popen[bytes]

    def client(self, access_key_id: str | None = None, secret_access_key: str | None = None) -> Any:
        import boto3

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=access_key_id or self.access_key_id,
            aws_secret_access_key=secret_access_key or self.secret_access_key,
        )

    def secret_keys(self, **override: str) -> dict[str, str]:
        keys = {
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": REGION,
        }
        return {**keys, **override}

    def secret_dir(self, root: Path, name: str, **override: str) -> Path:
        """``root/name/<KEY>`` files, as a Secret volume mounts them; returns ``root``."""
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for key, value in self.secret_keys(**override).items():
            (folder / key).write_text(value)
        return root

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start(log: Path) -> S3Emulator:
    """Start the S3 emulator and enforce credentials; RuntimeError when it cannot run."""
    # The test interpreter's own moto, never a `moto_server` found first on PATH: another Python's
    # moto (5.2.1 behind a pyenv shim on CI) signs query values containing "/" differently from the
    # botocore the tests use and answers SignatureDoesNotMatch to every prefixed LIST.
    if importlib.util.find_spec("moto.server") is None:
        raise RuntimeError("moto is not installed: pip install 'moto[server]>=5.2.5' (the S3 emulator)")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["MOTO_ALLOW_NONEXISTENT_REGION"] = "true"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the S3 emulator exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the S3 emulator did not answer on {endpoint}") from None
            time.sleep(0.2)
    try:
        return _enforce_credentials(endpoint, proc)
    except Exception:
        proc.kill()
        proc.wait()
        raise


def _enforce_credentials(endpoint: str, proc: subprocess.Popen[bytes]) -> S3Emulator:
    import boto3

    iam = boto3.session.Session().client(
        "iam",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id="setup",
        aws_secret_access_key="setup",
    )
    iam.create_user(UserName="elastune-tests")
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
    iam.put_user_policy(UserName="elastune-tests", PolicyName="s3", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="elastune-tests")["AccessKey"]
    req = urllib.request.Request(
        f"{endpoint}/moto-api/reset-auth", data=b"0", method="POST", headers={"Content-Type": "text/plain"}
    )
    with urllib.request.urlopen(req, timeout=5):
        pass
    return S3Emulator(endpoint, key["AccessKeyId"], key["SecretAccessKey"], proc)
