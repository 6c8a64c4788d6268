"""Listing and garbage collection of entries: LRU down to a byte budget, never an entry in use.

An entry is in use while any process holds its lease (a shared flock on the entry directory)
or its build lock; GC takes both exclusively without waiting and skips the entry if either is
held. A removed entry is first renamed into ``.tmp/`` (it vanishes atomically for new joiners),
then deleted. Last use is the entry directory's mtime, set by every read-write join. Called
through ``CacheStore.list / remove / gc``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ditserve.cachectl import locks
from ditserve.cachectl.errors import CacheError
from ditserve.cachectl.identity import is_key
from ditserve.cachectl.layout import Layout
from ditserve.cachectl.publish import remove_stale_temps
from ditserve.cachectl.verify import forget_stamp, load_manifest


@dataclass(frozen=True)
class EntryInfo:
    key: str
    path: Path
    bytes: int
    created_at: str | None
    last_used: float
    in_use: bool
    identity: dict[str, Any] | None
    problem: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "bytes": self.bytes, "created_at": self.created_at,
                "last_used": self.last_used, "in_use": self.in_use,
                "identity": self.identity, "problem": self.problem}


@dataclass
class GcReport:
    removed: list[str] = field(default_factory=list)
    kept_in_use: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    dry_run: bool = False

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _keys(layout: Layout) -> list[str]:
    return sorted(p.name for p in layout.entries.iterdir() if is_key(p.name))


def list_entries(layout: Layout) -> list[EntryInfo]:
    infos = []
    for key in _keys(layout):
        path = layout.entry(key)
        try:
            size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
            probe = locks.try_exclusive_dir(path)
            last_used = path.stat().st_mtime
        except FileNotFoundError:
            continue  # removed while we listed
        in_use = probe is None
        if probe is not None:
            probe.release()
        try:
            m = load_manifest(path)
            identity, created, problem = m.identity, m.created_at, None
        except CacheError as e:
            identity, created, problem = None, None, str(e)
        infos.append(EntryInfo(key, path, size, created, last_used, in_use, identity, problem))
    return infos


def remove_entry(layout: Layout, key: str, *, dry_run: bool) -> bool:
    """Remove ``key`` unless a builder or a reader holds it; True if removed (or removable)."""
    build = locks.try_exclusive(layout.build_lock(key))
    if build is None:
        return False
    with build:
        try:
            lease = locks.try_exclusive_dir(layout.entry(key))
        except FileNotFoundError:
            return False
        if lease is None:
            return False
        if dry_run:
            lease.release()
            return True
        doomed = layout.tmp / f"{key}.gc.{os.getpid()}.{secrets.token_hex(4)}"
        # The rename makes it vanish atomically for new joiners; one already waiting on the
        # old directory's flock sees the path gone (inode check) and reports it missing.
        os.rename(layout.entry(key), doomed)
        forget_stamp(layout.stamp(key))
        lease.release()
        build.unlink_and_release()
    shutil.rmtree(doomed, ignore_errors=True)
    return True


def collect(layout: Layout, max_bytes: int, *, dry_run: bool) -> GcReport:
    if max_bytes < 0:
        raise CacheError("--max-bytes must be >= 0")
    report = GcReport(dry_run=dry_run)
    infos = sorted(list_entries(layout), key=lambda i: i.last_used)
    total = report.bytes_before = sum(i.bytes for i in infos)
    for info in infos:
        if total <= max_bytes:
            break
        if remove_entry(layout, info.key, dry_run=dry_run):
            report.removed.append(info.key)
            report.freed_bytes += info.bytes
            total -= info.bytes
        else:
            report.kept_in_use.append(info.key)
    report.bytes_after = total
    if not dry_run:
        sweep_orphans(layout)
    return report


def sweep_orphans(layout: Layout) -> None:
    """Drop temp dirs of dead writers and recipe records whose entry is gone."""
    for d in layout.tmp.iterdir():
        key = d.name.split(".", 1)[0]
        if ".gc." in d.name or not is_key(key):
            shutil.rmtree(d, ignore_errors=True)
            continue
        held = locks.try_exclusive(layout.build_lock(key))
        if held is not None:  # no live writer of that key: its temps are stale
            with held:
                remove_stale_temps(layout, key)
    for rec in layout.recipes.glob("*.json"):
        try:
            key = json.loads(rec.read_text())["entry"]
        except (OSError, ValueError, KeyError, TypeError):
            key = None
        if not (isinstance(key, str) and is_key(key) and layout.entry(key).is_dir()):
            rec.unlink(missing_ok=True)
