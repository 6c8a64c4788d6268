"""bench/cache.py's CPU smoke mode runs end to end and prints its table and the verify-target
line (what the lead runs on the 16-core GPU host, at 20 GiB). No timing is asserted."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "cache.py"


def test_the_cache_bench_smoke_mode_prints_its_table() -> None:
    out = subprocess.run([sys.executable, "-P", str(BENCH), "--smoke"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    names = [r.split("|")[1].strip() for r in rows]
    assert names[0] == "measurement"
    assert {"raw sha256, 1 thread", "entry", "build (publish)", "verify target"} <= set(names)
    target = next(r for r in rows if r.startswith("| verify target"))
    assert ">= 0.9 x" in target and re.search(r": (met|NOT met) \|", target)
