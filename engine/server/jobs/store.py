"""JobStore: the bounded, expiring set of video jobs of one server, in memory.

The store keeps what it promised: a job it admitted runs to an end state, and a finished
job (its MP4 included) stays until its ``expires_at`` (``ttl_s`` after it finished) or a
DELETE - it is never evicted early to make room. Room is checked at admission instead:

- ``max_jobs`` bounds the jobs held, in any state (queued, running, finished and not yet
  expired);
- ``max_bytes`` bounds the bytes of stored MP4s plus the reservations of unfinished jobs
  (each reserves the raw RGB size of its frames, which bounds its H.264 file; the real size
  replaces the reservation once stored; a failed or cancelled job releases it).

A job that does not fit now is refused (``StoreFull``, a 429 with Retry-After: when finished
jobs fill the store, the seconds until the first of them expires); one that could never fit,
even in an empty store, is refused for good (``NeverFits``, a 400). Expiry is lazy: every store
operation first drops the jobs whose time is up and deletes their files, so an expired job
is never served. The clock is injected (tests move it; production uses ``time.time``).

Thread-safe: the engine's loop thread (progress), the encoding threads (completion) and the
HTTP handlers (create, read, delete) all call it. Listeners (``subscribe``) and the observer
are called outside the lock, with snapshots of the job's ``video`` object.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ditserve.engine.errors import DitServeError
from ditserve.engine.server.config import (
    DEFAULT_VIDEO_MAX_BYTES,
    DEFAULT_VIDEO_MAX_JOBS,
    DEFAULT_VIDEO_TTL_S,
)
from ditserve.engine.server.jobs.files import VideoFiles
from ditserve.engine.server.jobs.model import (
    JobStatus,
    VideoJob,
    VideoSpec,
    new_job_id,
    video_object,
)

Listener = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class StoreLimits:
    """max_jobs: jobs held at once, any state. max_bytes: stored MP4 bytes plus unfinished
    jobs' reservations. ttl_s: how long a finished job (and its file) is kept."""

    max_jobs: int = DEFAULT_VIDEO_MAX_JOBS
    max_bytes: int = DEFAULT_VIDEO_MAX_BYTES
    ttl_s: float = DEFAULT_VIDEO_TTL_S


