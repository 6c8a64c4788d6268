"""A local hub-compatible HTTP server, for the pull tests and ``bench/model_delivery.py``.

``LocalHub`` serves model repositories held in memory, on 127.0.0.1, through the endpoints
huggingface_hub's ``model_info``, ``list_repo_tree`` and file downloads (``http_get`` of a
``resolve`` URL, ``hf_hub_download``, ``snapshot_download``) call:

    GET  /api/models/{repo}[/revision/{rev}]       {"id", "sha", "siblings"}
    GET  /api/models/{repo}/tree/{rev}             [{"type": "file", "path", "size", "oid",
                                                     "lfs": {"oid", "size", "pointerSize"}}]
    HEAD/GET /{repo}/resolve/{rev}/{path}          X-Repo-Commit, ETag (git blob id, or the LFS
                                                   SHA-256 with X-Linked-Etag/X-Linked-Size),
                                                   Content-Length; Range -> 206

Errors carry the hub's ``X-Error-Code`` (RepoNotFound, RevisionNotFound, EntryNotFound); a
private repo answers 401 without its token, as the hub does. What it does to the bytes it
serves, for tests and benchmarks to judge a pull by:

- ``served`` counts the bytes of each file written to a client, and ``gets`` records each GET
  of a file (the byte it started at, the bytes sent): "downloaded once" and "resumed at byte
  N" are countable;
- ``corrupt`` serves a file with one byte (in its middle) flipped, N times;
- ``hold(name, at)`` stops a file's GETs after byte ``at`` until ``release()``: a client can
  be killed mid-download at a known point, without timing;
- ``delay_s`` sleeps before each 64 KiB chunk.

Nothing in cachectl imports it; it is stdlib only, so the tests and the benchmark share it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

LFS_MIN_BYTES = 1024  # files at least this big are "LFS" files (SHA-256 digests)
CHUNK = 64 * 1024
HOLD_LIMIT_S = 600.0  # a held GET gives up after this long (a bench or test that forgot)


def git_blob_id(data: bytes) -> str:
    blob = hashlib.sha1(f"blob {len(data)}\0".encode())
    blob.update(data)  # not header + data: that would copy a GiB file
    return blob.hexdigest()


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    branches: tuple[str, ...] = ("main",)
    token: str | None = None  # private: only this bearer token may read it
    # name -> (size, SHA-256, git blob id): hashing a GiB on every HEAD or tree listing
    # would dominate a benchmark. Keyed by size too, so a test that swaps a file is seen.
    _digests: dict[str, tuple[int, str, str]] = field(default_factory=dict, repr=False)

    def _hashes(self, name: str) -> tuple[int, str, str]:
        data = self.files[name]
        known = self._digests.get(name)
        if known is None or known[0] != len(data):
            known = (len(data), hashlib.sha256(data).hexdigest(), git_blob_id(data))
            self._digests[name] = known
        return known

    def etag(self, name: str) -> str:
        """The hub's ETag of ``name``: the LFS SHA-256, or the git blob id of a small file."""
        size, sha256, blob_id = self._hashes(name)
        return sha256 if size >= LFS_MIN_BYTES else blob_id

    def tree_row(self, name: str) -> dict[str, Any]:
        size, sha256, blob_id = self._hashes(name)
        row: dict[str, Any] = {"type": "file", "path": name, "size": size, "oid": blob_id}
        if size >= LFS_MIN_BYTES:
            row["lfs"] = {"oid": sha256, "size": size, "pointerSize": 134}
        return row


@dataclass
class Get:
    """One GET of a file: where it started (its Range) and how many bytes went out."""

    name: str
    start: int
    sent: int = 0


