"""Fixtures for the HTTP server tests: `ditserve serve` as a real process on a free port.

Each server process costs ~5-10 s of imports and model building, so the suite uses two: a
session-wide default server (``server``) for most tests, and the admission-control server in
test_admission.py (auth on, one batch slot, one queue slot, ends with the SIGTERM drain).
Every process gets its own DITSERVE_HOME, so the tiny model is built there and never in the
user's cache.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from ports import free_port  # type: ignore[import-not-found]

STARTUP_TIMEOUT_S = 180.0


@dataclass
class ServerProcess:
    """A running `ditserve serve`; ``url`` is its base URL, ``log`` its combined output."""

    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n"
                                   f"{self.log_text()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)  # polling another process; there is no event to wait on
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log_text()}")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return int(self.process.returncode)


def start_server(tmp: Path, *args: str, env: dict[str, str] | None = None,
                 port: int | None = None, wait: bool = True) -> ServerProcess:
    """Start `ditserve serve ARGS`; without ``port``, on a free port of 127.0.0.1 (given as
    flags), else the caller's ARGS (e.g. a --config file) must bind ``port`` themselves.
    ``wait``: until it is ready (else the caller calls ``wait_ready``)."""
    flags: list[str] = []
    if port is None:
        port = free_port()
        flags = ["--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    tmp.mkdir(parents=True, exist_ok=True)
    log = tmp / "server.log"
    environ = {k: v for k, v in os.environ.items() if k != "DITSERVE_API_KEY"}
    environ.update({"DITSERVE_HOME": str(tmp / "home"), "PYTHONUNBUFFERED": "1",
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})})
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "ditserve.engine.cli", "serve", *flags, *args],
            stdout=out, stderr=subprocess.STDOUT, env=environ,
        )
    server = ServerProcess(process, f"http://127.0.0.1:{port}", log)
    if not wait:
        return server
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session")
def launch_server():
    """launch_server(tmp_dir, *flags, env=...) -> a ready ServerProcess (caller stops it)."""
    return start_server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The default server: tiny model, max_num_seqs 4, auth off, requests bounded to 64x64
    and 10 steps (so the schemathesis run stays cheap). Started the way the operator starts
    it: `ditserve serve --config FILE`, the file holding a server section."""
    tmp = tmp_path_factory.mktemp("server")
    port = free_port()
    config = tmp / "engine.yaml"
    config.write_text(
        "device: cpu\n"
        "scheduler: {max_num_seqs: 4, max_queue: 64}\n"
        f"server: {{host: 127.0.0.1, port: {port}, request_timeout_s: 120, max_side: 64,\n"
        "          max_steps: 10, max_body_bytes: 65536}\n"
    )
    proc = start_server(tmp, "--config", str(config), port=port)
    yield proc
    proc.stop()


@pytest.fixture
def metric():
    """metric(text, name) -> float: one sample of a Prometheus exposition."""
    return metric_value


def metric_value(text: str, name: str) -> float:
    """The value of one sample line (``name`` includes labels) of a Prometheus exposition."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(f"{name} not in metrics:\n{text}")


LEFTOVER_ID = "video_" + "0" * 16 + "ab" * 8  # a job of a "previous server" on the same dir


@pytest.fixture(scope="session")
def leftover_id() -> str:
    return LEFTOVER_ID


@pytest.fixture(scope="session")
def tiny_wan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Wan 2.1 model (text-to-video), built once per session."""
    from ditserve.engine.makers.tiny_model import init_tiny

    return init_tiny(tmp_path_factory.mktemp("tiny-wan") / "model", family="wan")


@pytest.fixture(scope="session")
def video_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The video server's --video-dir, holding a previous server's leftovers when it starts:
    a finished MP4 (``LEFTOVER_ID``), a half-written temp file and a file of someone else."""
    videos = tmp_path_factory.mktemp("video-dir")
    (videos / ".tmp").mkdir()
    (videos / f"{LEFTOVER_ID}.mp4").write_bytes(b"an old server's video")
    (videos / ".tmp" / f"{LEFTOVER_ID}.1234.mp4").write_bytes(b"half written")
    (videos / "notes.txt").write_text("not a video: the server leaves it alone")
    return videos


@pytest.fixture(scope="session")
def video_server(tmp_path_factory: pytest.TempPathFactory, tiny_wan: Path, video_dir: Path
                 ) -> Iterator[ServerProcess]:
    """A video replica: the tiny Wan model, max_num_seqs 2, jobs bounded to 64x64, 17 frames
    (1 s at 16 fps) and 8 steps (so the schemathesis run stays cheap), MP4s in ``video_dir``."""
    tmp = tmp_path_factory.mktemp("video-server")
    proc = start_server(tmp, "--model", str(tiny_wan), "--max-num-seqs", "2",
                        "--max-queue", "16", "--max-side", "64", "--max-steps", "8",
                        "--max-frames", "17", "--video-dir", str(video_dir),
                        "--video-max-jobs", "4096", "--request-timeout", "120")
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    """One real redis-server for the session (tests keep apart by namespace)."""
    from server.redis_support import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()
