"""Pulled model entries: ``<root>/v1/models/<key>/{model/, manifest.json}``.

A pulled entry is a model folder exactly as its source holds it (a diffusers directory, a
single checkpoint, GGUF ...), downloaded by ``cachectl pull`` and published like a runtime
entry: written in ``.partial/<key>/``, hashed, fsynced, renamed into ``v1/models`` under the
key's build lock. Its key is the SHA-256 of the canonical JSON of its identity (the source URI
and what pins its content: the hub commit, or the S3 listing's ETags), so it is known before
a byte is downloaded and concurrent pulls of one source meet on one lock.

This module owns the manifest (per file: size, SHA-256, and the digest the source published),
publishing a finished partial directory, the cheap structure check a join does, and the full
re-hash ``cachectl verify`` does. Called by ``pulls`` and the CLI's verify; listing,
removal and gc of pulled entries are ``pulled_gc``'s, the engine's lease ``model_lease``'s.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import stat
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ditserve.cachectl.errors import CORRUPT, UNREADABLE, ModelDigestError, Problem, entry_error
from ditserve.cachectl.hashing import RateLimiter
from ditserve.cachectl.identity import is_key
from ditserve.cachectl.layout import Layout
from ditserve.cachectl.sources import Snapshot

SCHEMA = 1
MODEL_DIR = "model"  # the model folder inside an entry (the source may hold a manifest.json)
MANIFEST = "manifest.json"
_CHUNK = 8 << 20


def canonical(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def model_key(identity: dict[str, Any]) -> str:
    return hashlib.sha256(canonical(identity)).hexdigest()


def file_sha256(path: Path, limiter: RateLimiter | None = None) -> str:
    with open(path, "rb") as f:  # hashlib releases the GIL: files hash in parallel threads
        if limiter is None:
            return hashlib.file_digest(f, "sha256").hexdigest()
        h = hashlib.sha256()
        while chunk := f.read(_CHUNK):
            limiter.acquire(len(chunk))  # the scrub's read rate, shared by its threads
            h.update(chunk)
        return h.hexdigest()


@dataclass(frozen=True)
class PulledFile:
    name: str  # relative to model/, '/'-separated
    size: int
    sha256: str
    source_digest: dict[str, str] | None  # {"algorithm": ..., "value": ...} as published

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "sha256": self.sha256,
                "source_digest": self.source_digest}


@dataclass(frozen=True)
class PulledModel:
    """A published pulled entry. ``model_dir`` is what an engine's ``--model`` names."""

    key: str
    path: Path
    uri: str
    revision: str | None
    total_bytes: int
    downloaded: bool  # False: it was already there (this pull only joined it)

    @property
    def model_dir(self) -> Path:
        return self.path / MODEL_DIR

    def to_json(self) -> dict[str, Any]:
        return {"status": "ready", "key": self.key, "path": str(self.path),
                "model_dir": str(self.model_dir), "uri": self.uri, "revision": self.revision,
                "bytes": self.total_bytes, "downloaded": self.downloaded}


def manifest_doc(key: str, identity: dict[str, Any], files: list[PulledFile],
                 uri: str) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "schema": SCHEMA, "kind": "model", "key": key, "identity": identity, "uri": uri,
        "files": [f.to_json() for f in sorted(files, key=lambda f: f.name)],
        "total_bytes": sum(f.size for f in files),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "writer": f"cachectl pid {os.getpid()} on {socket.gethostname()}"}
    doc["manifest_digest"] = hashlib.sha256(canonical(doc)).hexdigest()
    return doc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def local_files(model_dir: Path) -> dict[str, Path]:
    """Every regular file under ``model_dir`` by its '/'-separated relative name."""
    found: dict[str, Path] = {}
    for dirpath, _dirs, names in os.walk(model_dir):
        for name in names:
            p = Path(dirpath, name)
            found[p.relative_to(model_dir).as_posix()] = p
    return found


