"""Video jobs on the real engine and the tiny Wan model, in-process: the lifecycle (queued ->
in_progress with growing progress -> completed), an MP4 with the asked frames, size and fps,
concurrent jobs sharing denoise steps, and a cancel that frees the batch slot at the very
next step. One engine (max_num_seqs 2) for the module; jobs are followed through the store's
listeners, which the engine's loop thread calls in step order."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server.video_support import finish, mp4_facts, run

from ditserve.engine.config import EngineConfig, SchedulerConfig
from ditserve.engine.loop.engine import DiffusionEngine
from ditserve.engine.server.app import create_app
from ditserve.engine.server.config import ServerConfig
from ditserve.engine.server.metrics import ServingMetrics
from ditserve.engine.server.videos.request import parse_video_request

TIMEOUT_S = 120


@pytest.fixture(scope="module")
def served(tiny_wan: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    engine: DiffusionEngine
    metrics = ServingMetrics(lambda: engine)
    config = EngineConfig(model=str(tiny_wan), device="cpu",
                          scheduler=SchedulerConfig(max_num_seqs=2, max_queue=8))
    engine = DiffusionEngine(config, observers=[metrics]).start()
    server = ServerConfig(video_dir=str(tmp_path_factory.mktemp("videos")))
    app = create_app(engine, server, start_engine=False, serving_metrics=metrics)
    yield app
    app.state.server.stop()


class Log:
    """Every change of the jobs it follows, in the order they happened, with the number of
    denoise forwards run by then (the engine counts a forward before it reports the steps of
    its requests, so a step's change carries the forward that ran it)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.store = app.state.server.videos.store
        self.changes: list[tuple[str, str, int]] = []  # (name, status, steps done)
        self.forward: dict[tuple[str, int], float] = {}  # (name, step) -> forward number
        self.lock = threading.Lock()
        self.done: dict[str, threading.Event] = {}

    def follow(self, name: str, job: dict[str, Any], then: Any = None) -> None:
        self.done[name] = threading.Event()

        def listen(video: dict[str, Any]) -> None:
            steps = video["ditserve"]["steps_done"]
            with self.lock:
                self.changes.append((name, video["status"], steps))
                if video["status"] == "in_progress":
                    self.forward.setdefault((name, steps), forwards(self.app)[0])
            if then is not None:
                then(video)
            if video["status"] in ("completed", "failed"):
                self.done[name].set()

        current = self.store.subscribe(job["id"], listen)
        assert current is not None
        listen(current)

    def wait(self) -> None:
        for name, event in self.done.items():
            assert event.wait(TIMEOUT_S), f"{name} did not finish"

    def of(self, name: str) -> list[tuple[str, int]]:
        return [(status, steps) for who, status, steps in self.changes if who == name]


def create(app: Any, **fields: Any) -> dict[str, Any]:
    state = app.state.server
    body = {"prompt": "waves on a beach", "size": "48x32", "num_frames": 9, "seed": 3,
            "num_inference_steps": 4, **fields}
    spec = parse_video_request(body, engine=state.engine, limits=state.video_limits())
    job: dict[str, Any] = state.videos.create(spec, request_id="test")
    return job


def forwards(app: Any) -> tuple[float, float]:
    """(denoise forwards run, requests summed over them) so far."""
    text = app.state.server.metrics.render().decode()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines()
                  if line.startswith("ditserve:step_batch_size_"))
    return float(values["ditserve:step_batch_size_count"]), float(
        values["ditserve:step_batch_size_sum"])


def test_lifecycle_and_the_mp4(served) -> None:
    log = Log(served)
    blockers = [create(served, num_inference_steps=4, seed=i) for i in range(2)]  # both slots
    job = create(served, num_inference_steps=6, num_frames=9, size="48x32", fps=12)
    assert (job["status"], job["progress"]) == ("queued", 0)
    log.follow("job", job)
    for i, blocker in enumerate(blockers):
        log.follow(f"blocker{i}", blocker)
    log.wait()
    seen = log.of("job")
    assert seen[0] == ("queued", 0)
    assert [steps for status, steps in seen if status == "in_progress"] == [1, 2, 3, 4, 5, 6]
    assert seen[-1] == ("completed", 6)

    async def download(client):
        events = await finish(client, job["id"])  # a finished job: its last event at once
        return events, await client.get(f"/v1/videos/{job['id']}/content")

    events, content = run(served, download, close=False)
    final = events[-1][1]["video"]
    assert (final["status"], final["progress"], final["seconds"]) == ("completed", 100, "0.75")
    facts = mp4_facts(content.content)
    assert (facts["frames"], facts["width"], facts["height"], facts["fps"]) == (9, 48, 32, 12.0)
    assert facts["codec"] == "h264"


def test_concurrent_jobs_share_steps_and_a_cancel_frees_the_slot_at_once(served) -> None:
    """A and B run together; C waits for a slot. A cancels itself after its second step:
    C runs in the very next forward, beside B."""
    videos = served.state.server.videos
    log = Log(served)
    before = forwards(served)
    a = create(served, num_inference_steps=8, seed=1)
    b = create(served, num_inference_steps=8, seed=2)
    c = create(served, num_inference_steps=4, seed=3)
    cancelled = threading.Event()

    def cancel_after_two(video: dict[str, Any]) -> None:
        # Called from the engine's loop thread after A's step 2, before it plans step 3.
        if video["ditserve"]["steps_done"] == 2 and not cancelled.is_set():
            cancelled.set()
            assert videos.delete(a["id"])

    log.follow("A", a, then=cancel_after_two)
    log.follow("B", b)
    log.follow("C", c)
    log.wait()
    assert log.of("A")[-1] == ("failed", 2)  # cancelled: it never ran step 3
    assert log.of("B")[-1] == ("completed", 8) and log.of("C")[-1] == ("completed", 4)
    # The forward right after A's last one holds C's first step.
    assert log.forward[("C", 1)] == log.forward[("A", 2)] + 1
    runs, rows = (x - y for x, y in zip(forwards(served), before, strict=True))
    assert rows == 2 + 8 + 4  # every step of every job ran once...
    assert runs < rows  # ...in fewer forwards: jobs shared them (B with A, then with C)


def test_delete_removes_the_file(served) -> None:
    job = create(served, num_inference_steps=2)
    files = served.state.server.videos.store.files
    log = Log(served)
    log.follow("job", job)
    log.wait()
    path = files.path_of(job["id"])
    assert path.is_file()

    async def delete(client):
        return (await client.delete(f"/v1/videos/{job['id']}"),
                await client.get(f"/v1/videos/{job['id']}/content"))

    deleted, content = run(served, delete, close=False)
    assert deleted.json()["deleted"] is True
    assert content.status_code == 404
    assert not path.exists()
