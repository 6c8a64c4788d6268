"""Small best-effort records (recipes, stamps): atomic writes whose temps are never left behind.

A record is written to a hidden temp next to it (``.<name>.<pid>.<nonce>``) and renamed over
the record. The writer holds an exclusive ``flock`` on the temp while it exists, so a sweeper
can tell a live writer's temp from a dead one's (the kernel drops the flock of a killed
process, in any PID namespace on the node). A failed write (read-only mount, full disk)
removes its temp and returns False: a lost record costs a re-hash later, never a wrong entry.
Called by the store (recipes), the stamps and GC's sweep.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from collections.abc import Callable
from pathlib import Path

StageHook = Callable[[str], None]


def write_record(path: Path, text: str, *, on_stage: StageHook | None = None) -> bool:
    """Atomically replace ``path`` with ``text``; False (and no litter) if it cannot."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except OSError:
        return False  # read-only mount, no inodes, missing directory
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # fresh file: nobody else can hold it
        data = text.encode()
        while data:
            data = data[os.write(fd, data):]
        if on_stage is not None:
            on_stage("record_written")
        os.replace(tmp, path)  # a hint: no fsync needed, a lost one costs a re-hash
        return True
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return False
    finally:
        os.close(fd)


def is_record_temp(name: str) -> bool:
    return name.startswith(".") and name.count(".") >= 3


def sweep_record_temps(directory: Path) -> int:
    """Remove the temps of dead writers (their flock is gone) under ``directory``."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not is_record_temp(name):
            continue
        path = directory / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # a live writer holds it
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed
