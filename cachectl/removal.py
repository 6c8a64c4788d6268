"""Removing one leased cache directory - a runtime entry or a pulled model - the same way.

A directory is in use while a process holds its lease (a shared flock on it) or its key's
build lock (a build or a pull of that key). Removal takes both exclusively without waiting and
gives up if either is held; it renames the directory into ``.tmp/`` (it vanishes atomically
for new readers; ``gc``'s sweep finishes a removal that died) and then deletes it. A symlink in
its place was never made by cachectl: the link is dropped, never followed.
Called by ``gc.remove_entry`` and ``pulled_gc.remove_model``.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

from ditserve.cachectl import locks
from ditserve.cachectl.layout import Layout


def lease_free(path: Path) -> bool:
    """No process holds ``path``'s lease (probed without waiting)."""
    probe = locks.try_exclusive_dir(path)
    if probe is None:
        return False
    probe.release()
    return True


def remove_leased_dir(layout: Layout, key: str, path: Path, *, dry_run: bool,
                      check_writable: Callable[[], None],
                      forget: Callable[[], None] = lambda: None) -> bool:
    """Remove ``path`` (the directory of ``key``) unless a builder, puller or reader holds
    it; True if removed (with ``dry_run``: removable, opening nothing for writing).
    ``check_writable`` raises on a read-only root; ``forget`` drops the key's side records
    while its build lock is held."""
    if dry_run:
        try:
            return locks.is_free(layout.build_lock(key)) and (
                os.path.islink(path) or lease_free(path))
        except FileNotFoundError:
            return False
    check_writable()
    build = locks.try_exclusive(layout.build_lock(key))
    if build is None:
        return False
    with build:
        if os.path.islink(path):
            os.unlink(path)
            forget()
            build.unlink_and_release()
            return True
        try:
            lease = locks.try_exclusive_dir(path)
        except FileNotFoundError:
            return False
        if lease is None:
            return False
        doomed = layout.tmp / f"{key}.gc.{os.getpid()}.{secrets.token_hex(4)}"
        # One already waiting on the old directory's flock sees the path gone (inode check).
        os.rename(path, doomed)
        forget()
        lease.release()
        build.unlink_and_release()
    shutil.rmtree(doomed, ignore_errors=True)
    return True
