"""One build per node: the daemon's build coordinator.

Concurrent ensure requests for the same recipe share one Job (and one build thread); the
store's flock still guards against builders outside the daemon. A recipe whose entry is
published and stamped is answered ready at once, without a job thread, so polling clients
(``wait_s=0``) see "ready" rather than a new "building" job per poll. Jobs report phase and byte
progress for long-polling clients. On shutdown, running builds get a grace period to finish.
Called by the daemon's HTTP handlers.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

from ditserve.cachectl.errors import CacheError, EntryCorruptError, LockTimeoutError
from ditserve.cachectl.logs import event
from ditserve.cachectl.metrics import DaemonMetrics
from ditserve.cachectl.model_build import ModelLoader, ModelRequest, ensure_model, plan_model
from ditserve.cachectl.store import CacheStore


class JobStatus(str, enum.Enum):
    BUILDING = "building"
    READY = "ready"
    FAILED = "failed"


@dataclass
class Job:
    recipe_key: str
    request: ModelRequest
    status: JobStatus = JobStatus.BUILDING
    phase: str = "queued"
    key: str | None = None
    path: str | None = None
    done_bytes: int = 0
    total_bytes: int = 0
    built: bool = False
    error: str | None = None
    reason: str | None = None
    started: bool = False
    future: Future[None] = field(default_factory=Future)

    def snapshot(self) -> dict[str, Any]:
        return {"status": self.status.value, "key": self.key, "path": self.path,
                "phase": self.phase, "built": self.built,
                "progress": {"done_bytes": self.done_bytes, "total_bytes": self.total_bytes},
                "error": self.error, "reason": self.reason}

    def finish(self, status: JobStatus, phase: str) -> None:
        self.status, self.phase = status, phase
        if not self.future.done():
            self.future.set_result(None)


def _ready(recipe_key: str, request: ModelRequest, key: str, path: str | None,
           nbytes: int) -> Job:
    """The answer for a published entry (a hit: not built by this request)."""
    job = Job(recipe_key, request, key=key, path=path, done_bytes=nbytes, total_bytes=nbytes)
    job.finish(JobStatus.READY, "published")
    return job


class BuildCoordinator:
    """Maps recipe keys to jobs; ``submit`` answers a ready entry, joins the running build or
    starts one."""

    def __init__(self, store: CacheStore, metrics: DaemonMetrics, logger: logging.Logger,
                 loader: ModelLoader, *, max_builds: int = 2) -> None:
        self.store = store
        self.metrics = metrics
        self.logger = logger
        self.loader = loader
        self._pool = ThreadPoolExecutor(max_workers=max_builds, thread_name_prefix="cachectl-build")
        self._lock = threading.Lock()
        self._jobs: dict[str, Job] = {}
        self._stopping = False

    def jobs(self) -> list[Job]:
        """Every job this daemon knows (running, ready and failed), e.g. for the node status."""
        with self._lock:
            return list(self._jobs.values())

    def submit(self, request: ModelRequest) -> Job:
        plan = plan_model(request, self.loader)  # raises BuildError for an unusable model dir
        recipe_key = plan.recipe.key
        with self._lock:
            job = self._jobs.get(recipe_key)
            if job is not None and job.status is JobStatus.BUILDING:
                self.metrics.ensure_requests.labels("joined_build").inc()
                return job
        # A remembered READY job is not proof: scrub or verify may have found its entry
        # corrupt since (and dropped its stamp); the stamped join below is a few stat calls.
        ready = self._ready_without_hashing(plan.recipe, recipe_key, request)
        with self._lock:
            if ready is not None:
                self._jobs[recipe_key] = ready
                self.metrics.ensure_requests.labels("hit").inc()
                return ready
            job = self._jobs.get(recipe_key)
            if job is not None and job.status is JobStatus.BUILDING:
                self.metrics.ensure_requests.labels("joined_build").inc()
                return job
            if self._stopping:
                raise CacheError("the daemon is stopping; retry, or build with --no-daemon")
            job = Job(recipe_key, request)
            self._jobs[recipe_key] = job
            self._pool.submit(self._run, job)
            return job

    def _ready_without_hashing(self, recipe: Any, recipe_key: str,
                               request: ModelRequest) -> Job | None:
        key = self.store.resolve_recipe(recipe)
        entry = self.store.try_join_stamped(key) if key is not None else None
        if entry is None:
            return None  # unknown, or it needs a re-hash: a job does that
        with entry:
            return _ready(recipe_key, request, entry.key, str(entry.path), entry.total_bytes)

    def _run(self, job: Job) -> None:
        job.started = True
        start = time.monotonic()

        def on_phase(p: str) -> None:
            job.phase = p
            event(self.logger, "build_phase", recipe=job.recipe_key, phase=p)

        def on_progress(done: int, total: int) -> None:
            job.done_bytes, job.total_bytes = done, total

        def on_wait(waited: float) -> None:
            job.phase = f"waiting for another builder ({waited:.0f}s)"

        try:
            on_phase("resolving")
            with ensure_model(self.store, job.request, self.loader, on_phase=on_phase,
                              on_wait=on_wait, on_progress=on_progress) as entry:
                job.key, job.path, job.built = entry.key, str(entry.path), entry.built
                job.total_bytes = job.done_bytes = entry.total_bytes
            outcome = "built" if job.built else "hit"
            if job.built:
                self.metrics.builds.labels("ok").inc()
                self.metrics.build_seconds.observe(time.monotonic() - start)
            self.metrics.ensure_requests.labels(outcome).inc()
            event(self.logger, "ensure_done", recipe=job.recipe_key, key=job.key,
                  outcome=outcome, seconds=round(time.monotonic() - start, 3))
            job.finish(JobStatus.READY, "published")
        except Exception as e:  # every failure must reach the waiting clients
            job.reason = ("corrupt" if isinstance(e, EntryCorruptError) else
                          "timeout" if isinstance(e, LockTimeoutError) else
                          "cache_error" if isinstance(e, CacheError) else "error")
            job.error = str(e)
            self.metrics.builds.labels(job.reason).inc()
            event(self.logger, "ensure_failed", logging.ERROR, recipe=job.recipe_key,
                  reason=job.reason, error=str(e))
            job.finish(JobStatus.FAILED, "failed")

    def drain(self, grace_s: float) -> list[Job]:
        """Stop taking builds, drop queued ones, give running ones ``grace_s`` to finish;
        returns the jobs still running after it (abandoned)."""
        with self._lock:
            self._stopping = True
            jobs = list(self._jobs.values())
        self._pool.shutdown(wait=False, cancel_futures=True)
        for job in jobs:
            if job.status is JobStatus.BUILDING and not job.started:
                job.error, job.reason = "the daemon stopped before this build started", "stopped"
                job.finish(JobStatus.FAILED, "failed")
        running = [j for j in jobs if j.status is JobStatus.BUILDING]
        if running:
            event(self.logger, "draining_builds", builds=len(running), grace_s=grace_s,
                  recipes=[j.recipe_key for j in running])
            wait_futures([j.future for j in running], timeout=grace_s)
        return [j for j in running if j.status is JobStatus.BUILDING]