@dataclass
class LocalHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    corrupt: dict[str, int] = field(default_factory=dict)  # path -> times to serve it flipped
    hold_at: dict[str, int] = field(default_factory=dict)  # path -> stop GETs at this byte
    delay_s: float = 0.0
    served: Counter[str] = field(default_factory=Counter)
    gets: list[Get] = field(default_factory=list)  # every GET of a file, in order
    url: str = ""
    _count_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _released: threading.Event = field(default_factory=threading.Event, repr=False)
    _held_since: int = field(default=0, repr=False)

    def hold(self, name: str, at: int) -> None:
        """Stop GETs of ``name`` after byte ``at`` until ``release()``."""
        self._released.clear()
        self.hold_at[name] = at
        self._held_since = len(self.gets)  # earlier GETs of the file do not count

    def release(self) -> None:
        """Let held GETs go on (and stop holding new ones)."""
        self.hold_at.clear()
        self._released.set()

    def held(self, name: str) -> bool:
        """True once a GET of ``name`` has sent every byte before its hold point."""
        at = self.hold_at.get(name)
        return at is not None and any(g.name == name and g.start + g.sent >= at
                                       for g in self.gets[self._held_since:])

    def _lookup(self, repo_id: str, rev: str, auth: str | None) -> tuple[Repo | None, int, str]:
        repo = self.repos.get(repo_id)
        if repo is None:
            return None, 404, "RepoNotFound"
        if repo.token is not None and auth != f"Bearer {repo.token}":
            return None, 401, "RepoNotFound"
        if rev not in (repo.commit, *repo.branches):
            return None, 404, "RevisionNotFound"
        return repo, 200, ""

    def _count(self, get: Get, nbytes: int) -> None:
        with self._count_lock:
            self.served[get.name] += nbytes
            get.sent += nbytes

    def _body(self, name: str, data: bytes, start: int) -> Iterator[bytes | memoryview]:
        """The bytes of ``data`` from ``start``, in chunks, a flipped middle byte when asked
        (no copy of the file: a GiB file is served from one buffer)."""
        flip = None
        with self._count_lock:
            if self.corrupt.get(name, 0) > 0:
                self.corrupt[name] -= 1
                flip = len(data) // 2
        view = memoryview(data)
        for offset in range(start, len(data), CHUNK):
            chunk: bytes | memoryview = view[offset:offset + CHUNK]
            if flip is not None and offset <= flip < offset + len(chunk):
                patched = bytearray(chunk)
                patched[flip - offset] ^= 0xFF
                chunk = bytes(patched)
            yield chunk

    @contextlib.contextmanager
    def running(self) -> Iterator[LocalHub]:
        server = _HubServer(self)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        try:
            yield self
        finally:
            self.release()  # a held GET must not keep a handler thread past the server
            server.shutdown()
            server.server_close()


class _HubServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, hub: LocalHub) -> None:
        self.hub = hub
        super().__init__(("127.0.0.1", 0), _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client killed mid-request (the point of the crash tests) is not an error here.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    """The hub's endpoints (module doc); the ``LocalHub`` it serves is its server's."""

    server: _HubServer
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
            repo, code, err = self.server.hub._lookup(m.group(1), m.group(2) or "main", auth)
            if repo is None:
                return self._error(code, err)
            return self._json({"id": m.group(1), "sha": repo.commit,
                               "siblings": [{"rfilename": n} for n in repo.files]})
        m = re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)$", path)
        if m:
            repo, code, err = self.server.hub._lookup(m.group(1), m.group(2), auth)
            if repo is None:
                return self._error(code, err)
            return self._json([repo.tree_row(n) for n in repo.files])
        m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        if m:
            return self._resolve(m.group(1), m.group(2), m.group(3), auth, head=head)
        return self._error(404, "NotFound", head=head)

    def _resolve(self, repo_id: str, rev: str, name: str, auth: str | None, *,
                 head: bool) -> None:
        repo, code, err = self.server.hub._lookup(repo_id, rev, auth)
        if repo is None:
            return self._error(code, err, head=head)
        if name not in repo.files:
            return self._error(404, "EntryNotFound", head=head)
        data = repo.files[name]
        etag = repo.etag(name)
        headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{etag}"',
                   "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        if len(data) >= LFS_MIN_BYTES:
            headers |= {"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))}
        if head:
            return self._send(200, b"", headers | {"Content-Length": str(len(data))},
                              head=True)
        start = 0
        rng = re.match(r"bytes=(\d+)-", self.headers.get("Range", ""))
        if rng:
            start = int(rng.group(1))
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        get = Get(name, start)
        with self.server.hub._count_lock:
            self.server.hub.gets.append(get)
        self.send_response(206 if rng else 200)
        for k, v in (headers | {"Content-Length": str(len(data) - start)}).items():
            self.send_header(k, v)
        self.end_headers()
        self._stream(get, data)

    def _stream(self, get: Get, data: bytes) -> None:
        sent = get.start
        for chunk in self.server.hub._body(get.name, data, get.start):
            hold = self.server.hub.hold_at.get(get.name)
            if hold is not None and sent + len(chunk) > hold:
                # Send up to the hold point, then wait: the client sees a stalled download.
                head_part = chunk[:max(0, hold - sent)]
                if not self._write(get, head_part):
                    return
                sent += len(head_part)
                chunk = chunk[len(head_part):]
                self.server.hub._released.wait(HOLD_LIMIT_S)
            if self.server.hub.delay_s:
                time.sleep(self.server.hub.delay_s)
            if not self._write(get, chunk):
                return
            sent += len(chunk)

    def _write(self, get: Get, chunk: bytes | memoryview) -> bool:
        if not chunk:
            return True
        try:
            self.wfile.write(chunk)
        except (BrokenPipeError, ConnectionResetError):
            return False
        self.server.hub._count(get, len(chunk))
        return True
