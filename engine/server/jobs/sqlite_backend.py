"""SqliteBackend: the default job backend, one SQLite file (``<video-dir>/jobs.sqlite3``).

For one replica: its jobs - finished ones, their files and the queue - survive a restart of
the process (a crash, an OOM kill, a rollout onto the same volume). The file belongs to one
server at a time (an exclusive ``flock`` on ``<file>.lock``; a second server refuses to
start), so at open every lease found in it is a dead process's: those jobs become claimable
at once and the new process runs them again (their attempt counts go on; ``JobStore`` fails
a job with ``job_interrupted`` after too many).

One table: the job as its JSON record (``jobs.records``) plus the columns the queries need
(finished, lease expiry, expiry, bytes). WAL journal with ``synchronous=NORMAL``: a commit
survives a killed process (not necessarily a power cut, which the next start treats like
any restart). Every change is one ``BEGIN IMMEDIATE`` transaction on one connection behind
a lock (the engine's loop thread, the encoders and the HTTP handlers all write). The
queue is implicit: the oldest unfinished job without a live lease. Leases are timed with the
store's clock (one process, one clock).
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ditserve.engine.errors import ConfigError
from ditserve.engine.server.jobs.backend import Change, Usage
from ditserve.engine.server.jobs.errors import StoreUnavailable
from ditserve.engine.server.jobs.model import VideoJob
from ditserve.engine.server.jobs.records import decode_job, encode_job

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    data TEXT NOT NULL,
    finished INTEGER NOT NULL,
    lease_until REAL,
    expires_at REAL,
    bytes INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_expiry ON jobs (expires_at);
"""


class SqliteBackend:
    """See the module docstring."""

    shared = False

    def __init__(self, path: Path, *, clock: Callable[[], float]) -> None:
        self.path = path
        self.clock = clock
        self._lock = threading.Lock()
        self._lock_fd = _own(path)
        try:
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)
            # Every lease in the file is a dead process's (we own the file): claimable now.
            self._db.execute("UPDATE jobs SET lease_until = 0 WHERE finished = 0 AND "
                             "lease_until IS NOT NULL")
        except sqlite3.Error as e:
            os.close(self._lock_fd)
            raise ConfigError(f"the job store {str(path)!r} cannot be opened: {e}") from e

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock, _reach(self.path):
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        with self._lock, _reach(self.path):
            yield self._db

    def _write(self, db: sqlite3.Connection, job: VideoJob, *,
               lease_until: float | None | bool = False) -> None:
        """Insert or replace ``job``; ``lease_until`` False keeps the stored lease (cleared
        whenever the job has no owner)."""
        if job.owner is None or job.status.is_finished:
            lease_until = None
        elif lease_until is False:
            row = db.execute("SELECT lease_until FROM jobs WHERE id = ?", (job.id,)).fetchone()
            lease_until = row[0] if row else None
        db.execute("INSERT OR REPLACE INTO jobs (id, data, finished, lease_until, expires_at, "
                   "bytes) VALUES (?, ?, ?, ?, ?, ?)",
                   (job.id, encode_job(job), int(job.status.is_finished), lease_until,
                    job.expires_at, job.held_bytes))

    # -- the JobBackend contract ---------------------------------------------------------------
    def add(self, job: VideoJob, admit: Callable[[Usage], None]) -> None:
        with self._transaction() as db:
            count, used = db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM jobs"
                                     ).fetchone()
            soonest = db.execute("SELECT MIN(expires_at) FROM jobs").fetchone()[0]
            admit(Usage(count, used, soonest))
            self._write(db, job)

    def get(self, job_id: str) -> VideoJob | None:
        with self._read() as db:
            row = db.execute("SELECT data FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return decode_job(row[0]) if row else None

    def page(self, *, limit: int, after: str | None, descending: bool
             ) -> tuple[list[VideoJob], bool]:
        order, compare = ("DESC", "<") if descending else ("ASC", ">")
        where = f"WHERE id {compare} ?" if after is not None else ""
        with self._read() as db:
            rows = db.execute(f"SELECT data FROM jobs {where} ORDER BY id {order} LIMIT ?",
                                    (*(() if after is None else (after,)), limit + 1)).fetchall()
        return [decode_job(r[0]) for r in rows[:limit]], len(rows) > limit

    def jobs(self) -> list[VideoJob]:
        with self._read() as db:
            rows = db.execute("SELECT data FROM jobs ORDER BY id").fetchall()
        return [decode_job(r[0]) for r in rows]

    def update(self, job_id: str, change: Change) -> VideoJob | None:
        with self._transaction() as db:
            row = db.execute("SELECT data FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                return None
            job = decode_job(row[0])
            if change(job) is False:
                return None
            self._write(db, job)
            return job

    def remove(self, job_id: str) -> VideoJob | None:
        with self._transaction() as db:
            row = db.execute("SELECT data FROM jobs WHERE id = ?", (job_id,)).fetchone()
            db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
        return decode_job(row[0]) if row else None

    def expired(self, now: float) -> list[str]:
        with self._read() as db:
            rows = db.execute("SELECT id FROM jobs WHERE expires_at <= ?", (now,)).fetchall()
        return [r[0] for r in rows]

    def claim(self, owner: str, lease_s: float, take: Change) -> VideoJob | None:
        now = self.clock()
        with self._transaction() as db:
            row = db.execute("SELECT data FROM jobs WHERE finished = 0 AND (lease_until IS NULL "
                             "OR lease_until < ?) ORDER BY id LIMIT 1", (now,)).fetchone()
            if row is None:
                return None
            job = decode_job(row[0])
            if take(job) is False:
                return None
            self._write(db, job, lease_until=now + lease_s)
            return job

    def renew(self, job_id: str, token: str, lease_s: float) -> VideoJob | None:
        with self._transaction() as db:
            db.execute("UPDATE jobs SET lease_until = ? WHERE id = ? AND finished = 0 AND "
                       "lease_until IS NOT NULL AND json_extract(data, '$.token') = ?",
                       (self.clock() + lease_s, job_id, token))
            row = db.execute("SELECT data FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return decode_job(row[0]) if row else None

    def close(self) -> None:
        with self._lock:
            self._db.close()
        os.close(self._lock_fd)  # releases the flock


@contextmanager
def _reach(path: Path) -> Iterator[None]:
    """A failing database (disk full, I/O error, locked too long) is an unavailable store."""
    try:
        yield
    except sqlite3.OperationalError as e:
        raise StoreUnavailable(f"the job store {str(path)!r} failed: {e}") from e


def _own(path: Path) -> int:
    """Hold ``<path>.lock`` exclusively for this process's life (a ConfigError if taken)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise ConfigError(f"the job store {str(path)!r} cannot be used: {e}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"the job store {str(path)!r} is in use by another ditserve server; "
                          "give each server its own --video-dir, or share jobs between "
                          "replicas with --job-store redis://HOST:PORT/DB") from None
    return fd
