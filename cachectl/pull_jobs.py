"""One download per node: the daemon's pull jobs.

Concurrent ``POST /v1/pull`` requests for the same source URI share one ``PullJob`` (one
download thread); the key's flock still serializes pulls outside the daemon (a
``--no-daemon`` pull). A job reports its phase and bytes on disk against the snapshot's size,
which the daemon answers to long-polling clients and the node status puts into the node's
``NodeCache`` (``status.models``). A failed job keeps its reason (``NotFound``,
``Unauthorized``, ``DigestMismatch``, ``DiskFull`` ...) until a new request retries it; a
ready job answers only the requests of the next half minute (``READY_ANSWER_S``).
Credentials arrive with the request and live only in the job's request object (never in
logs, snapshots or the node status). Called by the daemon's HTTP handlers.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ditserve.cachectl.errors import (
    CacheError,
    EntryCorruptError,
    InsufficientSpaceError,
    LockTimeoutError,
    ModelSourceError,
    PullCancelledError,
)
from ditserve.cachectl.logs import event
from ditserve.cachectl.model_uri import parse_model_uri
from ditserve.cachectl.pulls import PullRequest, pull
from ditserve.cachectl.store import CacheStore

# A ready job answers a new request for its URI this long after it finished: a client's
# long poll that ended just before the job did asks again at once. Later requests resolve
# the URI again (metadata only; the entry is joined, not downloaded).
READY_ANSWER_S = 30.0


class PullStatus(str, enum.Enum):
    DOWNLOADING = "downloading"
    READY = "ready"
    FAILED = "failed"


def failure_reason(e: BaseException) -> str:
    """The short reason a failed pull reports (the operator's condition message starts with
    it; the CLI maps it back to an error class)."""
    if isinstance(e, ModelSourceError):
        return e.reason
    if isinstance(e, InsufficientSpaceError):
        return "DiskFull"
    if isinstance(e, EntryCorruptError):
        return "corrupt"
    if isinstance(e, LockTimeoutError):
        return "timeout"
    return "cache_error" if isinstance(e, CacheError) else "error"


@dataclass
class PullJob:
    uri: str
    request: PullRequest
    status: PullStatus = PullStatus.DOWNLOADING
    phase: str = "queued"
    key: str | None = None
    path: str | None = None  # the entry; model_dir is its model/ folder
    revision: str | None = None  # the commit a hub revision resolved to
    model_dir: str | None = None
    done_bytes: int = 0
    total_bytes: int = 0
    downloaded: bool = False
    error: str | None = None
    reason: str | None = None
    started_at: float = field(default_factory=time.time)
    finished_at: float = 0.0  # time.monotonic()
    future: Future[None] = field(default_factory=Future)

    def snapshot(self) -> dict[str, Any]:
        # The fields of a local pull's answer (``PulledModel.to_json``) and the job's own.
        return {"status": self.status.value, "uri": self.uri, "key": self.key,
                "path": self.path, "model_dir": self.model_dir, "revision": self.revision,
                "bytes": self.total_bytes if self.status is PullStatus.READY else None,
                "phase": self.phase, "downloaded": self.downloaded,
                "progress": {"done_bytes": self.done_bytes, "total_bytes": self.total_bytes},
                "error": self.error, "reason": self.reason}

    def answers_again(self, request: PullRequest) -> bool:
        """Whether a finished job answers a new request for its URI as it is: only a ready
        one, just finished (the client that polled across its end), asked with the same
        credentials, whose folder is still there. Otherwise the URI is resolved afresh: a
        branch may have moved, and a request's own token must be the one that is checked."""
        return (self.status is PullStatus.READY
                and time.monotonic() - self.finished_at <= READY_ANSWER_S
                and request.credentials == self.request.credentials
                and bool(self.model_dir) and Path(str(self.model_dir)).is_dir())

    def finish(self, status: PullStatus, phase: str) -> None:
        self.finished_at = time.monotonic()
        self.status, self.phase = status, phase
        if not self.future.done():
            self.future.set_result(None)


class PullCoordinator:
    """Maps source URIs to pull jobs; ``submit`` joins the running pull or starts one."""

    def __init__(self, store: CacheStore, logger: logging.Logger, *, max_pulls: int = 2) -> None:
        self.store = store
        self.logger = logger
        self._pool = ThreadPoolExecutor(max_workers=max_pulls, thread_name_prefix="cachectl-pull")
        self._lock = threading.Lock()
        self._jobs: dict[str, PullJob] = {}
        self._stopping = False
        self._cancel = threading.Event()  # set by stop(): running downloads end at a chunk

    def jobs(self) -> list[PullJob]:
        with self._lock:
            return list(self._jobs.values())

    def submit(self, request: PullRequest) -> PullJob:
        uri = str(parse_model_uri(request.uri))  # UsageError for a malformed URI
        with self._lock:
            job = self._jobs.get(uri)
            if job is not None and (job.status is PullStatus.DOWNLOADING
                                    or job.answers_again(request)):
                return job
            if self._stopping:
                raise CacheError("the daemon is stopping; retry, or pull with --no-daemon")
            job = PullJob(uri, request)
            self._jobs[uri] = job
            self._pool.submit(self._run, job)
            return job

    def _run(self, job: PullJob) -> None:
        start = time.monotonic()

        def on_phase(p: str) -> None:
            job.phase = p
            event(self.logger, "pull_phase", uri=job.uri, phase=p)

        def on_progress(done: int, total: int) -> None:
            job.done_bytes, job.total_bytes = done, total

        def on_wait(waited: float) -> None:
            job.phase = f"waiting for another pull ({waited:.0f}s)"

        try:
            model = pull(self.store.root, job.request, on_phase=on_phase,
                         on_progress=on_progress, on_wait=on_wait, cancel=self._cancel)
            job.key, job.model_dir, job.downloaded = model.key, str(model.model_dir), model.downloaded
            job.path, job.revision = str(model.path), model.revision
            job.done_bytes = job.total_bytes = model.total_bytes
            event(self.logger, "pull_done", uri=job.uri, key=model.key,
                  downloaded=model.downloaded, bytes=model.total_bytes,
                  seconds=round(time.monotonic() - start, 3))
            job.finish(PullStatus.READY, "published")
        except PullCancelledError as e:  # the daemon is stopping: not the source's failure
            job.reason, job.error = "cancelled", str(e)
            event(self.logger, "pull_stopped", uri=job.uri)
            job.finish(PullStatus.FAILED, "stopped")
        except Exception as e:  # every failure must reach the waiting clients
            job.reason, job.error = failure_reason(e), str(e)
            event(self.logger, "pull_failed", logging.ERROR, uri=job.uri, reason=job.reason,
                  error=str(e))
            job.finish(PullStatus.FAILED, "failed")

    def stop(self) -> None:
        """Take no new pulls; running downloads stop at their next chunk and release their
        locks (their partial folders stay, and the next pull resumes them)."""
        with self._lock:
            self._stopping = True
        self._cancel.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