class StoreFull(DitServeError):
    """No room for another job; ``retry_after_s``: when room is known to come, else None."""

    def __init__(self, message: str, retry_after_s: float | None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NeverFits(DitServeError):
    """A job that reserves more bytes than the whole store holds: no wait makes room."""

    def __init__(self, reserved: int, max_bytes: int) -> None:
        super().__init__(
            f"this video reserves {reserved} bytes (frames x height x width x 3, the bound of "
            f"its MP4 until it is encoded), more than the video store's whole {max_bytes} "
            "bytes (--video-max-bytes): it can never fit; ask for fewer frames or a smaller "
            "size, or raise --video-max-bytes")
        self.reserved = reserved
        self.max_bytes = max_bytes


class JobObserver(Protocol):
    def on_job_finished(self, status: str, video_seconds: float) -> None: ...


@dataclass(frozen=True)
class Content:
    """Where a completed job's MP4 is."""

    path: Path
    size: int
    completed_at: float


class JobStore:
    """See the module docstring."""

    def __init__(self, limits: StoreLimits, files: VideoFiles, *,
                 clock: Callable[[], float] = time.time,
                 observer: JobObserver | None = None) -> None:
        self.limits = limits
        self.files = files
        self.clock = clock
        self.observer = observer
        self._lock = threading.Lock()
        self._jobs: dict[str, VideoJob] = {}  # in id order: ids grow with creation time

    # -- admission ---------------------------------------------------------------------------
    def add(self, spec: VideoSpec, request_id: str) -> dict[str, Any]:
        """Admit a job (queued); raises NeverFits or StoreFull. Returns its ``video`` object."""
        with self._lock:
            self._expire_locked()
            self._check_room_locked(spec)
            job = VideoJob(new_job_id(), spec, request_id, created_at=self.clock(),
                           reserved_bytes=spec.raw_bytes)
            self._jobs[job.id] = job
            return video_object(job)

    def _check_room_locked(self, spec: VideoSpec) -> None:
        limits = self.limits
        if spec.raw_bytes > limits.max_bytes:
            raise NeverFits(spec.raw_bytes, limits.max_bytes)
        if len(self._jobs) >= limits.max_jobs:
            raise StoreFull(f"the video store holds {len(self._jobs)} jobs (max_jobs="
                            f"{limits.max_jobs}); retry when one expires or delete finished "
                            "ones", self._next_expiry_locked())
        used = self._bytes_locked()
        if used + spec.raw_bytes > limits.max_bytes:
            raise StoreFull(f"the video store has {limits.max_bytes - used} of its "
                            f"{limits.max_bytes} bytes free and this video reserves "
                            f"{spec.raw_bytes}; retry later or delete finished videos",
                            self._next_expiry_locked())

    def _next_expiry_locked(self) -> float | None:
        expiries = [j.expires_at for j in self._jobs.values() if j.expires_at is not None]
        if not expiries:
            return None  # only unfinished jobs hold the room: the server's Retry-After
        return max(1.0, math.ceil(min(expiries) - self.clock()))

    def _bytes_locked(self) -> int:
        return sum(j.size_bytes + j.reserved_bytes for j in self._jobs.values())

    def remove_unstarted(self, job_id: str) -> None:
        """Forget a job the engine refused to take (it was never visible as started)."""
        with self._lock:
            self._jobs.pop(job_id, None)

    # -- reads -------------------------------------------------------------------------------
    def get(self, job_id: str) -> dict[str, Any] | None:
        with self._lock:
            self._expire_locked()
            job = self._jobs.get(job_id)
            return video_object(job) if job is not None else None

    def page(self, *, limit: int, after: str | None, order: str
             ) -> tuple[list[dict[str, Any]], bool]:
        """Up to ``limit`` jobs after the id ``after`` in ``order`` ("asc": oldest first),
        and whether more follow."""
        with self._lock:
            self._expire_locked()
            ids = sorted(self._jobs, reverse=order == "desc")
            if after is not None:
                ids = [i for i in ids if (i < after if order == "desc" else i > after)]
            return [video_object(self._jobs[i]) for i in ids[:limit]], len(ids) > limit

    def content(self, job_id: str) -> tuple[dict[str, Any], Content | None] | None:
        """(the job's object, where its MP4 is once completed), or None if unknown."""
        with self._lock:
            self._expire_locked()
            job = self._jobs.get(job_id)
            if job is None:
                return None
            ready = job.status is JobStatus.COMPLETED and job.path is not None
            where = Content(job.path, job.size_bytes, job.completed_at or 0.0) if (
                ready and job.path is not None) else None
            return video_object(job), where

    def usage(self) -> tuple[dict[str, int], int]:
        """(jobs held by status, bytes stored plus reserved), for the metrics."""
        with self._lock:
            self._expire_locked()
            counts = {status.label: 0 for status in JobStatus}
            for job in self._jobs.values():
                counts[job.status.label] += 1
            return counts, self._bytes_locked()

    def unfinished(self) -> int:
        with self._lock:
            return sum(not j.status.is_finished for j in self._jobs.values())

    # -- changes (each notifies the job's listeners) -------------------------------------------
    def started(self, job_id: str, *, engine_id: str, seed: int) -> bool:
        """The engine took the job (still queued until its first step). False if the job
        was cancelled meanwhile: the caller aborts the engine's request."""
        def take(job: VideoJob) -> bool:
            if job.status.is_finished:
                return False
            job.engine_id, job.seed = engine_id, seed
            return True

        return self._change(job_id, take)

    def stepped(self, job_id: str, steps_done: int, eta_s: float | None = None) -> None:
        def move(job: VideoJob) -> bool:
            if job.status.is_finished or steps_done <= job.steps_done:
                return False
            if job.status is JobStatus.QUEUED:
                job.status, job.started_at = JobStatus.IN_PROGRESS, self.clock()
            job.steps_done, job.eta_s = steps_done, eta_s
            return True

        self._change(job_id, move)

    def complete(self, job_id: str, path: Path, size: int) -> bool:
        """The MP4 is published. False if the job was cancelled or deleted meanwhile (the
        caller removes the file: nobody will ask for it)."""
        def finish(job: VideoJob) -> bool:
            if job.status.is_finished:
                return False
            job.path, job.size_bytes = path, size
            self._finish_locked(job, JobStatus.COMPLETED)
            return True

        return self._change(job_id, finish)

    def fail(self, job_id: str, code: str, message: str) -> None:
        def finish(job: VideoJob) -> bool:
            if job.status.is_finished:
                return False
            job.error = {"code": code, "message": message}
            self._finish_locked(job, JobStatus.FAILED)
            return True

        self._change(job_id, finish)

    def cancel(self, job_id: str) -> str | None:
        """Cancel an unfinished job: the engine id to abort (None if it never reached the
        engine). The job stays, cancelled (``failed`` with code ``cancelled`` in the API),
        until it expires."""
        return self._cancel(job_id)[1]

    def _cancel(self, job_id: str) -> tuple[bool, str | None]:
        engine_ids: list[str | None] = [None]

        def finish(job: VideoJob) -> bool:
            if job.status.is_finished:
                return False
            engine_ids[0] = job.engine_id
            job.error = {"code": "cancelled", "message": "the job was cancelled by a DELETE"}
            self._finish_locked(job, JobStatus.CANCELLED)
            return True

        return self._change(job_id, finish), engine_ids[0]

    def delete(self, job_id: str) -> tuple[bool, str | None]:
        """DELETE: (whether the job existed, the engine id to abort). The job is gone at once:
        an unfinished one is cancelled first (its followers get its final, cancelled object;
        an MP4 still being encoded is dropped when it arrives), a finished one is removed
        with its file."""
        cancelled, engine_id = self._cancel(job_id)
        with self._lock:
            self._expire_locked()
            job = self._jobs.pop(job_id, None)
        if job is None:
            return False, None
        self.files.remove(job.path)
        return True, engine_id if cancelled else None

    def subscribe(self, job_id: str, listener: Listener) -> dict[str, Any] | None:
        """Call ``listener`` with the job's object after every change; returns the current
        object (None: unknown id, nothing subscribed)."""
        with self._lock:
            self._expire_locked()
            job = self._jobs.get(job_id)
            if job is None:
                return None
            job.listeners.append(listener)
            return video_object(job)

    def unsubscribe(self, job_id: str, listener: Listener) -> None:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is not None and listener in job.listeners:
                job.listeners.remove(listener)

    # -- internals ---------------------------------------------------------------------------
    def _change(self, job_id: str, apply: Callable[[VideoJob], bool | None]) -> bool:
        with self._lock:
            job = self._jobs.get(job_id)
            was_finished = job is not None and job.status.is_finished
            if job is None or apply(job) is False:
                return False
            # The engine thread changes every running job each step: build the API object
            # only when someone follows the job.
            listeners = list(job.listeners)
            snapshot = video_object(job) if listeners else None
            finished = job.status.is_finished and not was_finished
            if finished:
                job.listeners.clear()  # a finished job changes no more
        for listener in listeners:
            listener(snapshot)
        if finished and self.observer is not None:
            seconds = job.spec.duration_s if job.status is JobStatus.COMPLETED else 0.0
            self.observer.on_job_finished(job.status.label, seconds)
        return True

    def _finish_locked(self, job: VideoJob, status: JobStatus) -> None:
        job.status = status
        job.completed_at = self.clock()
        job.expires_at = job.completed_at + self.limits.ttl_s
        job.reserved_bytes = 0
        job.engine_id = None

    def _expire_locked(self) -> None:
        now = self.clock()
        expired = [i for i, j in self._jobs.items()
                   if j.expires_at is not None and j.expires_at <= now]
        for job_id in expired:
            self.files.remove(self._jobs.pop(job_id).path)
