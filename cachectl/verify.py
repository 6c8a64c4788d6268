"""Checking an entry against its manifest: structure without hashing, content by every digest.

``check_structure`` is cheap: the entry is a real directory (not a symlink out of the root),
the manifest parses and its digest chain is consistent, the directory holds exactly the listed
regular files with the recorded sizes and matching safetensors headers. ``check_content``
hashes every piece of every file on all cores and recomputes the chain from the bytes: piece,
tensor, header, file and content digests; a mismatch names the tensors (and pieces) whose bytes
changed. Problems are reported with a kind (corrupt, unreadable, outdated), never repaired.
Called by the store (join, verify) and, through it, the daemon's scrubber.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ditserve.cachectl.digests import content_digest, file_digest, over_pieces
from ditserve.cachectl.errors import CORRUPT, MISSING, UNREADABLE, ManifestError, Problem
from ditserve.cachectl.hashing import RateLimiter, Span, hash_spans
from ditserve.cachectl.manifest import MANIFEST_NAME, Manifest
from ditserve.cachectl.st_format import read_header

_DENIED = (errno.EACCES, errno.EPERM)


def _kind(e: OSError) -> str:
    return UNREADABLE if e.errno in _DENIED else CORRUPT


def _unreadable(e: OSError) -> str:
    return f"unreadable: {e.strerror or e}" + (
        " (run as the cache's owner, or fix the permissions)" if e.errno in _DENIED else "")


@dataclass
class VerifyReport:
    """The outcome for one entry: ``ok`` iff ``problems`` is empty; ``skipped`` says why an
    entry was not checked (GC removed it meanwhile), which is not a failure."""

    key: str
    problems: list[Problem] = field(default_factory=list)
    bytes_hashed: int = 0
    seconds: float = 0.0
    skipped: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def status(self) -> str:
        """ok, skipped, corrupt, or the kind of the first problem (unreadable, outdated, missing)."""
        if not self.problems:
            return "skipped" if self.skipped else "ok"
        kinds = [p.kind for p in self.problems]
        return CORRUPT if CORRUPT in kinds else kinds[0]

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "ok": self.ok, "status": self.status,
                "bytes_hashed": self.bytes_hashed, "seconds": round(self.seconds, 3),
                "skipped": self.skipped,
                "problems": [{"file": p.file, "problem": p.what, "kind": p.kind}
                             for p in self.problems]}


def load_manifest(entry_dir: Path) -> Manifest:
    path = entry_dir / MANIFEST_NAME
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ManifestError("manifest.json is not a regular file")
        data = json.loads(path.read_bytes())
    except FileNotFoundError as e:
        raise ManifestError("manifest.json is missing") from e
    except OSError as e:
        raise ManifestError(f"manifest.json is {_unreadable(e)}", kind=_kind(e)) from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"manifest.json is not JSON: {e}") from e
    return Manifest.from_json(data)


def entry_dir_problem(entry_dir: Path, key: str) -> Problem | None:
    """An entry must be a real directory inside the root, never a symlink out of it."""
    try:
        st = os.lstat(entry_dir)
    except FileNotFoundError:
        return Problem(key, None, "no such entry", MISSING)
    except OSError as e:
        return Problem(key, None, _unreadable(e), _kind(e))
    if stat.S_ISLNK(st.st_mode):
        return Problem(key, None, f"the entry is a symlink (to {os.readlink(entry_dir)}); "
                                  "entries must be real directories inside the cache root")
    if not stat.S_ISDIR(st.st_mode):
        return Problem(key, None, "the entry is not a directory")
    return None


def check_structure(entry_dir: Path, key: str) -> tuple[Manifest | None, list[Problem]]:
    """Real directory, manifest, exact file set, regular files, sizes and headers; no hashing."""
    bad_dir = entry_dir_problem(entry_dir, key)
    if bad_dir is not None:
        return None, [bad_dir]
    try:
        manifest = load_manifest(entry_dir)
    except ManifestError as e:
        return None, [Problem(key, MANIFEST_NAME, str(e), e.kind)]
    problems: list[Problem] = []
    if manifest.key != key:
        problems.append(Problem(key, MANIFEST_NAME, f"manifest is for entry {manifest.key}"))
    listed = {f.name for f in manifest.files}
    try:
        present = set(os.listdir(entry_dir)) - {MANIFEST_NAME}
    except OSError as e:
        return manifest, [Problem(key, None, f"entry directory {_unreadable(e)}", _kind(e))]
    for extra in sorted(present - listed):
        problems.append(Problem(key, extra, "unexpected file not listed in the manifest"))
    for record in manifest.files:
        problem = _check_file(entry_dir, key, manifest, record.name, record.size)
        if problem is not None:
            problems.append(problem)
    return manifest, problems


def _check_file(entry_dir: Path, key: str, manifest: Manifest, name: str,
                size: int) -> Problem | None:
    path = entry_dir / name
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return Problem(key, name, "missing file")
    if not stat.S_ISREG(st.st_mode):
        return Problem(key, name, "not a regular file")
    if st.st_size != size:
        kind = "truncated" if st.st_size < size else "longer than recorded"
        return Problem(key, name, f"{kind}: {st.st_size} bytes, manifest says {size}")
    try:
        tensors, _meta, end = read_header(path)
    except OSError as e:
        return Problem(key, name, _unreadable(e), _kind(e))
    except ValueError as e:
        return Problem(key, name, f"bad safetensors header: {e}")
    expected = {t.name: (t.dtype, t.shape, t.offset, t.nbytes) for t in manifest.tensors_of(name)}
    actual = {n: (h.dtype, h.shape, h.offset, h.nbytes) for n, h in tensors.items()}
    if expected != actual or end != size:
        differ = sorted(n for n in expected.keys() | actual.keys() if expected.get(n) != actual.get(n))
        return Problem(key, name, "safetensors header disagrees with the manifest "
                                  f"(tensors: {', '.join(differ[:5]) or 'file end'})")
    return None


def check_content(
    entry_dir: Path, manifest: Manifest, *, threads: int | None = None,
    limiter: RateLimiter | None = None,
) -> tuple[list[Problem], int]:
    """Hash every piece and recompute every digest; returns (problems, bytes hashed)."""
    key = manifest.key
    spans = []
    for f in manifest.files:
        spans.append(Span(entry_dir / f.name, 0, manifest.header_length(f), f"\0header:{f.name}"))
        spans += [Span(entry_dir / t.file, t.offset, t.nbytes, t.name)
                  for t in manifest.tensors_of(f.name)]
    got = hash_spans(spans, piece_bytes=manifest.piece_bytes, threads=threads, limiter=limiter)
    problems: list[Problem] = []
    data_digests: dict[str, str] = {}
    for f in manifest.files:
        head = got[f"\0header:{f.name}"]
        errors = [g for g in (head, *(got[t.name] for t in manifest.tensors_of(f.name)))
                  if isinstance(g, OSError)]
        if errors:
            problems.append(Problem(key, f.name, _unreadable(errors[0]), _kind(errors[0])))
            continue
        assert not isinstance(head, OSError)
        changed = []
        for t in manifest.tensors_of(f.name):
            pieces = got[t.name]
            assert not isinstance(pieces, OSError)
            data_digests[t.name] = over_pieces(pieces)
            bad = [i for i, p in enumerate(pieces) if p.hex() != t.pieces[i]]
            if bad or data_digests[t.name] != t.sha256:
                changed.append(f"{t.name} (piece {', '.join(map(str, bad[:3]))})" if bad
                               else t.name)
        header_sha = over_pieces(head)
        what = []
        if header_sha != f.header_sha256:
            what.append("header bytes changed")
        if changed:
            what.append(f"tensors with changed bytes: {', '.join(changed[:8])}"
                        + (f" (+{len(changed) - 8} more)" if len(changed) > 8 else ""))
        digest = file_digest(header_sha, [data_digests[t.name] for t in manifest.tensors_of(f.name)])
        if what or digest != f.sha256:
            problems.append(Problem(key, f.name, "sha256 mismatch; " + ("; ".join(what) or
                                    "file digest differs from the data")))
    if not problems:
        rows = [(t.name, t.dtype, t.shape, data_digests[t.name]) for t in manifest.tensors]
        if content_digest(rows, manifest.metadata, manifest.piece_bytes) != manifest.content_digest:
            problems.append(Problem(key, None, "content digest differs from the data"))
    return problems, sum(f.size for f in manifest.files)
