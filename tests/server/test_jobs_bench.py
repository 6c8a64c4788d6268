"""bench/jobs.py as a CPU smoke run: the SQLite and the Redis job store on one tiny Wan
replica each, every job completed and downloaded, the table and the target row printed (the
numbers are timings: reported, not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from server.redis_support import redis_server_binary

BENCH = Path(__file__).parents[2] / "bench" / "jobs.py"
pytestmark = pytest.mark.slow


def test_jobs_bench_smoke_run(tiny_wan: Path, tmp_path: Path) -> None:
    redis_server_binary()  # skips (or fails in CI) without it
    out = tmp_path / "jobs.json"
    run = subprocess.run([sys.executable, str(BENCH), "--model", str(tiny_wan), "--jobs", "2",
                          "--burst", "2", "--warmup", "0", "--replicas", "0", "--out", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert [r["label"] for r in report["results"]] == ["sqlite", "redis"]
    for result in report["results"]:
        assert result["jobs"] == 2 and result["burst_jobs_per_replica"] == [2]
    assert "| sqlite | 1 | 2 |" in run.stdout and "target: redis p50 e2e" in run.stdout
