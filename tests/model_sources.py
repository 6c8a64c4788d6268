"""Local model sources for the pull tests: a hub-compatible HTTP server and moto's S3 server.

``HubFixture`` serves, on 127.0.0.1, the endpoints huggingface_hub's ``model_info``,
``list_repo_tree`` and ``snapshot_download`` call:

    GET  /api/models/{repo}[/revision/{rev}]       {"id", "sha", "siblings"}
    GET  /api/models/{repo}/tree/{rev}             [{"type": "file", "path", "size", "oid",
                                                     "lfs": {"oid", "size", "pointerSize"}}]
    HEAD/GET /{repo}/resolve/{rev}/{path}          X-Repo-Commit, ETag (git blob id, or the LFS
                                                   SHA-256 with X-Linked-Etag/X-Linked-Size),
                                                   Content-Length; Range -> 206

Errors carry the hub's ``X-Error-Code`` (RepoNotFound, RevisionNotFound, EntryNotFound); a
private repo answers 401 without its token, as the hub does. Knobs for the tests: ``corrupt``
(serve a file with one byte flipped, N times), ``delay_s`` per 64 KiB chunk (to kill a pull
mid-download), and ``gets`` (bytes served per file: "downloaded once" is countable).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

LFS_MIN_BYTES = 1024  # files at least this big are "LFS" files (SHA-256 digests)


def weights(size: int, seed: int = 0) -> bytes:
    return hashlib.shake_256(f"weights-{seed}".encode()).digest(size)


# A small diffusers-shaped repository: two configs (git blobs) and two "LFS" weight files.
FILES = {"model_index.json": b'{"_class_name": "FluxPipeline"}',
         "transformer/config.json": b'{"num_layers": 2}',
         "transformer/diffusion_pytorch_model.safetensors": weights(300_000),
         "vae/diffusion_pytorch_model.safetensors": weights(50_000, 1)}


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    branches: tuple[str, ...] = ("main",)
    token: str | None = None  # private: only this bearer token may read it


@dataclass
class HubFixture:
    repos: dict[str, Repo] = field(default_factory=dict)
    corrupt: dict[str, int] = field(default_factory=dict)  # path -> times to serve it flipped
    delay_s: float = 0.0
    gets: Counter[str] = field(default_factory=Counter)
    url: str = ""

    def _lookup(self, repo_id: str, rev: str, auth: str | None) -> tuple[Repo | None, int, str]:
        repo = self.repos.get(repo_id)
        if repo is None:
            return None, 404, "RepoNotFound"
        if repo.token is not None and auth != f"Bearer {repo.token}":
            return None, 401, "RepoNotFound"
        if rev not in (repo.commit, *repo.branches):
            return None, 404, "RevisionNotFound"
        return repo, 200, ""

    @contextlib.contextmanager
    def running(self) -> Iterator[HubFixture]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None,
                      *, head: bool = False) -> None:
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                if "Content-Length" not in (headers or {}):
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _error(self, code: int, error_code: str, *, head: bool = False) -> None:
                body = json.dumps({"error": error_code}).encode()
                self._send(code, body, {"X-Error-Code": error_code,
                                        "Content-Type": "application/json"}, head=head)

            def _json(self, doc: Any) -> None:
                self._send(200, json.dumps(doc).encode(), {"Content-Type": "application/json"})

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                self._route(head=False)

            def do_HEAD(self) -> None:  # noqa: N802
                self._route(head=True)

            def _route(self, *, head: bool) -> None:
                path = self.path.split("?", 1)[0]
                auth = self.headers.get("Authorization")
                m = re.match(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?$", path)
                if m:
                    repo, code, err = hub._lookup(m.group(1), m.group(2) or "main", auth)
                    if repo is None:
                        return self._error(code, err)
                    return self._json({"id": m.group(1), "sha": repo.commit,
                                       "siblings": [{"rfilename": n} for n in repo.files]})
                m = re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)$", path)
                if m:
                    repo, code, err = hub._lookup(m.group(1), m.group(2), auth)
                    if repo is None:
                        return self._error(code, err)
                    return self._json([_tree_row(n, data) for n, data in repo.files.items()])
                m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
                if m:
                    return self._resolve(m.group(1), m.group(2), m.group(3), auth, head=head)
                return self._error(404, "NotFound", head=head)

            def _resolve(self, repo_id: str, rev: str, name: str, auth: str | None, *,
                         head: bool) -> None:
                repo, code, err = hub._lookup(repo_id, rev, auth)
                if repo is None:
                    return self._error(code, err, head=head)
                if name not in repo.files:
                    return self._error(404, "EntryNotFound", head=head)
                data = repo.files[name]
                etag = (hashlib.sha256(data).hexdigest() if len(data) >= LFS_MIN_BYTES
                        else git_blob_id(data))
                headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{etag}"',
                           "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
                if len(data) >= LFS_MIN_BYTES:
                    headers |= {"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))}
                if head:
                    return self._send(200, b"", headers | {"Content-Length": str(len(data))},
                                      head=True)
                if hub.corrupt.get(name, 0) > 0:
                    hub.corrupt[name] -= 1
                    data = bytes([data[0] ^ 0xFF]) + data[1:]
                start = 0
                rng = re.match(r"bytes=(\d+)-", self.headers.get("Range", ""))
                if rng:
                    start = int(rng.group(1))
                    headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                body = data[start:]
                self.send_response(206 if rng else 200)
                for k, v in (headers | {"Content-Length": str(len(body))}).items():
                    self.send_header(k, v)
                self.end_headers()
                for i in range(0, len(body), 64 * 1024):
                    if hub.delay_s:
                        time.sleep(hub.delay_s)
                    chunk = body[i:i + 64 * 1024]
                    try:
                        self.wfile.write(chunk)
                    except (BrokenPipeError, ConnectionResetError):
                        return
                    hub.gets[name] += len(chunk)

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        try:
            yield self
        finally:
            server.shutdown()
            server.server_close()


def _tree_row(name: str, data: bytes) -> dict[str, Any]:
    row: dict[str, Any] = {"type": "file", "path": name, "size": len(data),
                           "oid": git_blob_id(data)}
    if len(data) >= LFS_MIN_BYTES:
        row["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                      "pointerSize": 134}
    return row


@contextlib.contextmanager
def moto_s3() -> Iterator[dict[str, str]]:
    """moto's S3 in server mode on 127.0.0.1 (a real HTTP endpoint boto3 talks to); yields
    the environment a pull needs (endpoint, region, fake credentials)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield {"AWS_ENDPOINT_URL_S3": f"http://{host}:{port}", "AWS_REGION": "us-east-1",
               "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    finally:
        server.stop()
