"""Processes the benchmarks share: a free port, moto's S3 server, running a server the way
Kubernetes does (stopped with SIGTERM, then SIGKILL) and waiting for it to get ready. The job
benchmarks (``jobs.py``, ``job_scenarios.py``) and the start benchmarks (``cold_start.py``,
``serve_imports.py``) use them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# The benches' servers take their ports from below the ephemeral range (see that module).
from ditserve.engine.distributed.ports import free_port as free_port


def start_moto() -> Any:
    """moto's S3 server on 127.0.0.1 with the bucket "bench"; servers inherit its env."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update({"AWS_ENDPOINT_URL_S3": f"http://{host}:{port}",
                       "AWS_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench"})
    boto3.client("s3").create_bucket(Bucket="bench")
    return server


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def running(cmd: list[str], log_path: Path, env: dict[str, str] | None = None,
            stderr_path: Path | None = None) -> Iterator[tuple[subprocess.Popen[bytes], float]]:
    """A server process, its output in ``log_path`` (stderr apart in ``stderr_path`` if
    given), stopped on leaving. Yields the process and the ``perf_counter`` just before it
    was spawned, so a start bench counts from the spawn and not from the caller's setup."""
    with open(log_path, "wb") as log, open(stderr_path or os.devnull, "wb") as err:
        spawned = time.perf_counter()
        process = subprocess.Popen(cmd, stdout=log, env=env,
                                   stderr=err if stderr_path else subprocess.STDOUT)
        try:
            yield process, spawned
        finally:
            stop(process)


def wait_until(ready: Callable[[], bool], process: subprocess.Popen[bytes], since: float,
               timeout: float, log_path: Path, every_s: float) -> float:
    """Ask ``ready`` every ``every_s`` until it says yes: the seconds from ``since`` (a
    ``perf_counter``). A server that exits first, or is not ready ``timeout`` seconds after
    ``since``, ends the bench with a pointer to its log."""
    while True:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace").splitlines()[-20:]
            raise SystemExit(f"server exited with {process.returncode}; see {log_path}:\n"
                             + "\n".join(tail))
        if time.perf_counter() - since > timeout:
            raise SystemExit(f"not ready after {timeout}s; see {log_path}")
        if ready():
            return time.perf_counter() - since
        time.sleep(every_s)  # polling a child process's readiness


def answers(url: str, timeout: float = 2.0) -> bool:
    """Whether a GET of ``url`` is answered 200 (a server still starting may not listen)."""
    import httpx  # only the benches that start servers need an HTTP client

    try:
        return httpx.get(url, timeout=timeout).status_code == 200
    except httpx.TransportError:
        return False


def wait_ready(process: subprocess.Popen[bytes], url: str, log_path: Path, *, timeout: float,
               every_s: float = 0.2) -> float:
    """Wait until the server at ``url`` answers ``/ready`` with 200 (``wait_until``'s rules):
    the seconds it took from this call."""
    return wait_until(lambda: answers(f"{url}/ready", timeout=5), process, time.perf_counter(),
                      timeout, log_path, every_s)
