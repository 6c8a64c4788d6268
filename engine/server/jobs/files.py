"""The directory that holds finished videos, and how a file gets there.

``VideoFiles.publish`` writes an MP4 so that a half-written one is never visible: into
``<root>/.tmp/`` (same filesystem), fsync, rename to ``<root>/<job id>.mp4``, fsync the
directory (so the rename itself survives a crash). A failed write (a full disk: ENOSPC, a
quota: EDQUOT, or any other OSError) removes its temp file and raises ``StorageError``; the
caller fails the job. Called by ``VideoJobs`` from its encoding threads.

A configured root (``--video-dir``) belongs to one server at a time: the server holds an
exclusive ``flock`` on ``<root>/.lock`` (a second server on the same directory refuses to
start), and at start removes what a previous process left (its jobs are gone with it: job
state lives in memory). Without a configured root the server makes a private temporary
directory and removes it at shutdown.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import shutil
import tempfile
from pathlib import Path

from ditserve.engine.errors import ConfigError, DitServeError
from ditserve.engine.server.jobs.model import JOB_ID_PATTERN

log = logging.getLogger(__name__)

SUFFIX = ".mp4"
TEMP_DIR = ".tmp"
LOCK_FILE = ".lock"
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class StorageError(DitServeError):
    """A video could not be stored. ``no_space``: the filesystem is full (or over quota)."""

    def __init__(self, message: str, *, no_space: bool) -> None:
        super().__init__(message)
        self.no_space = no_space


class VideoFiles:
    """The content directory of one server (see the module docstring)."""

    def __init__(self, root: str | Path | None) -> None:
        self.private = root is None
        self.root = Path(tempfile.mkdtemp(prefix="ditserve-videos-") if root is None else root)
        self._lock_fd: int | None = None
        if not self.private:
            self._claim()
        (self.root / TEMP_DIR).mkdir(exist_ok=True)

    def _claim(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise ConfigError(f"server.video_dir {str(self.root)!r} cannot be used: {e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(f"server.video_dir {str(self.root)!r} is in use by another "
                              "ditserve server; give each server its own directory") from None
        self._lock_fd = fd
        left = self._leftovers()
        for path in left:
            path.unlink(missing_ok=True)
        shutil.rmtree(self.root / TEMP_DIR, ignore_errors=True)
        if left:
            log.info("removed %d video(s) a previous server left in %s (their jobs ended "
                     "with that process)", len(left), self.root)

    def _leftovers(self) -> list[Path]:
        # Only files this class names, so a mistaken --video-dir loses nothing else.
        return [p for p in self.root.iterdir()
                if p.suffix == SUFFIX and JOB_ID_PATTERN.fullmatch(p.stem) and p.is_file()]

    def path_of(self, job_id: str) -> Path:
        return self.root / f"{job_id}{SUFFIX}"

    def publish(self, job_id: str, data: bytes) -> Path:
        """Write ``data`` as the job's MP4, atomically and durably; raises StorageError."""
        final = self.path_of(job_id)
        temp = self.root / TEMP_DIR / f"{job_id}.{secrets.token_hex(4)}{SUFFIX}"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)  # the bytes are on disk before the name points at them
            finally:
                os.close(fd)
            os.rename(temp, final)
            _fsync_dir(self.root)  # the rename is on disk too
        except OSError as e:
            with contextlib.suppress(OSError):
                temp.unlink(missing_ok=True)
            no_space = e.errno in NO_SPACE
            reason = "no space left in the video directory" if no_space else os.strerror(
                e.errno or 0) or str(e)
            raise StorageError(reason, no_space=no_space) from e
        return final

    def remove(self, path: Path | None) -> None:
        if path is not None:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)

    def close(self) -> None:
        """Release the directory (a private one is removed with everything in it)."""
        if self.private:
            shutil.rmtree(self.root, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
