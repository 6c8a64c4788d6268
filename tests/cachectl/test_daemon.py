"""The node daemon: one build per node, ready entries answered ready, JSON errors, scrub,
metrics; in-process through the ASGI app, and as a real process on a Unix socket (SIGTERM
with a running build, a daemon killed under `cachectl ensure`, where metrics bind)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from cachectl_support import (
    LIGHT_LOADER,
    cachectl_argv,
    light_env,
    make_identity,
    make_light_model,
    synthetic_tensors,
)
from fastapi.testclient import TestClient

from ditserve.cachectl.client import DaemonClient
from ditserve.cachectl.daemon import Daemon, DaemonConfig, create_app
from ditserve.cachectl.hashing import RateLimiter
from ditserve.cachectl.model_build import ModelLoader
from ditserve.cachectl.store import CacheStore


def _daemon(tmp_path: Path, loader: ModelLoader = LIGHT_LOADER) -> Daemon:
    config = DaemonConfig(root=tmp_path / "cache", socket_path=tmp_path / "s.sock",
                          scrub_interval_s=0, grace_s=30)
    return Daemon(config, logging.getLogger("test.cachectl"), loader)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = _daemon(tmp_path)
    yield d
    for model in tmp_path.glob("*model*"):
        (model / "release").touch()
    d.stop()


def _builds(model: Path) -> int:
    return len(list(model.glob("started.*")))


def _wait_for(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + 60
    while not predicate():  # polls a file or a process: an event, not a duration
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_concurrent_callers_share_one_build(daemon: Daemon, tmp_path: Path) -> None:
    model = make_light_model(tmp_path / "model")
    (model / "hold").touch()
    body = {"model": str(model), "dtype": "float32"}
    with TestClient(create_app(daemon)) as client:
        first = client.post("/v1/ensure", json=body)
        assert first.status_code == 202 and first.json()["status"] == "building"
        with ThreadPoolExecutor(4) as pool:
            waiting = [pool.submit(client.post, "/v1/ensure", json={**body, "wait_s": 30})
                       for _ in range(4)]
            _wait_for(lambda: _builds(model) == 1, "the build to start")
            (model / "release").touch()
            answers = [f.result() for f in waiting]
        assert {a.status_code for a in answers} == {200}
        assert len({a.json()["key"] for a in answers}) == 1
        assert _builds(model) == 1

        key = answers[0].json()["key"]
        entry = client.get(f"/v1/entries/{key}")
        assert entry.status_code == 200 and entry.json()["status"] == "ready"
        assert client.get(f"/v1/entries/{'0' * 64}").status_code == 404
        assert client.get("/v1/entries/not-a-key").status_code == 400

        metrics = client.get("/metrics").text
        assert 'cachectl_builds_total{result="ok"} 1.0' in metrics
        assert "cachectl_entries 1.0" in metrics
        assert 'cachectl_ensure_requests_total{outcome="built"} 1.0' in metrics


def test_a_ready_entry_is_answered_ready_without_waiting(daemon: Daemon, tmp_path: Path) -> None:
    model = make_light_model(tmp_path / "model")
    body = {"model": str(model), "dtype": "float32", "wait_s": 30}
    with TestClient(create_app(daemon)) as client:
        built = client.post("/v1/ensure", json=body)
        assert built.status_code == 200 and built.json()["built"]
        polls = [client.post("/v1/ensure", json={**body, "wait_s": 0}) for _ in range(5)]
        assert [p.status_code for p in polls] == [200] * 5
        assert {p.json()["key"] for p in polls} == {built.json()["key"]}
        metrics = client.get("/metrics").text
        assert 'cachectl_builds_total{result="ok"} 1.0' in metrics
        assert 'cachectl_ensure_requests_total{outcome="hit"} 5.0' in metrics
    # A restarted daemon knows no jobs: the stamped entry is still ready on the first poll.
    again = _daemon(tmp_path)
    try:
        with TestClient(create_app(again)) as client:
            first = client.post("/v1/ensure", json={**body, "wait_s": 0})
            assert first.status_code == 200 and first.json()["key"] == built.json()["key"]
    finally:
        again.stop()


def test_bad_requests_are_answered_in_json_not_built(tmp_path: Path) -> None:
    def broken_files(model_dir: Path, component: str) -> list[Any]:
        return [42]  # not a path: a bug in a loader, not a user error

    broken = ModelLoader(name="tests.broken", version="1", source_files=broken_files,
                         load=LIGHT_LOADER.load)
    d = _daemon(tmp_path, broken)
    try:
        with TestClient(create_app(d), raise_server_exceptions=False) as client:
            missing = client.post("/v1/ensure", json={"model": str(tmp_path / "nope")})
            assert missing.status_code == 400 and "does not exist" in missing.json()["error"]
            assert client.post("/v1/ensure", json={"model": str(tmp_path),
                                                   "dtype": "int8"}).status_code == 422
            crashed = client.post("/v1/ensure", json={"model": str(tmp_path)})
            assert crashed.status_code == 500
            assert crashed.json()["status"] == "failed" and crashed.json()["error"]
            assert client.get("/healthz").json()["status"] == "ok"
    finally:
        d.stop()


def test_a_hub_style_model_dir_of_symlinks_is_built(daemon: Daemon, tmp_path: Path) -> None:
    plain = make_light_model(tmp_path / "plain")
    snapshot = tmp_path / "hub" / "snapshots" / "rev1" / "transformer"
    snapshot.mkdir(parents=True)
    blobs = tmp_path / "hub" / "blobs"
    blobs.mkdir()
    for f in (plain / "transformer").iterdir():
        blob = blobs / f"sha-{f.name}"
        blob.write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    with TestClient(create_app(daemon)) as client:
        answer = client.post("/v1/ensure", json={"model": str(snapshot.parent), "wait_s": 30})
    assert answer.status_code == 200 and answer.json()["built"], answer.json()


def test_scrub_reports_corruption_without_touching_the_entry(daemon: Daemon) -> None:
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


# ---- real processes ------------------------------------------------------------------------

class Served:
    """A `cachectl serve` process with the light loader; ``started`` is its first log line."""

    def __init__(self, tmp_path: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        self.root, self.sock = tmp_path / "cache", tmp_path / "run" / "cachectl.sock"
        self.proc = subprocess.Popen(
            cachectl_argv("serve", "--root", str(self.root), "--socket", str(self.sock),
                          "--scrub-interval", "0", *extra),
            stderr=subprocess.PIPE, text=True, env=env or light_env())
        self.seen: list[dict[str, Any]] = []
        self.started = self.wait_event("daemon_started")  # listening once logged

    def wait_event(self, name: str) -> dict[str, Any]:
        """Read the JSON log lines up to the first ``name`` event (kept in ``seen``)."""
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if line.startswith("{"):
                self.seen.append(json.loads(line))
                if self.seen[-1]["event"] == name:
                    return self.seen[-1]
        raise AssertionError(f"the daemon exited without logging {name}")

    def logs(self) -> list[dict[str, Any]]:
        assert self.proc.stderr is not None
        rest = [json.loads(x) for x in self.proc.stderr.read().splitlines() if x.startswith("{")]
        return self.seen + rest

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def served() -> Iterator[list[Served]]:
    started: list[Served] = []
    yield started
    for s in started:
        s.stop()


def test_sigterm_lets_a_running_build_finish(tmp_path: Path, served: list[Served]) -> None:
    model = make_light_model(tmp_path / "model")
    (model / "hold").touch()
    d = Served(tmp_path)
    served.append(d)
    status, body = DaemonClient(d.sock).ensure(str(model), "bfloat16", None, wait_s=0)
    assert status == 202
    _wait_for(lambda: _builds(model) == 1, "the build to start")
    d.proc.send_signal(signal.SIGTERM)
    d.wait_event("draining_builds")  # stopped answering, the build still running
    assert not d.sock.exists()
    (model / "release").touch()
    assert d.proc.wait(timeout=60) == 0
    events = [e["event"] for e in d.logs()]
    assert events.index("draining_builds") < events.index("ensure_done") \
        < events.index("daemon_stopped")
    store = CacheStore(d.root)
    assert len(store.keys()) == 1 and store.verify()[0].ok


def test_sigterm_past_the_grace_period_says_it_abandoned_the_build(
    tmp_path: Path, served: list[Served],
) -> None:
    model = make_light_model(tmp_path / "model")
    (model / "hold").touch()
    d = Served(tmp_path, "--grace-period", "0.2")
    served.append(d)
    assert DaemonClient(d.sock).ensure(str(model), "bfloat16", None, wait_s=0)[0] == 202
    _wait_for(lambda: _builds(model) == 1, "the build to start")
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=60) == 3
    abandoned = [e for e in d.logs() if e["event"] == "build_abandoned"]
    assert len(abandoned) == 1 and abandoned[0]["grace_s"] == 0.2
    assert CacheStore(d.root).keys() == [] and not d.sock.exists()
    # Nothing stale blocks the next builder.
    (model / "release").touch()
    out = subprocess.run(cachectl_argv("build", "--root", str(d.root), "--model", str(model),
                                       "--json"), capture_output=True, text=True,
                         env=light_env(), timeout=60)
    assert out.returncode == 0 and json.loads(out.stdout)["built"], out.stderr


def test_ensure_builds_here_when_the_daemon_dies_mid_request(
    tmp_path: Path, served: list[Served],
) -> None:
    model = make_light_model(tmp_path / "model")
    (model / "hold").touch()
    d = Served(tmp_path)
    served.append(d)
    ensure = subprocess.Popen(cachectl_argv("ensure", "--root", str(d.root), "--socket",
                                            str(d.sock), "--model", str(model)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=light_env())
    _wait_for(lambda: (model / f"started.{d.proc.pid}").exists(), "the daemon's build")
    d.proc.kill()  # SIGKILL: the daemon's build lock dies with it
    d.proc.wait()
    _wait_for(lambda: _builds(model) == 2, "the local build")
    (model / "release").touch()
    out, err = ensure.communicate(timeout=60)
    assert ensure.returncode == 0, err
    assert out.startswith("ready ") and out.rstrip().endswith("(built)")
    assert "daemon at" in err and "building or joining here under the lock instead" in err
    assert (model / f"started.{ensure.pid}").exists()
    assert CacheStore(d.root).verify()[0].ok


def test_metrics_bind_to_the_loopback_unless_told(tmp_path: Path, served: list[Served]) -> None:
    plain = Served(tmp_path / "a", "--metrics-port", "0")
    served.append(plain)
    host, port = plain.started["metrics"].rsplit(":", 1)
    assert host == "127.0.0.1"
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert b"cachectl_entries" in r.read()
    # In a pod the chart passes the pod IP ($POD_IP, from the downward API).
    pod = Served(tmp_path / "b", "--metrics-port", "0", env=light_env(POD_IP="127.0.0.2"))
    served.append(pod)
    host, port = pod.started["metrics"].rsplit(":", 1)
    assert host == "127.0.0.2"
    with urllib.request.urlopen(f"http://127.0.0.2:{port}/metrics", timeout=10) as r:
        assert b"cachectl_entries" in r.read()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)


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
        with urllib.request.urlopen(f"http://{started['metrics']}/metrics") as r:
            text = r.read().decode()
        assert 'cachectl_builds_total{result="ok"} 1.0' in text
        assert 'cachectl_ensure_requests_total{outcome="hit"} 1.0' in text
    finally:
        daemon.send_signal(signal.SIGTERM)
        rc = daemon.wait(timeout=30)
    logs = [json.loads(line) for line in daemon.stderr.read().splitlines() if line.startswith("{")]
    assert rc == 0 and not sock.exists()
    assert {"ensure_done", "daemon_stopped"} <= {entry["event"] for entry in logs}
