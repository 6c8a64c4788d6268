"""Several replicas as one service, as real processes: three `ditserve serve` on the tiny
Wan model share one real redis-server (the job store) and one video directory (the shared
volume). Jobs are created on one replica and polled and downloaded on others chosen at
random; a replica killed with SIGKILL mid-job has its job run again elsewhere once its lease
expires; a replica drained by SIGTERM hands its job back to another; a Redis that stops
answering makes new jobs and polls 503 with Retry-After while the running ones finish. And one replica on its default SQLite store, killed mid-job and restarted:
finished jobs stay downloadable, the interrupted one runs again.

Small and bounded: one batch slot per replica, 32x32 clips of 5 frames, a 3 s lease."""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server.conftest import ServerProcess, free_port, start_server
from server.redis_support import RedisServer
from server.video_support import mp4_facts

pytestmark = pytest.mark.slow  # four server processes, one restarted

LEASE_S = 3.0
TIMEOUT_S = 120.0
JOB = {"prompt": "waves", "size": "32x32", "num_frames": 5, "num_inference_steps": 2}
# A job long enough to be caught mid-way (tiny Wan steps take milliseconds).
LONG = {**JOB, "num_inference_steps": 400}
FLAGS = ("--max-num-seqs", "1", "--max-side", "64", "--max-steps", "400", "--max-frames", "9",
         "--served-model-name", "tiny-wan", "--job-lease", str(LEASE_S),
         "--shutdown-grace", "1")


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("replicas-redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory, tiny_wan: Path,
             redis: RedisServer) -> Iterator[list[ServerProcess]]:
    shared = tmp_path_factory.mktemp("shared-videos")
    started = [start_server(tmp_path_factory.mktemp(f"replica{i}"), "--model", str(tiny_wan),
                            *FLAGS, "--video-dir", str(shared), "--job-store", redis.url,
                            wait=False) for i in range(3)]
    try:
        for server in started:
            server.wait_ready()
        yield started
    finally:
        for server in started:
            server.stop()


