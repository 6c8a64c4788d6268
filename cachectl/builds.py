"""One build per node: the daemon's build coordinator.

Concurrent ensure requests for the same recipe share one Job (and one build thread); the
store's flock still guards against builders outside the daemon. Jobs report phase and byte
progress for long-polling clients. Called by the daemon's HTTP handlers.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ditserve.cachectl.entry import Entry
from ditserve.cachectl.errors import CacheError, EntryCorruptError, LockTimeoutError
from ditserve.cachectl.logs import event
from ditserve.cachectl.metrics import DaemonMetrics
from ditserve.cachectl.model_build import ModelRequest, ensure_model, plan_model
from ditserve.cachectl.store import CacheStore

EnsureFn = Callable[..., Entry]  # (store, request, *, on_phase, on_wait, on_progress) -> Entry


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
    future: Future[None] = field(default_factory=Future)

    def snapshot(self) -> dict[str, Any]:
        return {"status": self.status.value, "key": self.key, "path": self.path,
                "phase": self.phase, "built": self.built,
                "progress": {"done_bytes": self.done_bytes, "total_bytes": self.total_bytes},
                "error": self.error, "reason": self.reason}


class BuildCoordinator:
    """Maps recipe keys to jobs; ``submit`` starts a build or returns the running one."""

    def __init__(self, store: CacheStore, metrics: DaemonMetrics, logger: logging.Logger, *,
                 max_builds: int = 2, ensure_fn: EnsureFn = ensure_model,
                 job_key: Callable[[ModelRequest], str] | None = None) -> None:
        self.store = store
        self.metrics = metrics
        self.logger = logger
        self._ensure_fn = ensure_fn
        self._job_key = job_key or (lambda req: plan_model(req).recipe.key)
        self._pool = ThreadPoolExecutor(max_workers=max_builds, thread_name_prefix="cachectl-build")
        self._lock = threading.Lock()
        self._jobs: dict[str, Job] = {}

    def submit(self, request: ModelRequest) -> Job:
        recipe_key = self._job_key(request)  # raises BuildError for an unusable model dir
        with self._lock:
            job = self._jobs.get(recipe_key)
            if job is not None and job.status is JobStatus.BUILDING:
                self.metrics.ensure_requests.labels("joined_build").inc()
                return job
            job = Job(recipe_key, request)
            self._jobs[recipe_key] = job
            self._pool.submit(self._run, job)
            return job

    def _run(self, job: Job) -> None:
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
            with self._ensure_fn(self.store, job.request, on_phase=on_phase, on_wait=on_wait,
                                 on_progress=on_progress) as entry:
                job.key, job.path, job.built = entry.key, str(entry.path), entry.built
                job.total_bytes = job.done_bytes = entry.total_bytes
            outcome = "built" if job.built else "hit"
            if job.built:
                self.metrics.builds.labels("ok").inc()
                self.metrics.build_seconds.observe(time.monotonic() - start)
            self.metrics.ensure_requests.labels(outcome).inc()
            job.phase, job.status = "published", JobStatus.READY
            event(self.logger, "ensure_done", recipe=job.recipe_key, key=job.key,
                  outcome=outcome, seconds=round(time.monotonic() - start, 3))
        except Exception as e:  # every failure must reach the waiting clients
            job.reason = ("corrupt" if isinstance(e, EntryCorruptError) else
                          "timeout" if isinstance(e, LockTimeoutError) else
                          "cache_error" if isinstance(e, CacheError) else "error")
            job.error = str(e)
            job.phase, job.status = "failed", JobStatus.FAILED
            self.metrics.builds.labels(job.reason).inc()
            event(self.logger, "ensure_failed", logging.ERROR, recipe=job.recipe_key,
                  reason=job.reason, error=str(e))
        finally:
            job.future.set_result(None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
