"""Schemathesis against a server's own /openapi.json: every check it has (no server error,
status codes, content types, headers and bodies as documented, valid data accepted, invalid
data rejected, 405 with Allow for undeclared methods, ...), including the stateful phase
(chains of calls along the links schemathesis infers: create a job, then read, follow,
download, delete it and read it again), under three fixed seeds with a bounded number of
examples per operation. Two replicas, one per kind of model: the default image server
(requests bounded to 64x64 and 10 steps) and the video server (/v1/videos in JSON and
multipart, bounded to 64x64, 17 frames and 8 steps). The run is the `st` command line, as a
developer would run it.

The coverage phase derives its cases from the document alone (the seed changes nothing), so
it runs with the first seed only; examples, fuzzing and the stateful phase run under each.
About a minute and a half for the first seed and half a minute for each other, per replica,
on two CPU cores."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

SEEDS = (20261201, 7, 31337)
MAX_EXAMPLES = 10


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("replica", ["server", "video_server"])
def test_schemathesis_finds_no_failure(replica, seed, request, tmp_path, metric) -> None:
    server = request.getfixturevalue(replica)
    phases = "examples,fuzzing,stateful" + (",coverage" if seed == SEEDS[0] else "")
    command = [
        sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json",
        "--checks", "all", "--phases", phases,
        "--max-examples", str(MAX_EXAMPLES), "--seed", str(seed), "--workers", "1",
        "--request-timeout", "60", "--suppress-health-check", "too_slow",
    ]
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "120"}
    # cwd: schemathesis and hypothesis keep their example databases in the working directory.
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    report = run.stdout + run.stderr
    assert run.returncode == 0, report
    assert "No issues found" in report
    assert "Stateful" in report and "API Links:" in report  # the chains ran
    metrics = httpx.get(f"{server.url}/metrics").text
    assert metric(metrics, 'ditserve:request_errors_total{reason="internal"}') == 0
    assert metric(metrics, 'ditserve:request_errors_total{reason="invalid_request"}') > 0