def hash_files(paths: dict[str, Path], *, threads: int | None = None,
                limiter: RateLimiter | None = None) -> dict[str, str]:
    """SHA-256 of each file, files spread over threads (read at most ``limiter``'s rate)."""
    workers = threads or max(1, len(os.sched_getaffinity(0)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cachectl-hash") as pool:
        digests = pool.map(lambda p: file_sha256(p, limiter), paths.values())
        return dict(zip(paths, digests, strict=True))


def publish_partial(layout: Layout, key: str, identity: dict[str, Any],
                    files: list[PulledFile], uri: str) -> Path:
    """Make ``.partial/<key>/`` the published entry: write its manifest, make it read-only,
    fsync everything, rename it into ``v1/models`` and fsync that. Caller holds the key's
    build lock and has checked every file."""
    partial = layout.partial(key)
    model_dir = partial / MODEL_DIR
    for name in (f.name for f in files):
        path = model_dir / name
        os.chmod(path, 0o444)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    manifest = partial / MANIFEST
    # A pull killed after this write and before the rename left a read-only manifest; only
    # root could write over it, so replace it.
    manifest.unlink(missing_ok=True)
    manifest.write_text(json.dumps(manifest_doc(key, identity, files, uri), indent=1, sort_keys=True))
    os.chmod(manifest, 0o444)
    with open(manifest, "rb") as f:
        os.fsync(f.fileno())
    for dirpath, _dirs, _names in os.walk(partial):
        _fsync_dir(Path(dirpath))
    layout.models.mkdir(parents=True, exist_ok=True)
    target = layout.model(key)
    os.rename(partial, target)  # atomic: readers see all of the entry or nothing
    _fsync_dir(layout.models)
    mark_used(target)
    return target


def read_manifest(entry: Path) -> dict[str, Any]:
    """The manifest, checked for self-consistency (digest, key, names); ValueError if not."""
    doc = json.loads((entry / MANIFEST).read_text())
    if not isinstance(doc, dict) or doc.get("kind") != "model" or doc.get("schema") != SCHEMA:
        raise ValueError("not a pulled-model manifest of schema 1")
    body = {k: v for k, v in doc.items() if k != "manifest_digest"}
    if hashlib.sha256(canonical(body)).hexdigest() != doc.get("manifest_digest"):
        raise ValueError("manifest_digest does not match the manifest (edited)")
    if model_key(doc["identity"]) != doc["key"] or doc["key"] != entry.name:
        raise ValueError("the key does not match the identity or the directory name")
    for f in doc["files"]:
        name = f["name"]
        if name.startswith("/") or any(part in ("", ".", "..") for part in name.split("/")):
            raise ValueError(f"file name {name!r} leaves the entry")
    return doc


def check_model_entry(entry: Path, *, full: bool,
                      on_file: Callable[[str], None] | None = None,
                      limiter: RateLimiter | None = None,
                      on_hashed: Callable[[int], None] | None = None) -> list[Problem]:
    """What is wrong with a pulled entry: structure (manifest, the exact file set, regular
    files, sizes) always; with ``full`` every file's SHA-256 too (read at most ``limiter``'s
    rate; ``on_hashed`` gets the bytes hashed). Never repairs anything."""
    key = entry.name
    if entry.is_symlink() or not entry.is_dir():
        return [Problem(key, None, "not a directory (a symlink is never followed)")]
    try:
        doc = read_manifest(entry)
    except PermissionError as e:
        return [Problem(key, MANIFEST, f"unreadable: {e}", UNREADABLE)]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [Problem(key, MANIFEST, f"manifest unreadable or inconsistent: {e}")]
    model_dir = entry / MODEL_DIR
    expected = {f["name"]: f for f in doc["files"]}
    present = local_files(model_dir) if model_dir.is_dir() else {}
    problems = [Problem(key, f"{MODEL_DIR}/{n}", "missing") for n in sorted(set(expected) - set(present))]
    problems += [Problem(key, f"{MODEL_DIR}/{n}", "unexpected file")
                 for n in sorted(set(present) - set(expected))]
    to_hash: dict[str, Path] = {}
    for name in sorted(set(expected) & set(present)):
        st = present[name].lstat()
        if not stat.S_ISREG(st.st_mode):
            problems.append(Problem(key, f"{MODEL_DIR}/{name}", "not a regular file"))
        elif st.st_size != expected[name]["size"]:
            problems.append(Problem(key, f"{MODEL_DIR}/{name}",
                                    f"size {st.st_size}, manifest says {expected[name]['size']}"))
        else:
            to_hash[name] = present[name]
    if full and to_hash:
        try:
            digests = hash_files(to_hash, limiter=limiter)
        except PermissionError as e:
            return [*problems, Problem(key, None, f"unreadable: {e}", UNREADABLE)]
        if on_hashed is not None:
            on_hashed(sum(expected[n]["size"] for n in digests))
        for name, digest in digests.items():
            if on_file is not None:
                on_file(name)
            if digest != expected[name]["sha256"]:
                problems.append(Problem(key, f"{MODEL_DIR}/{name}",
                                        f"SHA-256 mismatch: {digest}, manifest says "
                                        f"{expected[name]['sha256']}", CORRUPT))
    return problems


def find_published(layout: Layout, key: str, snapshot: Snapshot) -> PulledModel | None:
    """The published entry of ``key`` for ``snapshot`` (a join: its structure is checked, not
    re-hashed; the daemon's scrub and ``cachectl verify`` re-hash); None if there is none.
    One whose structure is wrong, or whose files are not the ones the source lists now, is
    refused, never pulled over."""
    entry = layout.model(key)
    if not entry.exists() and not entry.is_symlink():
        return None
    problems = check_model_entry(entry, full=False)
    if problems:
        raise entry_error(key, problems)
    doc = read_manifest(entry)
    _check_same_listing(doc, snapshot)
    mark_used(entry)
    return PulledModel(key, entry, snapshot.uri, doc["identity"].get("revision"),
                       doc["total_bytes"], downloaded=False)


def _check_same_listing(doc: dict[str, Any], snapshot: Snapshot) -> None:
    """The entry's files must be the snapshot's: the same names, sizes and source digests.
    The key pins a hub commit but not the hub: an entry pulled through another endpoint (a
    mirror) under the same commit id, holding other bytes, is refused rather than joined."""
    have = {f["name"]: (f["size"], f.get("source_digest")) for f in doc["files"]}
    want = {f.name: (f.size, f.digest) for f in snapshot.files}
    if have != want:
        differ = sorted(set(have) ^ set(want)) or sorted(n for n in want if have[n] != want[n])
        raise ModelDigestError(
            snapshot.uri, f"the node's entry {doc['key']} for this revision holds other files "
                          f"than the source lists now ({', '.join(differ[:3])}"
                          f"{' ...' if len(differ) > 3 else ''}): it was pulled from another "
                          f"endpoint, or the source rewrote the revision. Remove it (`cachectl "
                          f"rm {doc['key']}`) and pull again")


def mark_used(entry: Path) -> None:
    """The entry directory's mtime is its last use, for LRU gc (as runtime entries). Best
    effort: a read-only mount cannot set it."""
    with contextlib.suppress(OSError):
        os.utime(entry)


def model_keys(layout: Layout) -> list[str]:
    """The keys of the pulled entries on disk (names that are not keys are not entries)."""
    if not layout.models.is_dir():
        return []
    return sorted(name for name in os.listdir(layout.models) if is_key(name))
