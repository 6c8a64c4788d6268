"""Housekeeping of pulled models (``v1/models/<key>``): listing, removal, stale partials.

The rules are the runtime entries' (gc.py): a pulled entry is in use while a process holds
its lease (a shared flock on the entry directory: the engine serving from it, see
``model_lease``) or its key's build lock (a pull of it in progress); removal takes both
exclusively without waiting and leaves the entry alone if either is held. A removed entry is
renamed into ``.tmp/<key>.gc.*`` first (it vanishes atomically for new joiners), then
deleted. Last use is the entry directory's mtime, set by every pull that joins or publishes
it and by every lease taken where the cache is writable.

``.partial/<key>/`` is a pull in progress, or what an interrupted one left for the next to
resume. The sweep removes one only when its key's lock is free (no pull runs) AND nothing
under it changed for ``partial_max_age_s`` (default a day): a pull retried within that time
(the operator's init container, a CronJob, a person) still resumes. Called by gc.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ditserve.cachectl import locks
from ditserve.cachectl.entry_info import PULLED, EntryInfo
from ditserve.cachectl.errors import ReadOnlyCacheError
from ditserve.cachectl.identity import is_key
from ditserve.cachectl.layout import Layout
from ditserve.cachectl.pulled import MANIFEST, model_keys
from ditserve.cachectl.removal import lease_free, remove_leased_dir

DEFAULT_PARTIAL_MAX_AGE_S = 24 * 3600.0


def _bytes_under(path: Path) -> int:
    total = 0
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def model_info(layout: Layout, key: str) -> EntryInfo:
    """One pulled entry's listing; raises FileNotFoundError if it vanished meanwhile."""
    path = layout.model(key)
    st = os.lstat(path)
    if not os.path.isdir(path) or os.path.islink(path):
        return EntryInfo(key, path, 0, None, st.st_mtime, False, None,
                         "not a directory (a symlink is never followed)", kind=PULLED)
    try:
        in_use = not lease_free(path)
    except FileNotFoundError:
        raise
    except OSError as e:
        return EntryInfo(key, path, 0, None, st.st_mtime, False, None,
                         f"unreadable: {e.strerror or e}", kind=PULLED)
    try:
        doc = json.loads((path / MANIFEST).read_text())
        return EntryInfo(key, path, int(doc["total_bytes"]), doc.get("created_at"), st.st_mtime,
                         in_use, doc.get("identity"), None, kind=PULLED, uri=str(doc["uri"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        # Still counted with what it holds on disk, so gc can judge (and free) it.
        return EntryInfo(key, path, _bytes_under(path), None, st.st_mtime, in_use, None,
                         f"manifest unreadable: {e}", kind=PULLED)


def list_models(layout: Layout) -> list[EntryInfo]:
    infos = []
    for key in model_keys(layout):
        try:
            infos.append(model_info(layout, key))
        except FileNotFoundError:
            continue  # removed while we listed
    return infos


def _require_writable(layout: Layout, action: str) -> None:
    if not os.access(layout.models, os.W_OK) or not os.access(layout.tmp, os.W_OK):
        raise ReadOnlyCacheError(str(layout.root), action)


def remove_model(layout: Layout, key: str, *, dry_run: bool) -> bool:
    """Remove pulled entry ``key`` unless a pull or a reader holds it; True if removed (or,
    with ``dry_run``, removable)."""
    return remove_leased_dir(
        layout, key, layout.model(key), dry_run=dry_run,
        check_writable=lambda: _require_writable(layout, f"remove pulled model {key}"))


def _newest_change(path: Path) -> float:
    newest = os.lstat(path).st_mtime
    for dirpath, dirs, names in os.walk(path):
        for name in (*dirs, *names):
            with contextlib.suppress(FileNotFoundError):
                newest = max(newest, os.lstat(os.path.join(dirpath, name)).st_mtime)
    return newest


@dataclass
class PartialSweep:
    removed: list[str] = field(default_factory=list)  # keys whose partial was (or would be) removed
    kept: list[str] = field(default_factory=list)     # a pull runs, or it changed recently
    freed_bytes: int = 0


def sweep_partials(layout: Layout, *, max_age_s: float, now: Callable[[], float],
                   dry_run: bool) -> PartialSweep:
    """Remove ``.partial/<key>`` folders no pull works on that did not change for
    ``max_age_s`` seconds (module doc); anything there that is not a key's folder goes too."""
    report = PartialSweep()
    if not layout.partials.is_dir():
        return report
    for name in sorted(os.listdir(layout.partials)):
        path = layout.partials / name
        try:
            fresh = now() - _newest_change(path) < max_age_s
            size = _bytes_under(path)
        except FileNotFoundError:
            continue
        if is_key(name) and (fresh or not locks.is_free(layout.build_lock(name))):
            report.kept.append(name)
            continue
        if not dry_run:
            if not is_key(name):
                _drop(path)
            else:
                held = locks.try_exclusive(layout.build_lock(name))
                if held is None:  # a pull began meanwhile
                    report.kept.append(name)
                    continue
                with held:
                    _drop(path)
                    held.unlink_and_release()
        report.removed.append(name)
        report.freed_bytes += size
    return report


def _drop(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)
