"""A real ``redis-server`` (Debian's package) for the job store tests: started on a free
port of 127.0.0.1 in a temporary directory, stopped (or killed, or paused) by the test.

Missing redis-server skips the tests that need it on a developer machine, never in CI
(``CI`` set): there ``.ci/run`` installs it, and its absence is a failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from ports import free_port  # type: ignore[import-not-found]

STARTUP_TIMEOUT_S = 20.0


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is missing: .ci/run installs it (apt-get install "
                        "redis-server)")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    return found


class RedisServer:
    """One redis-server process. Append-only file on, fsync each write: a restart keeps
    every job (as a Redis with persistence in production would)."""

    def __init__(self, directory: Path, port: int | None = None) -> None:
        self.directory = directory
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        log = (self.directory / "redis.log").open("ab")
        self.process = subprocess.Popen(
            [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(self.directory), "--appendonly", "yes", "--appendfsync", "always",
             "--save", "", "--protected-mode", "yes"],
            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited: {(self.directory / 'redis.log').read_text()}")
            time.sleep(0.05)  # another process: no event to wait on
        raise RuntimeError("redis-server did not answer PING")

    def pause(self) -> None:
        """Stop answering (SIGSTOP): clients time out, as with a hung or cut-off Redis."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
