"""JobWorker against a real SQLite job store and the fake engine: a job the engine dropped
is handed back and runs again at once, even when this replica's own thread claims it in the
instant the hand-back is written (the race that once left such a job claimed and idle until
its lease expired, then counted it twice)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from server.video_support import fake_video_engine

from ditserve.engine.request import SamplingParams
from ditserve.engine.server.jobs.files import VideoFiles
from ditserve.engine.server.jobs.model import JobStatus, StoreLimits, VideoSpec
from ditserve.engine.server.jobs.sqlite_backend import SqliteBackend
from ditserve.engine.server.jobs.store import JobStore
from ditserve.engine.server.jobs.worker import JobWorker

LEASE_S = 600.0  # no lease expires during the test: only a fresh claim can run the job again
WAIT_S = 20.0  # generous bound on a fake engine's few milliseconds of work


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_handed_back_job_claimed_at_once_by_its_own_replica_runs_again(tmp_path: Path
                                                                          ) -> None:
    engine = fake_video_engine(tmp_path, outcome="hang")
    store = JobStore(StoreLimits(), VideoFiles(tmp_path / "videos"),
                     SqliteBackend(tmp_path / "videos" / "jobs.sqlite3", clock=time.time))
    reclaimed = threading.Event()
    real_claim, real_hand_back = store.claim, store.hand_back

    def claim(owner: str, lease_s: float):
        job = real_claim(owner, lease_s)
        if job is not None and job.attempts == 1 and handed_back.is_set():
            reclaimed.set()
        return job

    handed_back = threading.Event()

    def hand_back(job_id: str, token: str) -> bool:
        engine.outcome = "finish"  # the next run of the job completes
        written = real_hand_back(job_id, token)
        handed_back.set()
        # Hold this thread between the store's write and whatever the worker does after
        # it, until the worker's own thread claimed the job again: the racy interleaving,
        # made certain.
        assert reclaimed.wait(WAIT_S), "the worker never claimed the handed-back job"
        return written

    store.claim, store.hand_back = claim, hand_back  # type: ignore[method-assign]
    worker = JobWorker(engine, store, lease_s=LEASE_S, poll_s=0.01)
    worker.start()
    try:
        params = SamplingParams(prompt="p", height=16, width=16, num_frames=5,
                                num_inference_steps=2, seed=3)
        job_id = store.add(VideoSpec(params=params, fps=8, model="m"), "req-1")["id"]
        # What a shutdown does to the requests left in the engine:
        wait_for(lambda: engine.abort(job_id, "engine shut down"), "the engine to hold it")
        wait_for(lambda: store.job(job_id).status.is_finished, "the job to finish")
        job = store.job(job_id)
        assert (job.status, job.attempts, job.error) == (JobStatus.COMPLETED, 1, None)
        assert len(engine.submitted) == 2  # the hand-back ran it again, not a lease expiry
    finally:
        worker.close()
        store.close()


def _one_slot_engine(tmp_path: Path):
    from dataclasses import replace

    engine = fake_video_engine(tmp_path, outcome="hang")
    engine.config = replace(engine.config, scheduler=replace(engine.config.scheduler,
                                                             max_num_seqs=1))
    return engine


def _looped(worker: JobWorker, turns: int) -> None:
    """Let the worker's loop look for room ``turns`` more times."""
    seen = []
    real = worker._has_room

    def counted() -> bool:
        seen.append(1)
        return real()

    worker._has_room = counted  # type: ignore[method-assign]
    wait_for(lambda: len(seen) >= turns, f"{turns} turns of the worker's loop")
    worker._has_room = real  # type: ignore[method-assign]


@pytest.mark.parametrize("shared", [True, False])
def test_a_replica_sharing_the_store_claims_no_job_it_has_no_slot_for(
        tmp_path: Path, request: pytest.FixtureRequest, shared: bool) -> None:
    """With replicas sharing a store, a job claimed beyond the free slots would wait behind
    a busy engine while another replica idles; alone on SQLite one job is claimed ahead."""
    params = SamplingParams(prompt="p", height=16, width=16, num_frames=5,
                            num_inference_steps=2, seed=3)
    engine = _one_slot_engine(tmp_path)
    videos = tmp_path / "videos"
    if shared:
        from ditserve.engine.server.jobs.redis_backend import RedisBackend

        backend: Any = RedisBackend(request.getfixturevalue("redis_server").url,
                                    namespace=f"prefetch-{tmp_path.name}")
    else:
        backend = SqliteBackend(videos / "jobs.sqlite3", clock=time.time)
    store = JobStore(StoreLimits(), VideoFiles(videos, shared=shared), backend)
    worker = JobWorker(engine, store, lease_s=LEASE_S, poll_s=0.01)
    worker.start()
    try:
        first, second = (store.add(VideoSpec(params=params, fps=8, model="m"), f"r{i}")["id"]
                         for i in range(2))
        wait_for(lambda: len(engine.submitted) >= 1, "the engine to run the first job")
        assert store.job(first).owner is not None
        _looped(worker, 10)
        assert (store.job(second).owner is not None) is (not shared)
        assert len(engine.submitted) == (1 if shared else 2)
    finally:
        worker.close()
        store.close()


def test_a_jobs_deadline_counts_from_its_creation_not_its_claim() -> None:
    from ditserve.engine.errors import DeadlineError
    from ditserve.engine.server.jobs.model import VideoJob

    params = SamplingParams(prompt="p", height=16, width=16, num_frames=5, deadline_s=15.0)
    job = VideoJob("video_x", VideoSpec(params=params, fps=8, model="m"), "r", created_at=100.0)
    assert job.params_at(110.0).deadline_s == 5.0  # 10 s were spent waiting in the queue
    assert job.params_at(90.0).deadline_s == 15.0  # another host's clock a little behind
    with pytest.raises(DeadlineError, match="waited 20.0 s in the queue, past its deadline_s 15"):
        job.params_at(120.0)
    no_deadline = VideoJob("video_y", VideoSpec(params=replace_deadline(params), fps=8,
                                                model="m"), "r", created_at=100.0)
    assert no_deadline.params_at(10_000.0).deadline_s is None


def replace_deadline(params: SamplingParams) -> SamplingParams:
    from dataclasses import replace

    return replace(params, deadline_s=None)
