"""Priorities and deadlines over HTTP: `priority` and `deadline_s` on image requests (JSON and
the OpenAI SDK's extra_body) and video jobs, their 400s, the deadline refusal (429
deadline_unmeetable), the scheduler's metrics, and the estimate in a video job's object."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ditserve.engine.request import SamplingParams
from ditserve.engine.server.jobs.files import VideoFiles
from ditserve.engine.server.jobs.model import VideoSpec
from ditserve.engine.server.jobs.sqlite_backend import SqliteBackend
from ditserve.engine.server.jobs.store import JobStore, StoreLimits

GEN = "/v1/images/generations"


@pytest.fixture(scope="module")
def prio_server(tmp_path_factory, launch_server) -> Iterator[object]:  # type: ignore[no-untyped-def]
    server = launch_server(tmp_path_factory.mktemp("prio"), "--scheduling-policy", "priority",
                           "--max-num-seqs", "2", "--priority-aging-s", "10")
    yield server
    server.stop()


def test_priority_and_deadline_are_accepted_and_checked(prio_server) -> None:  # type: ignore[no-untyped-def]
    url = prio_server.url
    ok = httpx.post(url + GEN, json={"prompt": "a fox", "num_inference_steps": 2,
                                     "priority": -3, "deadline_s": 600}, timeout=120)
    assert ok.status_code == 200, ok.text
    for body, param in (({"priority": "high"}, "priority"), ({"priority": 1.5}, "priority"),
                        ({"priority": 2**40}, "priority"), ({"deadline_s": -1}, "deadline_s"),
                        ({"deadline_s": 0}, "deadline_s"), ({"deadline_s": "soon"}, "deadline_s")):
        bad = httpx.post(url + GEN, json={"prompt": "x", **body}, timeout=30)
        assert bad.status_code == 400, (body, bad.text)
        assert bad.json()["error"]["param"] == param


def test_the_openai_sdk_sends_them_in_extra_body(prio_server) -> None:  # type: ignore[no-untyped-def]
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=prio_server.url + "/v1", api_key="none")
    answer = client.images.generate(prompt="a red fox", size="64x64",
                                    extra_body={"priority": -1, "deadline_s": 300.0,
                                                "num_inference_steps": 2})
    assert answer.data[0].b64_json


def test_a_deadline_the_replica_cannot_meet_is_refused_at_once(prio_server, metric) -> None:  # type: ignore[no-untyped-def]
    url = prio_server.url
    for _ in range(2):  # the scheduler measures step times from busy steps
        assert httpx.post(url + GEN, json={"prompt": "warm", "num_inference_steps": 4},
                          timeout=120).status_code == 200
    refused = httpx.post(url + GEN, json={"prompt": "x", "num_inference_steps": 10,
                                          "deadline_s": 0.000001}, timeout=30)
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["code"] == "deadline_unmeetable"
    assert "deadline_s=1e-06 cannot be met" in error["message"]
    text = httpx.get(url + "/metrics", timeout=30).text
    assert metric(text, "ditserve:scheduler_step_seconds_estimate") > 0
    assert metric(text, 'ditserve:request_errors_total{reason="deadline"}') >= 1
    for name in ("ditserve:num_preemptions_total", "ditserve:request_paused_seconds_count",
                 "ditserve:num_requests_paused", "ditserve:num_requests_waiting_high_priority",
                 "ditserve:deadline_exceeded_total"):
        assert metric(text, name) >= 0


def test_the_openai_sdk_does_not_retry_a_missed_deadline(prio_server, metric) -> None:  # type: ignore[no-untyped-def]
    """Issue 45: the SDK retried 429 deadline_unmeetable (and 408 deadline_exceeded) after
    Retry-After, each retry with a fresh deadline: the answer came after the deadline."""
    import openai

    url = prio_server.url
    for _ in range(2):  # the scheduler measures step times from busy steps
        assert httpx.post(url + GEN, json={"prompt": "warm", "num_inference_steps": 4},
                          timeout=120).status_code == 200
    deadline = 'ditserve:request_errors_total{reason="deadline"}'
    before = metric(httpx.get(url + "/metrics", timeout=30).text, deadline)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=2, timeout=60)
    with pytest.raises(openai.RateLimitError) as refused:
        client.images.generate(prompt="x", extra_body={"num_inference_steps": 10,
                                                       "deadline_s": 0.000001})
    assert refused.value.response.headers["x-should-retry"] == "false"
    assert "retry-after" not in refused.value.response.headers
    after = metric(httpx.get(url + "/metrics", timeout=30).text, deadline)
    assert after - before == 1  # one try, not three


def test_a_video_job_object_shows_its_priority_deadline_and_estimate(tmp_path: Path) -> None:
    store = JobStore(StoreLimits(), VideoFiles(tmp_path / "videos"),
                     SqliteBackend(tmp_path / "videos" / "jobs.sqlite3", clock=time.time))
    params = SamplingParams(prompt="p", height=16, width=16, num_frames=5,
                            num_inference_steps=10, priority=-1, deadline_s=90.0)
    job_id = store.add(VideoSpec(params=params, fps=8, model="m"), "rid")["id"]
    queued = store.get(job_id)
    assert queued is not None
    assert queued["ditserve"]["priority"] == -1 and queued["ditserve"]["deadline_s"] == 90.0
    assert queued["ditserve"]["estimated_seconds_left"] is None
    claimed = store.claim("replica", 30)
    assert claimed is not None and claimed.token is not None
    store.started(job_id, claimed.token, seed=1)
    store.stepped(job_id, claimed.token, 3, eta_s=4.2)
    running = store.get(job_id)
    assert running is not None and running["ditserve"]["estimated_seconds_left"] == 4.2
    store.close()
