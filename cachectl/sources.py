"""What a model source hands a pull: the snapshot to fetch, and the digests to check it by.

``RemoteFile`` / ``Snapshot`` are the contract between a source (``hub_source``,
``s3_source``) and ``pulls`` (which picks the source of a URI);
``check_listing`` refuses a listing that could not be a model folder (before anything is
written: a hub or bucket names the files, and a name must never reach outside the pull's
folder); ``source_digest_matches`` checks one downloaded file against what its source published
(the hub's LFS SHA-256 or git blob SHA-1, an object's SHA-256 checksum or single-part MD5
ETag). Called by ``pulls``.
"""

from __future__ import annotations

import base64
import hashlib
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from ditserve.cachectl.errors import ModelNotFoundError, ModelSourceError, PullCancelledError


@dataclass(frozen=True)
class RemoteFile:
    name: str  # relative to the model folder, '/'-separated
    size: int
    # {"algorithm": "sha256" | "git-sha1" | "md5" | "sha256-b64", "value": ...}; None: the
    # source published none (a multipart S3 object without a checksum): size only
    digest: dict[str, str] | None = None


@dataclass(frozen=True)
class Snapshot:
    """One immutable state of a source: ``identity`` pins its content (a hub commit, an S3
    listing's ETags) and keys the cache entry."""

    uri: str
    identity: dict[str, Any]
    revision: str | None
    files: list[RemoteFile] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class Credentials:
    """What a pull may authenticate with, when given explicitly (the daemon gets them in the
    request); None fields fall back to the libraries' own environment lookup
    (HF_TOKEN, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/AWS_SESSION_TOKEN, AWS_REGION ...)."""

    hf_token: str | None = None
    hf_endpoint: str | None = None
    aws_access_key_id: str | None = None
    aws_secret_access_key: str | None = None
    aws_session_token: str | None = None
    aws_region: str | None = None
    s3_endpoint: str | None = None


def check_listing(snapshot: Snapshot) -> None:
    """Refuse a listing no model folder can hold: no files, a name that is absolute or has an
    empty, ``.`` or ``..`` part (it would leave the folder: a hostile or broken mirror must not
    write or delete files elsewhere on the node), or a name that is also another's folder."""
    if not snapshot.files:
        raise ModelNotFoundError(snapshot.uri, "the source lists no files for this revision")
    names = {f.name for f in snapshot.files}
    for name in sorted(names):
        if name.startswith("/") or any(p in ("", ".", "..") for p in name.split("/")):
            raise ModelSourceError(snapshot.uri, f"the source lists a file {name!r} that would "
                                                 "leave the model folder; nothing was written")
        parts = name.split("/")
        for depth in range(1, len(parts)):
            folder = "/".join(parts[:depth])
            if folder in names:
                raise ModelSourceError(snapshot.uri, f"the source lists {folder!r} both as a "
                                                     f"file and as the folder of {name!r}")


class Source(Protocol):
    def resolve(self) -> Snapshot:
        """Ask the source what to fetch (cheap: metadata only)."""

    def download(self, snapshot: Snapshot, model_dir: Path, *, workers: int,
                 cancel: threading.Event) -> None:
        """Fetch every file of ``snapshot`` into ``model_dir``, resuming what an earlier,
        interrupted download left there; stop within a chunk once ``cancel`` is set
        (``PullCancelledError``)."""


def fetch_all(uri: str, fetch: Callable[[RemoteFile], None], files: list[RemoteFile], *,
              workers: int, cancel: threading.Event, thread_name_prefix: str) -> None:
    """``fetch`` each file, ``workers`` at a time. Any failure here - Ctrl-C in the main
    thread included - sets ``cancel``, so the other files stop at their next chunk instead of
    running to their end while the pool waits for them."""
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=thread_name_prefix) as pool:
        try:
            for _ in pool.map(fetch, files):
                pass
        except BaseException:
            cancel.set()
            raise
    if cancel.is_set():
        raise PullCancelledError(uri)


class CancellableWriter:
    """A file a downloader writes chunks to, which refuses the next chunk once ``cancel`` is
    set (huggingface_hub's ``http_get`` has no cancel hook of its own)."""

    def __init__(self, out: BinaryIO, cancel: threading.Event, uri: str) -> None:
        self._out, self._cancel, self._uri = out, cancel, uri

    def write(self, chunk: bytes) -> int:
        if self._cancel.is_set():
            raise PullCancelledError(self._uri)
        return self._out.write(chunk)

    def __getattr__(self, name: str) -> Any:  # tell, seek, truncate, flush, name ...
        return getattr(self._out, name)


def _stream_digest(path: Path, h: Any, prefix: bytes = b"") -> Any:
    h.update(prefix)
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h


def source_digest_matches(path: Path, digest: dict[str, str] | None, sha256: str) -> bool:
    """Whether the file at ``path`` (whose SHA-256 is ``sha256``) is what the source
    published. Files without a published digest match (their size was checked)."""
    if digest is None:
        return True
    algorithm, value = digest["algorithm"], digest["value"]
    if algorithm == "sha256":
        return sha256 == value.lower()
    if algorithm == "sha256-b64":
        return base64.b64decode(value).hex() == sha256
    if algorithm == "git-sha1":  # git's blob id: SHA-1 of "blob <size>\0" + content
        size = path.stat().st_size
        return _stream_digest(path, hashlib.sha1(), f"blob {size}\0".encode()).hexdigest() == value
    if algorithm == "md5":
        return _stream_digest(path, hashlib.md5(usedforsecurity=False)).hexdigest() == value
    raise ValueError(f"unknown digest algorithm {algorithm!r}")
