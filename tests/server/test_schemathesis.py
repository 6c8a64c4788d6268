"""Schemathesis against a server's own /openapi.json: every check it has (no server error,
status codes, content types, headers and bodies as documented, valid data accepted, invalid
data rejected, 405 with Allow for undeclared methods, ...), with a fixed seed and a bounded
number of examples per operation. Two replicas, one per kind of model: the default image
server (requests bounded to 64x64 and 10 steps) and the video server (/v1/videos in JSON and
multipart, bounded to 64x64, 17 frames and 8 steps). The run is the `st` command line, as a
developer would run it."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

SEED = 20261201
MAX_EXAMPLES = 30


@pytest.mark.parametrize("replica", ["server", "video_server"])
def test_schemathesis_finds_no_failure(replica, request, tmp_path, metric) -> None:
    server = request.getfixturevalue(replica)
    command = [
        sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json",
        "--checks", "all", "--phases", "examples,coverage,fuzzing",
        "--max-examples", str(MAX_EXAMPLES), "--seed", str(SEED), "--workers", "1",
        "--request-timeout", "60", "--suppress-health-check", "too_slow",
    ]
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "120"}
    # cwd: schemathesis and hypothesis keep their example databases in the working directory.
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    report = run.stdout + run.stderr
    assert run.returncode == 0, report
    assert "No issues found" in report
    metrics = httpx.get(f"{server.url}/metrics").text
    assert metric(metrics, 'ditserve:request_errors_total{reason="internal"}') == 0
    assert metric(metrics, 'ditserve:request_errors_total{reason="invalid_request"}') > 0
