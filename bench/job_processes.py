"""Processes the job benchmarks share (``jobs.py``, ``job_scenarios.py``): a free port, moto's
S3 server, stopping a server the way Kubernetes does (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from typing import Any


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
