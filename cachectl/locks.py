"""Kernel ``flock`` locks: the per-key build lock and the per-entry reader lease.

The build lock (``.locks/<key>.lock``, exclusive) gives one writer per key across processes.
A reader lease is a shared flock on the entry *directory* itself: it needs no file to be
created, so engines can join entries on a read-only mount of the cache; GC needs the same
lock exclusively to remove an entry. The kernel releases every flock when its holder dies,
even by ``kill -9``, so no stale lock can block the cache. flock needs a local filesystem
(on NFS it becomes a POSIX lock with other rules). Called by the store and GC only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path


class HeldLock:
    """An open, flock-ed lock file; ``release`` (or leaving the ``with``) unlocks it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd: int | None = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = None

    def unlink_and_release(self) -> None:
        """Remove the lock file while still holding it, so nobody locks a dead inode."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.release()

    def __enter__(self) -> HeldLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


def _try_lock(path: Path, mode: int, *, directory: bool = False) -> HeldLock | None:
    """One non-blocking attempt; None if someone else holds a conflicting lock.

    A lock file is created when missing; a directory must exist (FileNotFoundError).
    """
    while True:
        # O_NOFOLLOW: an entry (or a lock) that is a symlink out of the root is never locked
        # through; the caller reports it (ENOTDIR / ELOOP).
        if directory:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None
            raise
        # The file may have been unlinked or renamed away (GC removing an entry) between our
        # open and our flock: then we hold a lock nobody else can see. Retry on the current one.
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return HeldLock(path, fd)
        os.close(fd)
        if directory and not path.exists():
            raise FileNotFoundError(path)


def try_exclusive(path: Path) -> HeldLock | None:
    return _try_lock(path, fcntl.LOCK_EX)


def try_exclusive_dir(path: Path) -> HeldLock | None:
    """GC's side of a lease; FileNotFoundError if the directory is gone."""
    return _try_lock(path, fcntl.LOCK_EX, directory=True)


def is_free(path: Path) -> bool:
    """True if nobody holds the build lock at ``path``; opens nothing for writing, so it works
    on a read-only mount (a lock file that does not exist is held by nobody)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # flock ignores the open mode
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    finally:
        os.close(fd)


def read_holder(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def acquire(
    path: Path,
    *,
    shared: bool,
    timeout_s: float,
    directory: bool = False,
    on_wait: Callable[[float], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> HeldLock | None:
    """Take the lock within ``timeout_s`` seconds, or return None.

    flock has no timeout of its own, so this polls with a capped backoff; ``on_wait`` gets
    the seconds waited so far (the CLI shows it).
    """
    start = clock()
    delay = 0.01
    while True:
        held = _try_lock(path, fcntl.LOCK_SH if shared else fcntl.LOCK_EX, directory=directory)
        if held is not None:
            if not shared and not directory:
                # Record who builds, for the timeout message of the processes that wait.
                os.ftruncate(held.fd, 0)  # type: ignore[arg-type]
                os.pwrite(held.fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)  # type: ignore[arg-type]
            return held
        waited = clock() - start
        if waited >= timeout_s:
            return None
        if on_wait is not None:
            on_wait(waited)
        time.sleep(min(delay, max(0.0, timeout_s - waited)))
        delay = min(delay * 2, 0.25)
