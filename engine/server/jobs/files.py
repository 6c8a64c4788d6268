"""The directory that holds finished videos, and how a file gets there.

``VideoFiles.publish`` writes an MP4 so that a half-written one is never visible: into
``<root>/.tmp/`` (same filesystem), fsync, hard-link to ``<root>/<job id>.mp4``, fsync the
directory (so the new name itself survives a crash). The link, unlike a rename, never
replaces a file: when two claims of one job both finish (a replica thought dead was only
slow), the first file stays and the second writer learns it did not create it (so it never
removes the winner's file). A failed write (a full disk: ENOSPC, a quota: EDQUOT, or any
other OSError) removes its temp file and raises ``StorageError``; the caller fails the job.
Called by ``JobWorker`` from its encoding threads; a ``ResultStore`` (``results.py``).

Three kinds of root:

- owned (``--video-dir`` with the default SQLite job store): one server at a time holds an
  exclusive ``flock`` on ``<root>/.lock`` (a second server on the directory refuses to
  start); at start ``sweep`` removes the temp files and the MP4s no job names any more;
- shared (``--video-dir`` on a volume every replica mounts, with a Redis job store): no lock,
  no sweep - files go with their jobs (DELETE, expiry) whichever replica removes them; the
  root is marked (``SHARED_MARKER``), so a server with a store of its own refuses it rather
  than sweep away the shared store's videos;
- private (no ``--video-dir``): a temporary directory removed at shutdown.
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

from ditserve.engine.errors import ConfigError
from ditserve.engine.server.jobs.errors import StorageError
from ditserve.engine.server.jobs.model import JOB_ID_PATTERN
from ditserve.engine.server.jobs.results import ResultMissing

log = logging.getLogger(__name__)

SUFFIX = ".mp4"
TEMP_DIR = ".tmp"
LOCK_FILE = ".lock"
SHARED_MARKER = ".shared-job-store"  # a shared root's: an owned server never takes it
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
NO_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS)


class VideoFiles:
    """The content directory of one server (see the module docstring)."""

    def __init__(self, root: str | Path | None, *, shared: bool = False) -> None:
        self.private = root is None
        self.shared = shared and not self.private
        self.root = Path(tempfile.mkdtemp(prefix="ditserve-videos-") if root is None else root)
        self._lock_fd: int | None = None
        if self.shared:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                marker = self.root / SHARED_MARKER
                if not marker.exists():
                    marker.write_text("the videos of ditserve replicas sharing a job store "
                                      "(Redis); a server with a store of its own refuses this "
                                      "directory\n")
            except OSError as e:
                raise ConfigError(f"server.video_dir {str(self.root)!r} cannot be used: {e}"
                                  ) from e
        elif not self.private:
            self._claim()
        (self.root / TEMP_DIR).mkdir(exist_ok=True)

    def _claim(self) -> None:
        if (self.root / SHARED_MARKER).exists():
            # Its start-up sweep would delete every video the shared store's jobs name.
            raise ConfigError(f"server.video_dir {str(self.root)!r} holds the videos of "
                              "replicas sharing a job store (Redis); give this server the same "
                              "--job-store, or another --video-dir")
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
        shutil.rmtree(self.root / TEMP_DIR, ignore_errors=True)  # a dead writer's half files

    def sweep(self, keep: set[str]) -> None:
        """Remove the MP4s of jobs not in ``keep`` (the job store's ids): a previous
        server's files whose jobs expired or were deleted while it was down, or were never
        recorded (it died between the file and the record). Owned roots only."""
        if self.shared or self.private:
            return
        # Only files this class names, so a mistaken --video-dir loses nothing else.
        left = [p for p in self.root.iterdir() if p.suffix == SUFFIX and p.is_file()
                and JOB_ID_PATTERN.fullmatch(p.stem) and p.stem not in keep]
        for path in left:
            path.unlink(missing_ok=True)
        if left:
            log.info("removed %d video(s) in %s that no job names", len(left), self.root)

    def path_of(self, job_id: str) -> Path:
        return self.root / f"{job_id}{SUFFIX}"

    def publish(self, job_id: str, data: bytes) -> tuple[str, bool]:
        """Write ``data`` as the job's MP4, atomically and durably: (its path, whether this
        call created it - False when another claim of the job published first). Raises
        StorageError."""
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
            created = _name(temp, final)
            temp.unlink(missing_ok=True)
            _fsync_dir(self.root)  # the new name is on disk too
        except OSError as e:
            with contextlib.suppress(OSError):
                temp.unlink(missing_ok=True)
            no_space = e.errno in NO_SPACE
            reason = "no space left in the video directory" if no_space else os.strerror(
                e.errno or 0) or str(e)
            raise StorageError(reason, no_space=no_space) from e
        return str(final), created

    def read(self, job_id: str, start: int, end: int) -> FileRange:
        try:
            # Opened now: a DELETE or an expiry from here on unlinks a file this reader keeps.
            fd = os.open(self.path_of(job_id), os.O_RDONLY)
        except FileNotFoundError:
            raise ResultMissing(job_id) from None
        return FileRange(fd, start, end)

    def remove(self, job_id: str) -> None:
        with contextlib.suppress(OSError):
            self.path_of(job_id).unlink(missing_ok=True)

    def close(self) -> None:
        """Release the directory (a private one is removed with everything in it)."""
        if self.private:
            shutil.rmtree(self.root, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None


class FileRange:
    """Bytes [start, end) of an open MP4 (a ``ResultReader``)."""

    def __init__(self, fd: int, start: int, end: int) -> None:
        self._fd: int | None = fd
        self._at, self._end = start, end

    def read(self, size: int) -> bytes:
        if self._fd is None or self._at >= self._end:
            return b""
        chunk = os.pread(self._fd, min(size, self._end - self._at), self._at)
        self._at = self._at + len(chunk) if chunk else self._end  # shorter than said: stop
        return chunk

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _name(temp: Path, final: Path) -> bool:
    """Give ``temp`` the name ``final`` unless a file has it; whether this call named it."""
    try:
        os.link(temp, final)
        return True
    except FileExistsError:
        return False  # another claim of this job published first: keep its file
    except OSError as e:
        if e.errno not in NO_LINKS:
            raise
    # A filesystem without hard links (some network shares): a rename, which replaces a file
    # another claim published in the same instant - the same job's video either way.
    if final.exists():
        return False
    os.rename(temp, final)
    return True


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
