"""A Hugging Face Hub stand-in: a real HTTP server process answering the routes the real
``huggingface_hub`` client uses to download a snapshot, for repositories of local directories.

Routes and rules, read from huggingface/huggingface_hub (src/huggingface_hub/):

- ``GET /api/models/<org>/<name>[/revision/<rev>]``: model_info / repo_info (hf_api.py ``model_info``);
  the JSON's ``sha`` is the commit the revision resolves to, ``siblings`` the files.
- ``GET /api/models/<org>/<name>/tree/<rev>[/<path>]?recursive=…``: list_repo_tree (hf_api.py
  ``_list_repo_tree_pages``, what _snapshot_download.py lists the files with): entries
  ``{"type": "file", "path", "size", "oid"}``; one page (no ``Link`` header, utils/_pagination.py).
- ``HEAD|GET /<org>/<name>/resolve/<rev>/<file>``: file_download.py ``get_hf_file_metadata`` reads
  ``X-Repo-Commit`` (required), ``X-Linked-Etag`` or ``ETag`` (required), ``X-Linked-Size`` or
  ``Content-Length``; ``http_get`` then downloads the body (``Range: bytes=N-`` when resuming). No
  ``X-Xet-*`` headers, so the client takes the plain HTTP path.
- Errors as utils/_http.py ``hf_raise_for_status`` reads them: ``X-Error-Code`` RepoNotFound (404),
  RevisionNotFound (404), EntryNotFound (404), GatedRepo (403); a token the hub does not know is a 401
  with ``X-Error-Message: Invalid credentials in Authorization header`` (raised as a plain 401, which
  _snapshot_download.py re-raises); a private repository asked for without a token is a 401 with
  RepoNotFound (the Hub hides private repositories from anonymous callers).

Tokens are Bearer tokens (``Authorization: Bearer <token>``, utils/_headers.py ``build_hf_headers``).
Commits are sha1 digests of the revision's file listing, so a branch name resolves to a stable
40-hex commit, which may also be used as the revision. ``GET /_standin/requests`` answers the requests
seen per repository and route (``info``, ``tree``, ``head``, ``get``) for tests to count downloads;
``POST /_standin/reset`` clears them.

    python -m elastune_testing.hub_standin --config hub.json --host 127.0.0.1 --port 0

with hub.json ``{"tokens": ["hf_good"], "repos": {"org/name": {"revisions": {"main": "/dir"},
"private": true, "gated": false}}}``. The process prints ``listening <url>`` once it serves.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

INVALID_CREDENTIALS = "Invalid credentials in Authorization header"


def _blob_oid(data: bytes) -> str:
    """git's blob id (what the Hub reports as a non-LFS file's oid and ETag)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class _Revision:
    commit: str
    files: dict[str, Path]  # path in the repo -> file on disk


