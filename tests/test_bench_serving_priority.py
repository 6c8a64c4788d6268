"""bench/serving.py --priority: its trace (also a mixed load), its summary and targets, and a
CPU smoke run (two real `ditserve serve` processes on the tiny model: priority, then fcfs, on
one trace)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from test_bench_tools import BENCH, load  # type: ignore[import-not-found]


def test_the_trace_is_seeded_saturating_and_mixes_the_two_classes() -> None:
    bench = load("serving_priority")
    arrivals = bench.trace(500, 2.0, 0.1, seed=4)
    assert arrivals == bench.trace(500, 2.0, 0.1, seed=4)
    share = sum(a.priority == bench.HIGH for a in arrivals) / 500
    assert 0.06 < share < 0.14 and {a.priority for a in arrivals} == {bench.HIGH, bench.LOW}
    times = [a.arrival_s for a in arrivals]
    assert times == sorted(times) and 200 < times[-1] < 300  # ~500 at 2 per s
    # Even a tiny trace holds both classes.
    assert {a.priority for a in bench.trace(4, 0.0, 0.1, seed=0)} == {bench.HIGH, bench.LOW}
    # A mixed load (issue 47): low-priority sizes drawn, high-priority ones the run's size.
    mixed = bench.trace(200, 2.0, 0.1, seed=4, low_sizes=["512x512", "1360x768"])
    assert {a.size for a in mixed if a.priority == bench.LOW} == {"512x512", "1360x768"}
    assert {a.size for a in mixed if a.priority == bench.HIGH} == {None}


def test_summary_and_targets_from_outcomes() -> None:
    bench = load("serving_priority")
    outcomes = [bench.Outcome(i, bench.HIGH if i < 2 else bench.LOW, 0.0, 200, 1.0 + i,
                              10.0, queue_s=0.1 * (i + 1)) for i in range(5)]
    outcomes.append(bench.Outcome(5, bench.LOW, 0.0, 429, 0.1, 0.1, "full"))
    s = bench.summary(outcomes)
    assert (s["ok"], s["errors"], s["high_count"], s["low_count"]) == (5, 1, 2, 3)
    assert s["throughput_rps"] == 0.5 and s["high_p90_s"] == 2.0 and s["low_p50_s"] == 4.0
    # The admission wait of the high-priority requests only (the server's queue_seconds).
    assert s["high_queue_p90_s"] == 0.2 and s["high_p50_s"] == 2.0  # nearest rank, as above
    rows = bench.targets(1.6, {"priority": {"high_p90_s": 2.0, "throughput_rps": 0.5},
                               "fcfs": {"throughput_rps": 0.5}})
    assert [(round(r, 3), met) for _, r, met in rows] == [(1.25, True), (1.0, True)]
    assert [met for _, _, met in bench.targets(None, {})] == [None, None]


def test_cpu_smoke_run_of_the_priority_mode(tmp_path: Path) -> None:
    out = tmp_path / "priority.json"
    cmd = [sys.executable, str(BENCH / "serving.py"), "--priority", "--tiny", "--requests", "8",
           "--rate", "20", "--high-share", "0.25", "--idle-requests", "2", "--max-num-seqs", "2",
           "--seed", "2", "--startup-timeout", "300",
           # issue 47's mixed load: drawn low-priority sizes, the rate from the idle p50
           "--low-sizes", "64x64,32x64", "--rate-of-idle", "4", "--latency-target", "1.5",
           "--server-cmd", f"{sys.executable} -m ditserve.engine.cli", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "DITSERVE_HOME": str(tmp_path / "home")})
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert set(report["runs"]) == {"priority", "fcfs"}
    for run in report["runs"].values():
        assert run["ok"] == run["requests"] == 8 and run["high_count"] >= 1
    # Every served request carries the server's admission wait (issue 47's breakdown).
    for policy in ("priority", "fcfs"):
        assert all(o["queue_s"] is not None and 0.0 <= o["queue_s"] <= o["latency_s"]
                   for o in report["records"][policy])
    assert report["runs"]["fcfs"]["preemptions"] == 0  # fcfs never pauses
    assert report["idle_high_p90_s"] is not None and len(report["records"]["idle"]) == 2
    assert [t["ratio"] is not None for t in report["targets"]] == [True, True]
    assert "high-priority p90 <= 1.5x idle p90" in done.stdout
    assert report["records"]["trace_rate"] > 0
    assert {a["size"] for a in report["trace"] if a["priority"] == 1} <= {"64x64", "32x64"}
