"""bench/serve_imports.py's own bookkeeping: reading ``-X importtime`` output, adding self
times per package, and the table of repeated starts (the starts themselves are real servers,
run by the bench)."""

from __future__ import annotations

from test_bench_tools import load

IMPORTTIME = """\
import time: self [us] | cumulative | imported package
import time:      1000 |       1000 |   _io
import time:    200000 |     200000 |       torch._C
import time:    300000 |     500000 |     torch
import time:     50000 |     550000 |   ditserve.engine.adapters.files
2026-12-05 21:00:00,000 INFO something else on stderr
import time:     20000 |     20000 |     ditserve.engine.server.app
import time:      5000 |     25000 |   ditserve.engine.server
"""


def test_importtime_lines_are_read_and_self_times_added_per_package() -> None:
    bench = load("serve_imports")
    rows = bench.import_rows(IMPORTTIME)
    assert len(rows) == 6  # the header and the log line are skipped
    assert rows[1] == (200000, 200000, 3, "torch._C")
    per = bench.seconds_per_package(rows)
    assert per["torch"] == 0.5  # torch and torch._C, each counted once by its self time
    assert per["ditserve.engine.server"] == 0.025
    assert per["ditserve.engine.adapters"] == 0.05
    assert bench.heaviest(rows, 2) == [("ditserve.engine.adapters.files", 0.55, 1),
                                       ("torch", 0.5, 2)]


def test_the_runs_table_shows_median_and_range_of_each_phase_that_ran() -> None:
    bench = load("serve_imports")
    runs = [{"listening_s": 1.0, "ready_s": 5.0, "cpu_s": 4.0,
             "phases": {"process": 1.0, "imports": 3.0}},
            {"listening_s": 2.0, "ready_s": 7.0, "cpu_s": 5.0,
             "phases": {"process": 2.0, "imports": 4.0}},
            {"listening_s": 3.0, "ready_s": 6.0, "cpu_s": 6.0,
             "phases": {"process": 1.5, "imports": 3.5}}]
    lines = bench.runs_table(runs).splitlines()
    assert lines[0] == "| starts | listening | ready | cpu to ready | process | imports |"
    assert lines[2] == ("| 3 | 2.00 (1.00-3.00) | 6.00 (5.00-7.00) | 5.00 (4.00-6.00) | "
                        "1.50 (1.00-2.00) | 3.50 (3.00-4.00) |")