def create(server: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{server.url}/v1/videos", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def until(servers: list[ServerProcess], video_id: str, done: Any) -> dict[str, Any]:
    """Poll the job on a replica chosen at random each time until ``done(job)``."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        live = [s for s in servers if s.process.poll() is None]
        response = httpx.get(f"{random.choice(live).url}/v1/videos/{video_id}", timeout=30)
        assert response.status_code == 200, response.text  # never a 404
        job = response.json()
        if done(job):
            return job
        time.sleep(0.05)  # another process: poll it
    raise AssertionError(f"{video_id} not done after {TIMEOUT_S}s")


def finished(job: dict[str, Any]) -> bool:
    return job["status"] in ("completed", "failed")


def test_any_replica_answers_for_any_job(replicas) -> None:
    jobs = [create(random.choice(replicas), {**JOB, "seed": i}) for i in range(9)]
    for job in jobs:
        done = until(replicas, job["id"], finished)
        assert (done["status"], done["ditserve"]["attempts"]) == ("completed", 1)
        video = httpx.get(f"{random.choice(replicas).url}/v1/videos/{job['id']}/content")
        assert video.status_code == 200
        assert mp4_facts(video.content)["frames"] == 5
    listed = httpx.get(f"{replicas[0].url}/v1/videos", params={"limit": 100}).json()["data"]
    assert {j["id"] for j in jobs} <= {j["id"] for j in listed}
    deleted = httpx.delete(f"{replicas[1].url}/v1/videos/{jobs[0]['id']}")
    assert deleted.json()["deleted"] is True
    gone = httpx.get(f"{replicas[2].url}/v1/videos/{jobs[0]['id']}")
    assert gone.status_code == 404


def test_events_follow_a_job_another_replica_runs(replicas) -> None:
    job = create(replicas[0], {**JOB, "num_inference_steps": 40})
    with httpx.stream("GET", f"{replicas[1].url}/v1/videos/{job['id']}/events",
                      timeout=TIMEOUT_S) as response:
        body = "".join(response.iter_text())
    assert "event: video.completed" in body


def test_a_stopped_redis_refuses_new_jobs_and_running_ones_finish(replicas, redis) -> None:
    job = create(replicas[0], {**LONG, "num_inference_steps": 150})
    until(replicas, job["id"], lambda j: j["status"] == "in_progress")
    redis.pause()
    try:
        refused = httpx.post(f"{replicas[1].url}/v1/videos", json=JOB, timeout=30)
        assert refused.status_code == 503 and "retry-after" in refused.headers
        assert refused.json()["error"]["code"] == "job_store_unavailable"
        poll = httpx.get(f"{replicas[2].url}/v1/videos/{job['id']}", timeout=30)
        assert poll.status_code == 503 and "retry-after" in poll.headers
        metrics = httpx.get(f"{replicas[2].url}/metrics", timeout=30).text
        assert "ditserve:job_store_up 0.0" in metrics
    finally:
        redis.resume()
    done = until(replicas, job["id"], finished)
    assert done["status"] == "completed"  # its replica ran on, and wrote it once back


def test_a_killed_replicas_job_completes_elsewhere(replicas) -> None:
    job = create(replicas[0], LONG)
    running = until(replicas, job["id"], lambda j: j["status"] == "in_progress")
    owner = running["ditserve"]["replica"]
    victim = next(s for s in replicas if f"-{s.process.pid}-" in owner)
    victim.process.send_signal(signal.SIGKILL)
    victim.process.wait()
    survivors = [s for s in replicas if s is not victim]
    done = until(survivors, job["id"], finished)
    assert (done["status"], done["ditserve"]["attempts"]) == ("completed", 2)
    video = httpx.get(f"{survivors[0].url}/v1/videos/{job['id']}/content")
    assert mp4_facts(video.content)["frames"] == 5


def test_a_draining_replica_hands_its_job_back(replicas) -> None:
    """SIGTERM (a rollout, a scale-down) of the replica running a job longer than its 1 s
    grace: it claims nothing more, hands the job back when the grace ends and exits 0; a
    replica still serving runs it (a hand-back is no attempt: attempts stays 1)."""
    live = [s for s in replicas if s.process.poll() is None]
    job = create(live[0], LONG)
    running = until(live, job["id"], lambda j: j["status"] == "in_progress")
    holder = next(s for s in live if f"-{s.process.pid}-" in running["ditserve"]["replica"])
    assert holder.stop() == 0
    others = [s for s in live if s is not holder]
    done = until(others, job["id"], finished)
    assert (done["status"], done["ditserve"]["attempts"]) == ("completed", 1)


def test_one_replica_on_sqlite_survives_a_restart(tmp_path: Path, tiny_wan: Path) -> None:
    videos = tmp_path / "videos"
    port = free_port()
    flags = ("--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
             "--video-dir", str(videos))
    first = start_server(tmp_path / "first", "--model", str(tiny_wan), *FLAGS, *flags,
                         port=port)
    try:
        done = create(first, JOB)
        until([first], done["id"], finished)
        interrupted = create(first, LONG)
        until([first], interrupted["id"], lambda j: j["status"] == "in_progress")
        first.process.send_signal(signal.SIGKILL)
        first.process.wait()
    finally:
        first.stop()
    second = start_server(tmp_path / "second", "--model", str(tiny_wan), *FLAGS, *flags,
                          port=port)
    try:
        content = httpx.get(f"{second.url}/v1/videos/{done['id']}/content")
        assert content.status_code == 200 and mp4_facts(content.content)["frames"] == 5
        rerun = until([second], interrupted["id"], finished)
        assert (rerun["status"], rerun["ditserve"]["attempts"]) == ("completed", 2)
    finally:
        second.stop()
