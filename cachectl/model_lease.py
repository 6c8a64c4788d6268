"""The reader lease of a pulled model, for whoever serves from it (the engine's ``--model``).

A pulled entry (``<root>/v1/models/<key>/``) is in use while a process holds a shared flock on
its directory, exactly like a runtime entry: ``cachectl rm`` and ``gc`` take that flock
exclusively (without waiting) and leave the entry alone when they cannot. The engine finds
out whether its model lies in a pulled entry from the path alone (``--model /models/model``
is a symlink into ``v1/models/<key>/model``; the path is resolved), so it needs to know
nothing of the cache root. The flock opens the directory read-only: it works on the engine
pod's read-only mount of the cache. Taking the lease also marks the entry used (its
directory's mtime, the LRU clock of ``gc``), best effort: a read-only mount cannot, and the
pull that linked the model (through the daemon) marked it already.

Imports only the lock primitives: the engine imports this module, never the other way.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ditserve.cachectl import locks
from ditserve.cachectl.errors import LockTimeoutError
from ditserve.cachectl.identity import is_key
from ditserve.cachectl.pulled import MANIFEST, MODEL_DIR

# GC holds a pulled entry's flock exclusively only for one rename; waiting longer means
# something else holds it.
LEASE_WAIT_S = 30.0


def pulled_entry_of(path: Path | str) -> Path | None:
    """The pulled entry directory ``path`` (symlinks resolved) lies in, or None.

    ``.../v1/models/<key>/model`` itself or anything under it counts; the entry must hold a
    manifest, so a look-alike folder elsewhere is not mistaken for one.
    """
    resolved = Path(path).resolve()
    for folder in (resolved, *resolved.parents):
        entry = folder.parent
        if (folder.name == MODEL_DIR and is_key(entry.name) and entry.parent.name == "models"
                and entry.parent.parent.name == "v1" and (entry / MANIFEST).is_file()):
            return entry
    return None


def lease_pulled_model(path: Path | str, *, timeout_s: float = LEASE_WAIT_S) -> locks.HeldLock | None:
    """A shared lease on the pulled entry that ``path`` lies in; None if it lies in none.

    Hold it for as long as anything reads from the entry (release it, or let the process
    end). Raises FileNotFoundError if the entry was removed meanwhile, LockTimeoutError if
    it stays held exclusively (a removal in progress).
    """
    entry = pulled_entry_of(path)
    if entry is None:
        return None
    lease = locks.acquire(entry, shared=True, directory=True, timeout_s=timeout_s)
    if lease is None:
        raise LockTimeoutError(entry.name, timeout_s, "garbage collection")
    with contextlib.suppress(OSError):  # last use, for LRU gc; read-only mounts cannot
        os.utime(entry)
    return lease
