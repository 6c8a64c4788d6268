"""The node daemon: one build per node, long-polling ensure, entry status, scrub, metrics;
in-process through the ASGI app, and as a real process on a Unix socket."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from cachectl_support import make_identity, synthetic_tensors
from fastapi.testclient import TestClient

from ditserve.cachectl.client import DaemonClient
from ditserve.cachectl.daemon import Daemon, DaemonConfig, create_app
from ditserve.cachectl.entry import Entry
from ditserve.cachectl.hashing import RateLimiter
from ditserve.cachectl.model_build import ModelRequest
from ditserve.cachectl.store import CacheStore


class FakeBuilder:
    """Stands in for the engine loader: blocks until released, counts builds."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def __call__(self, store: CacheStore, request: ModelRequest, *, on_phase: Any,
                 on_wait: Any, on_progress: Any) -> Entry:
        def build() -> dict[str, Any]:
            self.calls += 1
            on_phase("loading model")
            assert self.release.wait(30), "test never released the build"
            return synthetic_tensors()

        return store.ensure(make_identity(dtype=request.dtype), build, on_progress=on_progress)


@pytest.fixture
def daemon(tmp_path: Path) -> Any:
    builder = FakeBuilder()
    config = DaemonConfig(root=tmp_path / "cache", socket_path=tmp_path / "s.sock",
                          scrub_interval_s=0)
    d = Daemon(config, logging.getLogger("test.cachectl"), ensure_fn=builder,
               job_key=lambda req: f"{req.model_dir}|{req.dtype}")
    d.fake = builder
    yield d
    builder.release.set()
    d.stop()


def test_concurrent_callers_share_one_build(daemon: Any, tmp_path: Path) -> None:
    body = {"model": str(tmp_path), "dtype": "float32"}
    with TestClient(create_app(daemon)) as client:
        first = client.post("/v1/ensure", json=body)
        assert first.status_code == 202 and first.json()["status"] == "building"
        with ThreadPoolExecutor(4) as pool:
            waiting = [pool.submit(client.post, "/v1/ensure", json={**body, "wait_s": 30})
                       for _ in range(4)]
            daemon.fake.release.set()
            answers = [f.result() for f in waiting]
        assert {a.status_code for a in answers} == {200}
        assert len({a.json()["key"] for a in answers}) == 1
        assert daemon.fake.calls == 1

        key = answers[0].json()["key"]
        entry = client.get(f"/v1/entries/{key}")
        assert entry.status_code == 200 and entry.json()["status"] == "ready"
        assert client.get(f"/v1/entries/{'0' * 64}").status_code == 404
        assert client.get("/v1/entries/not-a-key").status_code == 400

        metrics = client.get("/metrics").text
        assert 'cachectl_builds_total{result="ok"} 1.0' in metrics
        assert "cachectl_entries 1.0" in metrics
        assert 'cachectl_ensure_requests_total{outcome="built"} 1.0' in metrics


def test_bad_requests_are_answered_not_built(daemon: Any, tmp_path: Path) -> None:
    with TestClient(create_app(daemon)) as client:
        missing = client.post("/v1/ensure", json={"model": str(tmp_path / "nope")})
        assert missing.status_code == 400 and "does not exist" in missing.json()["error"]
        assert client.post("/v1/ensure", json={"model": str(tmp_path),
                                               "dtype": "int8"}).status_code == 422
        assert client.get("/healthz").json()["status"] == "ok"
    assert daemon.fake.calls == 0


def test_scrub_reports_corruption_without_touching_the_entry(daemon: Any) -> None:
    store: CacheStore = daemon.store
    with store.publish(make_identity(), synthetic_tensors()) as e:
        shard = e.files()[0]
    shard.chmod(0o644)
    shard.write_bytes(shard.read_bytes()[:-1] + b"\x00")
    reports = daemon.scrubber.scrub_once()
    assert [r.ok for r in reports] == [False]
    assert daemon.metrics.verify_failures._value.get() == 1
    assert shard.exists()


def test_rate_limiter_paces_reads() -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    limiter = RateLimiter(100.0, clock=lambda: now[0], sleep=sleep)
    for _ in range(3):
        limiter.acquire(50)  # 50 bytes at 100 B/s: each later chunk waits 0.5 s
    assert slept == [0.5, 0.5]


def test_serve_as_a_real_process_with_ensure_through_the_socket(
    tiny_model: Path, tmp_path: Path,
) -> None:
    root, sock = tmp_path / "cache", tmp_path / "run" / "cachectl.sock"
    cli = [sys.executable, "-m", "ditserve.cachectl.cli"]
    daemon = subprocess.Popen([*cli, "serve", "--root", str(root), "--socket", str(sock),
                               "--tcp", "127.0.0.1:0", "--metrics-port", "0",
                               "--scrub-interval", "0"], stderr=subprocess.PIPE, text=True)
    try:
        assert daemon.stderr is not None
        started = json.loads(daemon.stderr.readline())  # the sockets listen once this is logged
        assert started["event"] == "daemon_started"
        host, port = started["tcp"].rsplit(":", 1)

        ensure = [*cli, "ensure", "--root", str(root), "--socket", str(sock),
                  "--model", str(tiny_model), "--dtype", "float32", "--json"]
        first = subprocess.run(ensure, capture_output=True, text=True, timeout=120)
        assert first.returncode == 0, first.stderr
        result = json.loads(first.stdout)
        assert result["via"] == "daemon" and result["built"] and result["status"] == "ready"
        second = json.loads(subprocess.run(ensure, capture_output=True, text=True,
                                           timeout=60).stdout)
        assert second["key"] == result["key"] and not second["built"]

        client = DaemonClient(sock)
        status, entry = client.entry(result["key"])
        assert status == 200 and entry["identity"]["dtype"] == "float32"
        with CacheStore(root).join(result["key"]) as e:
            assert e.manifest.total_bytes > 0
        status, _ = client.request("GET", "/healthz")
        assert status == 200
        # The same API on TCP, and Prometheus on the metrics port.
        with urllib.request.urlopen(f"http://{host}:{port}/v1/entries/{result['key']}") as r:
            assert json.loads(r.read())["status"] == "ready"
        metrics_url = f"http://127.0.0.1:{started['metrics_port']}/metrics"
        with urllib.request.urlopen(metrics_url) as r:
            text = r.read().decode()
        assert 'cachectl_builds_total{result="ok"} 1.0' in text
        assert 'cachectl_ensure_requests_total{outcome="hit"} 1.0' in text
    finally:
        daemon.send_signal(signal.SIGTERM)
        rc = daemon.wait(timeout=30)
    logs = [json.loads(line) for line in daemon.stderr.read().splitlines() if line.startswith("{")]
    assert rc == 0 and not sock.exists()
    assert {"ensure_done", "daemon_stopped"} <= {entry["event"] for entry in logs}
