"""Checking an entry against its manifest, and the stat stamps that let joins skip re-hashing.

``check_structure`` is cheap (manifest, file set, sizes, safetensors headers); ``check_content``
re-hashes every file in parallel and, for a file that mismatches, names the tensors whose bytes
changed. Problems are reported, never repaired. A *stamp* records each file's stat signature
(device, inode, size, mtime, ctime) after a successful full hash; a join whose files still show
the same signatures skips the re-hash. Any write through the filesystem changes ctime, which
userspace cannot set back. Called by the store (join, verify) and the daemon's scrubber.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ditserve.cachectl.errors import ManifestError, Problem
from ditserve.cachectl.hashing import HashJob, RateLimiter, hash_many
from ditserve.cachectl.manifest import MANIFEST_NAME, Manifest
from ditserve.cachectl.st_format import read_header

# A stamp is only written when hashing began this long after the files' last change: a later
# write within the same tick of the kernel's coarse timestamp clock would otherwise leave ctime
# unchanged and go unseen. A jiffy is 1-10 ms; filesystems with whole-second timestamps get 2 s.
RACY_MARGIN_NS = 100_000_000
COARSE_FS_MARGIN_NS = 2_000_000_000


def racy_margin_ns(sigs: dict[str, list[int]]) -> int:
    whole_seconds = all(sig[4] % 1_000_000_000 == 0 for sig in sigs.values())
    return COARSE_FS_MARGIN_NS if whole_seconds else RACY_MARGIN_NS


@dataclass
class VerifyReport:
    """The outcome for one entry: ``ok`` iff ``problems`` is empty."""

    key: str
    problems: list[Problem] = field(default_factory=list)
    bytes_hashed: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "ok": self.ok, "bytes_hashed": self.bytes_hashed,
                "seconds": round(self.seconds, 3),
                "problems": [{"file": p.file, "problem": p.what} for p in self.problems]}


def load_manifest(entry_dir: Path) -> Manifest:
    path = entry_dir / MANIFEST_NAME
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ManifestError("manifest.json is not a regular file")
        data = json.loads(path.read_bytes())
    except FileNotFoundError as e:
        raise ManifestError("manifest.json is missing") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"manifest.json is unreadable: {e}") from e
    return Manifest.from_json(data)


def check_structure(entry_dir: Path, key: str) -> tuple[Manifest | None, list[Problem]]:
    """Manifest, exact file set, regular files, sizes and headers; no hashing."""
    try:
        manifest = load_manifest(entry_dir)
    except ManifestError as e:
        return None, [Problem(key, MANIFEST_NAME, str(e))]
    problems: list[Problem] = []
    if manifest.key != key:
        problems.append(Problem(key, MANIFEST_NAME, f"manifest is for entry {manifest.key}"))
    listed = {f.name for f in manifest.files}
    try:
        present = set(os.listdir(entry_dir)) - {MANIFEST_NAME}
    except OSError as e:
        return manifest, [Problem(key, None, f"cannot list the entry directory: {e}")]
    for extra in sorted(present - listed):
        problems.append(Problem(key, extra, "unexpected file not listed in the manifest"))
    by_file: dict[str, list[Any]] = {}
    for t in manifest.tensors:
        by_file.setdefault(t.file, []).append(t)
    for record in manifest.files:
        path = entry_dir / record.name
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            problems.append(Problem(key, record.name, "missing file"))
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append(Problem(key, record.name, "not a regular file"))
            continue
        if st.st_size != record.size:
            kind = "truncated" if st.st_size < record.size else "longer than recorded"
            problems.append(Problem(key, record.name,
                                    f"{kind}: {st.st_size} bytes, manifest says {record.size}"))
            continue
        try:
            tensors, _meta, end = read_header(path)
        except (OSError, ValueError) as e:
            problems.append(Problem(key, record.name, f"bad safetensors header: {e}"))
            continue
        expected = {t.name: (t.dtype, t.shape, t.offset, t.nbytes) for t in by_file.get(record.name, [])}
        actual = {n: (h.dtype, h.shape, h.offset, h.nbytes) for n, h in tensors.items()}
        if expected != actual or end != record.size:
            differ = sorted(n for n in expected.keys() | actual.keys() if expected.get(n) != actual.get(n))
            problems.append(Problem(key, record.name, "safetensors header disagrees with the "
                                    f"manifest (tensors: {', '.join(differ[:5]) or 'file end'})"))
    return manifest, problems


def check_content(
    entry_dir: Path, manifest: Manifest, *, threads: int | None = None,
    limiter: RateLimiter | None = None,
) -> tuple[list[Problem], int]:
    """Re-hash every file; returns (problems, bytes hashed). Mismatches name their tensors."""
    key = manifest.key
    jobs = [HashJob(entry_dir / f.name, f.name) for f in manifest.files]
    digests = hash_many(jobs, threads=threads, limiter=limiter)
    hashed = sum(f.size for f in manifest.files)
    problems = []
    bad_files = []
    for record in manifest.files:
        got = digests[record.name]
        if isinstance(got, OSError):
            problems.append(Problem(key, record.name, f"unreadable: {got.strerror or got}"))
        elif got != record.sha256:
            bad_files.append(record)
    if bad_files:
        # Second pass, only on failure: hash each tensor's range to say what changed.
        names = {r.name for r in bad_files}
        tjobs = [HashJob(entry_dir / t.file, t.name, t.offset, t.nbytes)
                 for t in manifest.tensors if t.file in names]
        tdigests = hash_many(tjobs, threads=threads)
        for record in bad_files:
            changed = sorted(t.name for t in manifest.tensors
                             if t.file == record.name and tdigests.get(t.name) != t.sha256)
            where = f"; tensors with changed bytes: {', '.join(changed[:8])}" if changed else \
                "; tensor bytes intact, so the header changed"
            problems.append(Problem(key, record.name, f"sha256 mismatch{where}"))
    return problems, hashed


def _signature(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def signatures(entry_dir: Path, manifest: Manifest) -> dict[str, list[int]]:
    names = [MANIFEST_NAME, *(f.name for f in manifest.files)]
    return {n: _signature(entry_dir / n) for n in names}


def stamp_matches(stamp_path: Path, entry_dir: Path, manifest: Manifest) -> bool:
    try:
        recorded = json.loads(stamp_path.read_text())["files"]
        return bool(recorded == signatures(entry_dir, manifest))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def write_stamp(stamp_path: Path, before: dict[str, list[int]], after: dict[str, list[int]],
                hash_started_ns: int) -> bool:
    """Record a successful full hash, unless the files changed or are too fresh to trust."""
    if before != after:
        return False
    newest_ctime = max(sig[4] for sig in after.values())
    if hash_started_ns - newest_ctime < racy_margin_ns(after):
        return False
    tmp = stamp_path.with_name(f".{stamp_path.name}.{os.getpid()}.{time.monotonic_ns()}")
    try:
        tmp.write_text(json.dumps({"files": after, "hash_started_ns": hash_started_ns}))
        os.replace(tmp, stamp_path)  # a hint: no fsync needed, a lost one costs a re-hash
    except OSError:
        return False  # read-only mount: the next read-write joiner or scrub writes it
    return True


def forget_stamp(stamp_path: Path) -> None:
    """Drop a stamp; best effort (on a read-only mount it stays, and joins still re-check)."""
    with contextlib.suppress(OSError):
        stamp_path.unlink(missing_ok=True)
