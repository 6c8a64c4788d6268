"""Listing and garbage collection of entries: LRU down to a byte budget, never an entry in use.

Both kinds of entry count and go in one LRU order: runtime entries (``v1/entries``, this
module) and pulled models (``v1/models``, ``pulled_gc``, same rules); the sweep also drops
stale ``.partial/<key>`` folders of interrupted pulls (``pulled_gc.sweep_partials``).

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
import shutil
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ditserve.cachectl import locks, pulled_gc
from ditserve.cachectl.entry_info import PULLED, EntryInfo
from ditserve.cachectl.errors import CacheError, ReadOnlyCacheError, UsageError
from ditserve.cachectl.identity import is_key
from ditserve.cachectl.layout import Layout
from ditserve.cachectl.publish import remove_stale_temps
from ditserve.cachectl.records import sweep_record_temps
from ditserve.cachectl.removal import lease_free, remove_leased_dir
from ditserve.cachectl.stamps import forget_stamp
from ditserve.cachectl.verify import entry_dir_problem, load_manifest


def require_writable(layout: Layout, action: str) -> None:
    """Say clearly, before anything is touched, that a writing command cannot run here."""
    if not os.access(layout.entries, os.W_OK) or not os.access(layout.tmp, os.W_OK):
        raise ReadOnlyCacheError(str(layout.root), action)


@dataclass
class GcReport:
    removed: list[str] = field(default_factory=list)
    kept_in_use: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # key -> why GC could not judge it
    freed_bytes: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    dry_run: bool = False
    partials_removed: list[str] = field(default_factory=list)  # .partial/<key> of dead pulls
    partials_kept: list[str] = field(default_factory=list)     # a pull runs, or changed lately
    partial_bytes_freed: int = 0

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
        in_use = not lease_free(path)
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


def list_entries(layout: Layout) -> list[EntryInfo]:
    infos = []
    for key in entry_keys(layout):
        try:
            infos.append(_info(layout, key))
        except FileNotFoundError:
            continue  # removed while we listed
    return infos


def list_all(layout: Layout) -> list[EntryInfo]:
    """Runtime entries, then pulled models (``EntryInfo.kind`` tells them apart)."""
    return list_entries(layout) + pulled_gc.list_models(layout)


def remove_any(layout: Layout, key: str, *, dry_run: bool) -> bool:
    """Remove the runtime entry or pulled model ``key`` (whichever exists) unless in use."""
    if os.path.lexists(layout.model(key)) and not os.path.lexists(layout.entry(key)):
        return pulled_gc.remove_model(layout, key, dry_run=dry_run)
    return remove_entry(layout, key, dry_run=dry_run)


def remove_entry(layout: Layout, key: str, *, dry_run: bool) -> bool:
    """Remove ``key`` unless a builder or a reader holds it; True if removed (or removable)."""
    return remove_leased_dir(layout, key, layout.entry(key), dry_run=dry_run,
                             check_writable=lambda: require_writable(layout, f"remove entry {key}"),
                             forget=lambda: forget_stamp(layout.stamp(key)))


def collect(layout: Layout, max_bytes: int, *, dry_run: bool,
            partial_max_age_s: float = pulled_gc.DEFAULT_PARTIAL_MAX_AGE_S,
            clock: Callable[[], float] = time.time) -> GcReport:
    """Remove unused entries of both kinds, least recently used first, until at most
    ``max_bytes``; then sweep (partials older than ``partial_max_age_s`` whose pull is over)."""
    if not isinstance(max_bytes, int) or max_bytes < 0:
        raise UsageError("gc needs a byte budget >= 0 (--max-bytes N; 0 removes every entry "
                         "no process uses)")
    if not dry_run:
        require_writable(layout, "collect garbage (gc)")
    report = GcReport(dry_run=dry_run)
    if partial_max_age_s < 0:
        raise UsageError("--partial-age must be >= 0 seconds")
    infos = sorted(list_all(layout), key=lambda i: i.last_used)
    total = report.bytes_before = sum(i.bytes for i in infos)
    for info in infos:
        if total <= max_bytes:
            break
        if info.problem is not None and info.problem.startswith("unreadable"):
            report.skipped[info.key] = info.problem  # cannot tell whether it is in use
            continue
        remove = pulled_gc.remove_model if info.kind == PULLED else remove_entry
        if remove(layout, info.key, dry_run=dry_run):
            report.removed.append(info.key)
            report.freed_bytes += info.bytes
            total -= info.bytes
        else:
            report.kept_in_use.append(info.key)
    report.bytes_after = total
    if not dry_run:
        sweep_orphans(layout)
    partials = pulled_gc.sweep_partials(layout, max_age_s=partial_max_age_s, now=clock,
                                        dry_run=dry_run)
    report.partials_removed, report.partials_kept = partials.removed, partials.kept
    report.partial_bytes_freed = partials.freed_bytes
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
