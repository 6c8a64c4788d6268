"""The job backend: where every replica's video jobs live, and the work queue they share.

``JobBackend`` is the small contract the job layer (``JobStore``) is written against; two
real engines implement it: ``SqliteBackend`` (the default: one file under ``--video-dir``;
one replica, whose jobs survive its restarts) and ``RedisBackend`` (many replicas as one
service). ``open_backend`` picks one from ``--job-store`` (``sqlite:///PATH`` or
``redis://HOST:PORT/DB``). The job logic (which change is allowed when) is ``JobStore``'s,
the same for both; a backend only makes each change atomic and keeps the queue:

- ``add`` inserts a queued job and enqueues it, after ``admit`` approved the store's usage
  read in the same transaction (so concurrent creates on several replicas never overshoot
  the bounds);
- ``update`` is one atomic read-modify-write of one job; it also keeps the queue in step:
  a job that just finished leaves the queue, a job whose owner let it go (``owner`` became
  None while unfinished) goes back into it;
- ``claim`` hands the oldest claimable job to ``take``: a queued one, or one whose lease
  expired (its replica died or lost the backend for longer than the lease);
- ``renew`` extends a lease while its token is still the job's.

A backend that cannot be reached raises ``StoreUnavailable`` (the routes answer 503 with
Retry-After; a replica's running jobs go on and write their results once it is back).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ditserve.engine.server.jobs.model import VideoJob


@dataclass(frozen=True)
class Usage:
    """What admission reads: jobs held, bytes held, and the soonest expiry of a finished
    job (None while none is finished)."""

    jobs: int
    bytes: int
    next_expiry: float | None


Change = Callable[[VideoJob], bool]  # mutates the job; False: no change (nothing written)


class JobBackend(Protocol):
    """See the module docstring. ``shared``: whether other replicas see the same jobs (their
    results then live in a directory every replica mounts)."""

    shared: bool

    def add(self, job: VideoJob, admit: Callable[[Usage], None]) -> None: ...

    def get(self, job_id: str) -> VideoJob | None: ...

    def page(self, *, limit: int, after: str | None, descending: bool
             ) -> tuple[list[VideoJob], bool]: ...

    def jobs(self) -> list[VideoJob]:
        """Every job held (for metrics and leftovers; bounded by ``max_jobs``)."""
        ...

    def update(self, job_id: str, change: Change) -> VideoJob | None:
        """The changed job, or None (no such job, or ``change`` returned False)."""
        ...

    def remove(self, job_id: str) -> VideoJob | None: ...

    def expired(self, now: float) -> list[str]:
        """Ids of finished jobs whose ``expires_at`` passed."""
        ...

    def claim(self, owner: str, lease_s: float, take: Change) -> VideoJob | None: ...

    def renew(self, job_id: str, token: str, lease_s: float) -> VideoJob | None:
        """The job as it is now (None: gone); the lease was extended only if ``token`` is
        still the job's and the job is unfinished."""
        ...

    def close(self) -> None: ...
