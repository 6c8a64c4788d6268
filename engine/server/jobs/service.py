"""VideoJobs: the job layer the ``/v1/videos`` routes call - create, delete, and the
replica's part in the shared queue (its ``JobWorker``).

``create`` admits the job to the store (its bounds, in the store's transaction) and answers
at once: the job is queued for every replica sharing the store, and this replica's worker
is woken so that, if it has room, it claims the job itself without waiting for a poll. A job
asked without a seed gets one here, so a job re-run after its replica died makes the same
video. ``delete`` cancels an unfinished job (the replica running it aborts the engine
request: at once if it is this one, else at its next lease renewal) and forgets it.
``begin_drain`` stops claiming; ``busy`` says whether this replica still holds work.

Built by ServerState; called by videos/routes.py.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from typing import Any

from ditserve.engine.loop.client import EngineClient
from ditserve.engine.server.jobs.model import VideoSpec
from ditserve.engine.server.jobs.store import JobStore
from ditserve.engine.server.jobs.worker import ENCODE_THREADS, POLL_S, JobWorker

DEFAULT_LEASE_S = 30.0


class VideoJobs:
    """See the module docstring."""

    def __init__(self, engine: EngineClient, store: JobStore, *,
                 lease_s: float = DEFAULT_LEASE_S, poll_s: float = POLL_S,
                 encode_threads: int = ENCODE_THREADS) -> None:
        self.engine = engine
        self.store = store
        self.worker = JobWorker(engine, store, lease_s=lease_s, poll_s=poll_s,
                                encode_threads=encode_threads)
        self.worker.start()

    def create(self, spec: VideoSpec, *, request_id: str) -> dict[str, Any]:
        """Admit a job; raises NeverFits, StoreFull or StoreUnavailable. Returns its object
        as admitted (queued, as OpenAI answers)."""
        if spec.params.seed is None:
            spec = replace(spec, params=replace(spec.params, seed=secrets.randbits(63)))
        admitted = self.store.add(spec, request_id)
        self.worker.wake()
        return admitted

    def delete(self, job_id: str) -> bool:
        """Delete a job: an unfinished one is cancelled first (its batch slot frees at the
        next step), a finished one goes with its file. False: no such job."""
        existed, owner = self.store.delete(job_id)
        if owner == self.worker.owner:
            self.worker.let_go(job_id, "cancelled")
        return existed

    def begin_drain(self) -> None:
        self.worker.stop_claiming()

    def busy(self) -> bool:
        """Whether this replica holds a job (the drain waits for it)."""
        return self.worker.busy()

    def close(self) -> None:
        """After the engine stopped: finish the encodes under way, hand back what is left,
        release the store and the directory."""
        self.worker.close()
        self.store.close()
