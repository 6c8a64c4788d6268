"""JobStore: the bounded, expiring set of video jobs, kept in a job backend that every
replica of a deployment may share (``jobs.backend``: SQLite for one replica, Redis for many).

The store keeps what it promised: a job it admitted runs to an end state, and a finished
job (its MP4 included) stays until its ``expires_at`` (``ttl_s`` after it finished) or a
DELETE - it is never evicted early to make room. Room is checked at admission instead, in
the backend's transaction (so replicas admitting at once never overshoot):

- ``max_jobs`` bounds the jobs held, in any state (queued, running, finished, not expired);
- ``max_bytes`` bounds the bytes of stored MP4s plus the reservations of unfinished jobs
  (each reserves the raw RGB size of its frames, which bounds its H.264 file; the real size
  replaces the reservation once stored; a failed or cancelled job releases it).

A job that does not fit now is refused (``StoreFull``, a 429 with Retry-After: when finished
jobs fill the store, the seconds until the first of them expires); one that could never fit,
even in an empty store, is refused for good (``NeverFits``, a 400). Expiry is lazy: a read
never returns a job whose time is up, and the sweep that drops such jobs and deletes their
files runs at most once a second of reads (``SWEEP_S``: each is a round trip to a shared
store), and whenever an admission finds the store full. The clock is injected (tests move it;
production uses ``time.time``).

Work: ``claim`` gives a replica's worker the oldest claimable job with a fresh lease token;
``started``/``stepped``/``fail``/``hand_back`` move it only while that token is still the
job's (a replica that lost its lease cannot); ``complete`` takes the first result of any
claim and refuses every later one (a job never completes twice). A job claimed more than
``MAX_ATTEMPTS`` times (its replicas died each time) fails with ``job_interrupted``.

Thread-safe (the backend is). Listeners (``subscribe``) hear this process's changes at once,
with the job's ``video`` object; changes made by other replicas reach followers by polling
(``videos/routes.py``). The observer hears each job this process finished.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from ditserve.engine.server.jobs.backend import JobBackend, Usage
from ditserve.engine.server.jobs.errors import NeverFits, StoreFull
from ditserve.engine.server.jobs.model import (
    Content,
    JobObserver,
    JobStatus,
    StoreLimits,
    VideoJob,
    VideoSpec,
    new_job_id,
    video_object,
)
from ditserve.engine.server.jobs.results import ResultStore

Listener = Callable[[dict[str, Any]], None]
MAX_ATTEMPTS = 3  # claims of one job before it fails: a job that kills its replica stops
SWEEP_S = 1.0  # reads sweep expired jobs at most this often


class JobStore:
    """See the module docstring."""

    def __init__(self, limits: StoreLimits, files: ResultStore, backend: JobBackend, *,
                 clock: Callable[[], float] = time.time,
                 observer: JobObserver | None = None,
                 directory: ResultStore | None = None) -> None:
        self.limits = limits
        self.files = files
        # The video directory when results live elsewhere (a bucket): released at close.
        self._directory = directory if directory is not files else None
        self.backend = backend
        self.clock = clock
        self.observer = observer
        self._lock = threading.Lock()  # guards the listeners only
        self._listeners: dict[str, list[Listener]] = {}
        self._swept: float | None = None

    @property
    def shared(self) -> bool:
        return self.backend.shared

    # -- admission ---------------------------------------------------------------------------
    def add(self, spec: VideoSpec, request_id: str) -> dict[str, Any]:
        """Admit a job (queued); raises NeverFits, StoreFull or StoreUnavailable. Returns its
        ``video`` object."""
        if spec.raw_bytes > self.limits.max_bytes:
            raise NeverFits(spec.raw_bytes, self.limits.max_bytes)
        job = VideoJob(new_job_id(), spec, request_id, created_at=self.clock(),
                       reserved_bytes=spec.raw_bytes, seed=spec.params.seed)
        try:
            self.backend.add(job, lambda usage: self._check_room(spec, usage))
        except StoreFull:
            self._expire()  # expired jobs may hold the room: drop them, then judge again
            self.backend.add(job, lambda usage: self._check_room(spec, usage))
        return video_object(job)

    def _check_room(self, spec: VideoSpec, usage: Usage) -> None:
        limits = self.limits
        retry = (max(1.0, math.ceil(usage.next_expiry - self.clock()))
                 if usage.next_expiry is not None else None)  # None: the server's Retry-After
        if usage.jobs >= limits.max_jobs:
            raise StoreFull(f"the video store holds {usage.jobs} jobs (max_jobs="
                            f"{limits.max_jobs}); retry when one expires or delete finished "
                            "ones", retry)
        if usage.bytes + spec.raw_bytes > limits.max_bytes:
            raise StoreFull(f"the video store has {limits.max_bytes - usage.bytes} of its "
                            f"{limits.max_bytes} bytes free and this video reserves "
                            f"{spec.raw_bytes}; retry later or delete finished videos", retry)

    # -- reads -------------------------------------------------------------------------------
    def job(self, job_id: str) -> VideoJob | None:
        self._sweep()
        job = self.backend.get(job_id)
        if job is None or (job.expires_at is not None and job.expires_at <= self.clock()):
            return None  # expired: the next sweep removes it
        return job

    def get(self, job_id: str) -> dict[str, Any] | None:
        job = self.job(job_id)
        return video_object(job) if job is not None else None

    def page(self, *, limit: int, after: str | None, order: str
             ) -> tuple[list[dict[str, Any]], bool]:
        """Up to ``limit`` jobs after the id ``after`` in ``order`` ("asc": oldest first),
        and whether more follow."""
        self._expire()
        jobs, more = self.backend.page(limit=limit, after=after, descending=order == "desc")
        return [video_object(j) for j in jobs], more

    def content(self, job_id: str) -> tuple[dict[str, Any], Content | None] | None:
        """(the job's object, its MP4's facts once completed - read the bytes from
        ``files``), or None if unknown."""
        job = self.job(job_id)
        if job is None:
            return None
        where = None
        if job.status is JobStatus.COMPLETED and job.path is not None:
            # Named by the id in the result store: replicas may mount a directory elsewhere.
            where = Content(job.size_bytes, job.completed_at or 0.0)
        return video_object(job), where

    def usage(self) -> tuple[dict[str, int], int]:
        """(jobs held by status, bytes stored plus reserved), for the metrics."""
        self._expire()
        counts = {status.label: 0 for status in JobStatus}
        held = 0
        for job in self.backend.jobs():
            counts[job.status.label] += 1
            held += job.held_bytes
        return counts, held

    # -- work: claims and leases ---------------------------------------------------------------
    def claim(self, owner: str, lease_s: float) -> VideoJob | None:
        """The next job for ``owner`` to run, with a fresh token, or None. Jobs whose
        replicas died too often are failed on the way."""
        while True:
            token = secrets.token_hex(8)

            def take(job: VideoJob, token: str = token) -> bool:
                if job.attempts >= MAX_ATTEMPTS:  # claims that ran
                    job.error = {"code": "job_interrupted", "message": (
                        f"the replica running this job stopped {MAX_ATTEMPTS} times before "
                        "it finished (killed, out of memory, or cut off from the job store "
                        "for longer than the lease); see those replicas' logs")}
                    self._finish(job, JobStatus.FAILED)
                    return True
                job.attempts += 1
                job.owner, job.token = owner, token
                job.status, job.steps_done, job.eta_s = JobStatus.QUEUED, 0, None
                return True

            job = self.backend.claim(owner, lease_s, take)
            if job is None:
                return None
            self._notify(job, just_finished=job.status.is_finished)
            if not job.status.is_finished:
                return job

    def renew(self, job_id: str, token: str, lease_s: float) -> VideoJob | None:
        """The job as it is now (None: deleted); its lease extended if still ``token``'s."""
        return self.backend.renew(job_id, token, lease_s)

    def started(self, job_id: str, token: str, *, seed: int) -> bool:
        """The engine took the job (still queued until its first step). False: the job was
        cancelled, deleted or re-claimed meanwhile - the caller aborts the engine request."""
        def take(job: VideoJob) -> bool:
            if job.status.is_finished or job.token != token:
                return False
            job.seed = seed
            return True

        return self._change(job_id, take)

    def stepped(self, job_id: str, token: str, steps_done: int,
                eta_s: float | None = None) -> bool:
        def move(job: VideoJob) -> bool:
            if job.status.is_finished or job.token != token or steps_done <= job.steps_done:
                return False
            if job.status is JobStatus.QUEUED:
                job.status, job.started_at = JobStatus.IN_PROGRESS, self.clock()
            job.steps_done, job.eta_s = steps_done, eta_s
            return True

        return self._change(job_id, move)

    def complete(self, job_id: str, path: str, size: int) -> bool:
        """The MP4 is published. The first result of any claim wins; False if the job was
        finished (by another claim's result, a cancel) or deleted meanwhile."""
        def finish(job: VideoJob) -> bool:
            if job.status.is_finished:
                return False
            job.path, job.size_bytes = path, size
            job.steps_done = job.spec.params.num_inference_steps  # whatever reports got lost
            self._finish(job, JobStatus.COMPLETED)
            return True

        return self._change(job_id, finish)

    def fail(self, job_id: str, code: str, message: str, *, token: str | None = None) -> bool:
        """Fail an unfinished job; with ``token``, only while that claim is current."""
        def finish(job: VideoJob) -> bool:
            if job.status.is_finished or (token is not None and job.token != token):
                return False
            job.error = {"code": code, "message": message}
            self._finish(job, JobStatus.FAILED)
            return True

        return self._change(job_id, finish)

    def hand_back(self, job_id: str, token: str) -> bool:
        """Put a claimed job back in the queue for any replica (this one stops, or its engine
        could not take it); the claim does not count as an attempt."""
        def release(job: VideoJob) -> bool:
            if job.status.is_finished or job.token != token:
                return False
            job.owner = job.token = None
            job.attempts = max(0, job.attempts - 1)
            job.status, job.steps_done, job.eta_s, job.started_at = (
                JobStatus.QUEUED, 0, None, None)
            return True

        return self._change(job_id, release)

    # -- cancel and delete ---------------------------------------------------------------------
    def cancel(self, job_id: str) -> str | None:
        """Cancel an unfinished job: the owner running it (None if queued or unknown). The
        job stays, cancelled (``failed`` with code ``cancelled``), until it expires."""
        owners: list[str | None] = [None]

        def finish(job: VideoJob) -> bool:
            if job.status.is_finished:
                return False
            owners[0] = job.owner
            job.error = {"code": "cancelled", "message": "the job was cancelled by a DELETE"}
            self._finish(job, JobStatus.CANCELLED)
            return True

        self._change(job_id, finish)
        return owners[0]

    def delete(self, job_id: str) -> tuple[bool, str | None]:
        """DELETE: (whether the job existed, the owner that was running it). The job is gone
        at once: an unfinished one is cancelled first (its followers get its final, cancelled
        object; its replica aborts it at its next lease renewal, or at once if it is this
        one), a finished one is removed with its file."""
        owner = self.cancel(job_id)
        job = self.backend.remove(job_id)
        if job is None:
            return False, None
        self._remove_file(job)
        return True, owner

    def subscribe(self, job_id: str, listener: Listener) -> dict[str, Any] | None:
        """Call ``listener`` with the job's object after each change this process makes;
        returns the current object (None: unknown id, nothing subscribed)."""
        with self._lock:
            self._listeners.setdefault(job_id, []).append(listener)
        current = self.get(job_id)
        if current is None:
            self.unsubscribe(job_id, listener)
        return current

    def unsubscribe(self, job_id: str, listener: Listener) -> None:
        with self._lock:
            listeners = self._listeners.get(job_id, [])
            if listener in listeners:
                listeners.remove(listener)
            if not listeners:
                self._listeners.pop(job_id, None)

    def close(self) -> None:
        self.backend.close()
        self.files.close()
        if self._directory is not None:
            self._directory.close()

    # -- internals ---------------------------------------------------------------------------
    def _change(self, job_id: str, apply: Callable[[VideoJob], bool]) -> bool:
        finished = [False]

        def change(job: VideoJob) -> bool:
            was = job.status.is_finished
            if apply(job) is False:
                return False
            finished[0] = job.status.is_finished and not was
            return True

        job = self.backend.update(job_id, change)
        if job is None:
            return False
        self._notify(job, just_finished=finished[0])
        return True

    def _notify(self, job: VideoJob, *, just_finished: bool) -> None:
        with self._lock:
            listeners = list(self._listeners.get(job.id, ()))
        if listeners:
            # The engine thread changes every running job each step: build the API object
            # only when someone follows the job.
            snapshot = video_object(job)
            for listener in listeners:
                listener(snapshot)
        if just_finished and self.observer is not None:
            seconds = job.spec.duration_s if job.status is JobStatus.COMPLETED else 0.0
            self.observer.on_job_finished(job.status.label, seconds)

    def _finish(self, job: VideoJob, status: JobStatus) -> None:
        job.spec = job.spec.without_media()  # nothing runs a finished job again
        job.status = status
        job.completed_at = self.clock()
        job.expires_at = job.completed_at + self.limits.ttl_s
        job.reserved_bytes = 0
        job.owner = job.token = None

    def _sweep(self) -> None:
        now = self.clock()
        if self._swept is None or not 0 <= now - self._swept < SWEEP_S:
            self._expire()

    def _expire(self) -> None:
        self._swept = self.clock()
        for job_id in self.backend.expired(self.clock()):
            job = self.backend.remove(job_id)
            if job is not None:
                self._remove_file(job)

    def _remove_file(self, job: VideoJob) -> None:
        if job.path is not None:
            self.files.remove(job.id)
