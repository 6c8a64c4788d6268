"""Stat stamps: proof that an entry's files are unchanged since their last full hash.

A stamp (``v1/stamps/<key>.json``) records each file's stat signature (device, inode, size,
mtime, ctime) after a successful full hash; a join whose files still show the same signatures
skips the re-hash. Any write through the filesystem changes ctime, which userspace cannot set
back. To rule out a write within the same coarse kernel clock tick as the stamped ctime, a
stamp is only written when hashing began at least ``RACY_MARGIN_NS`` after the newest ctime.
Stamps are hints: written best effort (a read-only mount cannot), lost ones cost a re-hash.
Called by the store (join, verify, stamp).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from ditserve.cachectl.manifest import MANIFEST_NAME, Manifest
from ditserve.cachectl.records import write_record

# A jiffy is 1-10 ms; filesystems with whole-second timestamps get 2 s.
RACY_MARGIN_NS = 100_000_000
COARSE_FS_MARGIN_NS = 2_000_000_000


def racy_margin_ns(sigs: dict[str, list[int]]) -> int:
    whole_seconds = all(sig[4] % 1_000_000_000 == 0 for sig in sigs.values())
    return COARSE_FS_MARGIN_NS if whole_seconds else RACY_MARGIN_NS


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
    return write_record(stamp_path, json.dumps({"files": after,
                                                "hash_started_ns": hash_started_ns}))


def forget_stamp(stamp_path: Path) -> None:
    """Drop a stamp; best effort (on a read-only mount it stays, and joins still re-check)."""
    with contextlib.suppress(OSError):
        stamp_path.unlink(missing_ok=True)
