"""Listing and garbage collection of entries: LRU down to a byte budget, never an entry in use.

An entry is in use while any process holds its lease (a shared flock on the entry directory)
or its build lock; GC takes both exclusively without waiting and skips the entry if either is
held. A removed entry is first renamed into ``.tmp/`` (it vanishes atomically for new joiners),
then deleted; an "entry" that is a symlink is unlinked, never followed. Last use is the entry
directory's mtime, set by every read-write join. The sweep removes what dead writers and
earlier GCs left: temp dirs, record temps, recipes and stamps of removed entries.
On a read-only root, listing and ``--dry-run`` work (they open nothing for writing); removing
raises ReadOnlyCacheError. Called through ``CacheStore.list / remove / gc``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ditserve.cachectl import locks
from ditserve.cachectl.errors import CacheError, ReadOnlyCacheError, UsageError
from ditserve.cachectl.identity import is_key
from ditserve.cachectl.layout import Layout
from ditserve.cachectl.publish import remove_stale_temps
from ditserve.cachectl.records import sweep_record_temps
from ditserve.cachectl.stamps import forget_stamp
from ditserve.cachectl.verify import entry_dir_problem, load_manifest


def require_writable(layout: Layout, action: str) -> None:
    """Say clearly, before anything is touched, that a writing command cannot run here."""
    if not os.access(layout.entries, os.W_OK) or not os.access(layout.tmp, os.W_OK):
        raise ReadOnlyCacheError(str(layout.root), action)


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
    skipped: dict[str, str] = field(default_factory=dict)  # key -> why GC could not judge it
    freed_bytes: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    dry_run: bool = False

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def entry_keys(layout: Layout) -> list[str]:
    return sorted(name for name in os.listdir(layout.entries) if is_key(name))


def _info(layout: Layout, key: str) -> EntryInfo:
    """One entry's listing; raises FileNotFoundError if it vanished meanwhile."""
    path = layout.entry(key)
    st = os.lstat(path)
    bad = entry_dir_problem(path, key)
    if bad is not None:
        return EntryInfo(key, path, 0, None, st.st_mtime, False, None, bad.what)
    try:
        size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
        in_use = not _lease_free(path)
    except FileNotFoundError:
        raise
    except OSError as e:
        return EntryInfo(key, path, 0, None, st.st_mtime, False, None,
                         f"unreadable: {e.strerror or e}")
    try:
        m = load_manifest(path)
        identity, created, problem = m.identity, m.created_at, None
    except CacheError as e:
        identity, created, problem = None, None, str(e)
    return EntryInfo(key, path, size, created, st.st_mtime, in_use, identity, problem)


def _lease_free(path: Path) -> bool:
    probe = locks.try_exclusive_dir(path)
    if probe is None:
        return False
    probe.release()
    return True


def list_entries(layout: Layout) -> list[EntryInfo]:
    infos = []
    for key in entry_keys(layout):
        try:
            infos.append(_info(layout, key))
        except FileNotFoundError:
            continue  # removed while we listed
    return infos


def remove_entry(layout: Layout, key: str, *, dry_run: bool) -> bool:
    """Remove ``key`` unless a builder or a reader holds it; True if removed (or removable)."""
    path = layout.entry(key)
    if dry_run:  # nothing opened for writing: works on a read-only root
        try:
            return locks.is_free(layout.build_lock(key)) and (
                os.path.islink(path) or _lease_free(path))
        except FileNotFoundError:
            return False
    require_writable(layout, f"remove entry {key}")
    build = locks.try_exclusive(layout.build_lock(key))
    if build is None:
        return False
    with build:
        if os.path.islink(path):  # not ours to follow: drop the link itself
            os.unlink(path)
            forget_stamp(layout.stamp(key))
            build.unlink_and_release()
            return True
        try:
            lease = locks.try_exclusive_dir(path)
        except FileNotFoundError:
            return False
        if lease is None:
            return False
        doomed = layout.tmp / f"{key}.gc.{os.getpid()}.{secrets.token_hex(4)}"
        # The rename makes it vanish atomically for new joiners; one already waiting on the
        # old directory's flock sees the path gone (inode check) and reports it missing.
        os.rename(path, doomed)
        forget_stamp(layout.stamp(key))
        lease.release()
        build.unlink_and_release()
    shutil.rmtree(doomed, ignore_errors=True)
    return True


def collect(layout: Layout, max_bytes: int, *, dry_run: bool) -> GcReport:
    if not isinstance(max_bytes, int) or max_bytes < 0:
        raise UsageError("gc needs a byte budget >= 0 (--max-bytes N; 0 removes every entry "
                         "no process uses)")
    if not dry_run:
        require_writable(layout, "collect garbage (gc)")
    report = GcReport(dry_run=dry_run)
    infos = sorted(list_entries(layout), key=lambda i: i.last_used)
    total = report.bytes_before = sum(i.bytes for i in infos)
    for info in infos:
        if total <= max_bytes:
            break
        if info.problem is not None and info.problem.startswith("unreadable"):
            report.skipped[info.key] = info.problem  # cannot tell whether it is in use
            continue
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
    """Drop temp dirs of dead writers and GCs, record temps of dead writers, and the recipes
    and stamps of entries that are gone."""
    for d in layout.tmp.iterdir():
        key = d.name.split(".", 1)[0]
        if d.is_symlink() or not stat.S_ISDIR(d.lstat().st_mode):
            d.unlink(missing_ok=True)
        elif ".gc." in d.name or not is_key(key):
            shutil.rmtree(d, ignore_errors=True)
        else:
            held = locks.try_exclusive(layout.build_lock(key))
            if held is not None:  # no live writer of that key: its temps are stale
                with held:
                    remove_stale_temps(layout, key)
    for name in entry_keys(layout):
        if os.path.islink(layout.entry(name)):  # never made by cachectl: not an entry
            layout.entry(name).unlink(missing_ok=True)
    for directory in (layout.recipes, layout.stamps):
        sweep_record_temps(directory)
    for rec in layout.recipes.glob("*.json"):
        try:
            key = json.loads(rec.read_text())["entry"]
        except (OSError, ValueError, KeyError, TypeError):
            key = None
        if not (isinstance(key, str) and is_key(key) and layout.entry(key).is_dir()):
            rec.unlink(missing_ok=True)
    for st in layout.stamps.glob("*.json"):
        if not layout.entry(st.stem).is_dir():
            st.unlink(missing_ok=True)
