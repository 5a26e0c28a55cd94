"""Real Redis and Memcached servers on free local ports — the bus and storage-channel endpoints of
`elastune run`, the storage-channel benchmark and the test fixtures (no fakes: docs/design.md §6)."""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

INSTALL_HINT = "apt-get install -y redis-server memcached"


class ServerError(RuntimeError):
    """A server binary is missing or the server did not come up."""


@dataclass
class Server:
    name: str
    port: int
    url: str
    proc: subprocess.Popen[bytes]

    def stop(self) -> None:
        # SIGKILL: the servers keep nothing worth flushing, and memcached's SIGTERM exit lags up to 1 s.
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise ServerError(f"{name} is not installed (real storage-channel servers need it): {INSTALL_HINT}")
    return path


def _start(
    name: str, argv_for_port: list[str], url_for_port: str, log: Path, port: int | None = None
) -> Server:
    """Start the server (on ``port``, else a free one, retrying on a port race), and wait until it
    accepts TCP connections."""
    last_err = ""
    argv: list[str] = []
    fixed = port
    for _ in range(3):
        port = fixed or free_port()
        argv = [a.format(port=port) for a in argv_for_port]
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    return Server(name, port, url_for_port.format(port=port), proc)
            except OSError:
                time.sleep(0.02)
        Server(name, port, "", proc).stop()
        last_err = log.read_text(errors="replace")[-2000:]
    raise ServerError(f"could not start {name} ({' '.join(argv)}):\n{last_err}")


def start_redis(workdir: Path, *extra: str, port: int | None = None, password: str | None = None) -> Server:
    """A throw-away redis-server (no persistence) with its log in ``workdir``; on ``port`` (a restart
    keeps its address), with ``password`` required of every client. The password goes in a config file
    only its owner reads, never on the command line (which every local user can list)."""
    workdir.mkdir(parents=True, exist_ok=True)
    argv = [binary("redis-server")]
    if password is not None:
        conf = workdir / "auth.conf"
        conf.touch(mode=0o600)
        conf.chmod(0o600)
        conf.write_text(f"requirepass {password}\n")
        argv.append(str(conf))
    argv += ["--port", "{port}", "--bind", "127.0.0.1"]
    argv += ["--save", "", "--appendonly", "no", "--dir", str(workdir), *extra]
    return _start("redis-server", argv, "redis://127.0.0.1:{port}/0", workdir / "redis.log", port)


def start_memcached(workdir: Path, *extra: str) -> Server:
    """A memcached; pass ``-I 8m`` or so for gradients larger than the 1 MiB default item size."""
    workdir.mkdir(parents=True, exist_ok=True)
    argv = [binary("memcached"), "-p", "{port}", "-U", "0", "-l", "127.0.0.1", *extra]
    if os.geteuid() == 0:
        argv += ["-u", getpass.getuser()]  # memcached refuses to run as root without -u
    return _start("memcached", argv, "memcached://127.0.0.1:{port}", workdir / "memcached.log")