class Hub:
    """The repositories and the request counts; the HTTP handler reads it."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.tokens = set(config.get("tokens") or [])
        self.repos: dict[str, dict[str, Any]] = {}
        self.revisions: dict[str, dict[str, _Revision]] = {}
        for repo, spec in (config.get("repos") or {}).items():
            self.repos[repo] = spec
            revs: dict[str, _Revision] = {}
            for name, folder in (spec.get("revisions") or {}).items():
                root = Path(folder)
                files = {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}
                listing = json.dumps([(k, _blob_oid(v.read_bytes())) for k, v in files.items()])
                revs[name] = _Revision(hashlib.sha1(f"{repo}@{name}:{listing}".encode()).hexdigest(), files)
            self.revisions[repo] = revs
        self.requests: dict[str, Counter[str]] = defaultdict(Counter)
        self.lock = threading.Lock()

    def revision(self, repo: str, rev: str) -> _Revision | None:
        revs = self.revisions.get(repo, {})
        return revs.get(rev) or next((r for r in revs.values() if r.commit == rev), None)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the hub; every answer carries Content-Length
    hub: Hub

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet: tests read counts, not logs
        pass

    # -- plumbing ---------------------------------------------------------------------------------
    def _send(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None,
              content_type: str = "application/json") -> None:  # fmt: skip
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, code: int, error_code: str | None, message: str) -> None:
        headers = {"X-Error-Message": message}
        if error_code:
            headers["X-Error-Code"] = error_code
        self._send(code, json.dumps({"error": message}).encode(), headers)

    def _count(self, repo: str, route: str) -> None:
        with self.hub.lock:
            self.hub.requests[repo][route] += 1

    def _authorised(self, repo: str) -> bool:
        """False after answering 401/403: a token the hub does not know (whatever the repo), a private
        or gated repo without a valid token."""
        auth = self.headers.get("Authorization", "")
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        if token is not None and token not in self.hub.tokens:
            self._error(401, None, INVALID_CREDENTIALS)
            return False
        spec = self.hub.repos.get(repo, {})
        if token is None and spec.get("private"):
            self._error(401, "RepoNotFound", "Repository not found")
            return False
        if spec.get("gated") and token is None:
            self._error(403, "GatedRepo", "Access to this repository is restricted")
            return False
        return True

    # -- routes -----------------------------------------------------------------------------------
    def do_HEAD(self) -> None:
        self._route()

    def do_GET(self) -> None:
        self._route()

    def do_POST(self) -> None:
        if self.path == "/_standin/reset":
            with self.hub.lock:
                self.hub.requests.clear()
            self._send(200, b"{}")
        else:
            self._error(404, None, "not found")

    def _route(self) -> None:
        parts = [unquote(p) for p in urlsplit(self.path).path.split("/") if p]
        if parts[:2] == ["_standin", "requests"]:
            with self.hub.lock:
                body = json.dumps({k: dict(v) for k, v in self.hub.requests.items()}).encode()
            return self._send(200, body)
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo = "/".join(parts[2:4])
            rest = parts[4:]
            if not rest:
                return self._info(repo, "main")
            if rest[0] == "revision" and len(rest) >= 2:
                return self._info(repo, "/".join(rest[1:]))
            if rest[0] == "tree" and len(rest) >= 2:
                return self._tree(repo, rest[1], "/".join(rest[2:]))
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._file(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]))
        return self._error(404, None, f"no route {self.path}")

    def _resolve(self, repo: str, rev: str, route: str) -> _Revision | None:
        self._count(repo, route)
        if not self._authorised(repo):
            return None
        if repo not in self.hub.repos:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        found = self.hub.revision(repo, rev)
        if found is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return found

    def _info(self, repo: str, rev: str) -> None:
        found = self._resolve(repo, rev, "info")
        if found is not None:
            private = bool(self.hub.repos[repo].get("private"))
            body = {"id": repo, "modelId": repo, "sha": found.commit, "private": private,
                    "siblings": [{"rfilename": name} for name in found.files]}  # fmt: skip
            self._send(200, json.dumps(body).encode())

    def _tree(self, repo: str, rev: str, prefix: str) -> None:
        found = self._resolve(repo, rev, "tree")
        if found is None:
            return
        entries = []
        for name, path in found.files.items():
            if prefix and not name.startswith(prefix.rstrip("/") + "/"):
                continue
            data = path.read_bytes()
            entries.append({"type": "file", "path": name, "size": len(data), "oid": _blob_oid(data)})
        self._send(200, json.dumps(entries).encode())

    def _file(self, repo: str, rev: str, name: str) -> None:
        found = self._resolve(repo, rev, "head" if self.command == "HEAD" else "get")
        if found is None:
            return
        path = found.files.get(name)
        if path is None:
            return self._error(404, "EntryNotFound", f"{name} does not exist at {rev}")
        data = path.read_bytes()
        etag = f'"{_blob_oid(data)}"'
        headers = {"X-Repo-Commit": found.commit, "ETag": etag, "Accept-Ranges": "bytes"}
        start = 0
        rng = self.headers.get("Range", "")
        if rng.startswith("bytes=") and rng[6:].split("-")[0].isdigit():
            start = int(rng[6:].split("-")[0])
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        self._send(206 if start else 200, data[start:], headers, "application/octet-stream")


def serve(config: dict[str, Any], host: str, port: int) -> ThreadingHTTPServer:
    handler = type("Handler", (_Handler,), {"hub": Hub(config)})
    return ThreadingHTTPServer((host, port), handler)


# -- the process, for tests -------------------------------------------------------------------------


@dataclass
class HubStandIn:
    url: str
    proc: subprocess.Popen[bytes]

    def requests(self) -> dict[str, dict[str, int]]:
        """Requests seen per repository and route (info, tree, head, get)."""
        with urllib.request.urlopen(f"{self.url}/_standin/requests", timeout=10) as resp:
            counts: dict[str, dict[str, int]] = json.loads(resp.read())
        return counts

    def reset(self) -> None:
        req = urllib.request.Request(f"{self.url}/_standin/reset", b"", method="POST")
        urllib.request.urlopen(req, timeout=10).close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start(
    config: dict[str, Any], workdir: Path, host: str = "127.0.0.1", timeout: float = 30.0
) -> HubStandIn:
    """Start the stand-in as its own process on ``host`` (a free port); RuntimeError if it does not serve."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "hub.json"
    cfg.write_text(json.dumps(config))
    log = (workdir / "hub.log").open("wb")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "elastune_testing.hub_standin", "--config", str(cfg), "--host", host,
         "--port", "0"],
        stdout=subprocess.PIPE, stderr=log, env=env,
    )  # fmt: skip
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    line = b""
    while time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        if line.startswith(b"listening "):
            return HubStandIn(line.split()[1].decode(), proc)
    proc.kill()
    raise RuntimeError(f"the hub stand-in did not start: {line!r}, see {workdir / 'hub.log'}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A Hugging Face Hub stand-in for tests")
    parser.add_argument("--config", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    server = serve(json.loads(Path(args.config).read_text()), args.host, args.port)
    host, port = server.server_address[:2]
    assert isinstance(host, str)
    print(f"listening http://{host}:{port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
