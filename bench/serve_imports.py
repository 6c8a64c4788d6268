#!/usr/bin/env python3
"""What ``ditserve serve`` imports before it serves (issue 50): the ``process`` start phase in
repeated starts, and where one ``-X importtime`` start spends its import time.

Each start is a fresh ``python -P -m ditserve.engine.cli serve`` process (one at a time) on the
given model. From the moment the process was spawned the bench polls ``/health`` until the
HTTP server listens, then watches the server's log for the engine's ready line (polling
``/ready`` instead would cost the start the CPU time of every answer); then it reads the
engine's own account of its start from ``/metrics`` (``ditserve:start_phase_seconds{phase}``)
and the CPU seconds the process used (user + system: steadier than wall time where other work
shares the cores), and stops it. The table gives the median and the range of ``--runs``
starts. With ``--importtime`` one more start runs under ``python -X importtime`` and two more
tables follow: self time summed per top-level package (``ditserve`` split by its
subpackages), and the heaviest single imports (cumulative).

    ditserve model init-tiny --family flux flux-tiny
    python3 bench/serve_imports.py --model flux-tiny --runs 7 --importtime

Runs on a CPU (the tiny model) as on a GPU host (a full model: add ``--serve-args``).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
from job_processes import answers, free_port, running, wait_until

from ditserve.engine.runner.start_phases import PHASES

# What the engine logs as it turns READY (``engine.runner.start_phases``).
READY_LINE = b" after process start ("
# "import time:  self [us] | cumulative | imported package" (the header line has no digits).
_IMPORT_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def import_rows(text: str) -> list[tuple[int, int, int, str]]:
    """(self us, cumulative us, depth, module) per line of ``-X importtime`` output."""
    rows = []
    for line in text.splitlines():
        match = _IMPORT_LINE.match(line)
        if match:
            rows.append((int(match[1]), int(match[2]), len(match[3]) // 2, match[4]))
    return rows


def package_of(module: str) -> str:
    """The top-level package a module counts under (``ditserve.engine.X`` by subpackage)."""
    parts = module.split(".")
    return ".".join(parts[:3]) if parts[0] == "ditserve" else parts[0]


def seconds_per_package(rows: list[tuple[int, int, int, str]]) -> dict[str, float]:
    """Self time summed per package: each module's own time, counted once (seconds)."""
    total: dict[str, float] = {}
    for self_us, _, _, module in rows:
        package = package_of(module)
        total[package] = total.get(package, 0.0) + self_us / 1e6
    return total


def heaviest(rows: list[tuple[int, int, int, str]], n: int) -> list[tuple[str, float, int]]:
    """The ``n`` imports with the largest cumulative time: (module, seconds, depth)."""
    ranked = sorted(rows, key=lambda r: -r[1])[:n]
    return [(module, cumulative / 1e6, depth) for _, cumulative, depth, module in ranked]


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) a process has used: on a shared machine a
    steadier measure of the work of a start than its wall time."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_once(cmd: list[str], url: str, log_path: Path, timeout: float,
               stderr_path: Path | None = None) -> dict[str, Any]:
    """Spawn one server, wait for /ready, read its start phases, stop it."""
    import httpx

    listening = None
    with running(cmd, log_path, stderr_path=stderr_path) as (process, spawned):

        def ready() -> bool:
            nonlocal listening
            if listening is None:
                if answers(f"{url}/health"):
                    listening = time.perf_counter() - spawned
                return False
            # The engine logs this line as it turns READY. Watching the log, not polling
            # /ready, keeps the bench from costing the start CPU time.
            return READY_LINE in (stderr_path or log_path).read_bytes()

        ready_s = wait_until(ready, process, spawned, timeout, log_path, every_s=0.02)
        if httpx.get(f"{url}/ready", timeout=10).status_code != 200:
            raise SystemExit(f"logged ready but /ready is not 200; see {log_path}")
        cpu = cpu_seconds(process.pid)
        samples = harness.scrape_metrics(url)
    phases = {name: samples.get(f'ditserve:start_phase_seconds{{phase="{name}"}}')
              for name in PHASES}
    return {"listening_s": listening, "ready_s": ready_s, "cpu_s": cpu,
            "phases": {k: v for k, v in phases.items() if v is not None}}


def runs_table(runs: list[dict[str, Any]]) -> str:
    """Median (min-max) of each column over the starts."""
    shown = [p for p in PHASES if any(p in r["phases"] for r in runs)]
    columns = {"listening": [r["listening_s"] for r in runs if r["listening_s"] is not None],
               "ready": [r["ready_s"] for r in runs],
               "cpu to ready": [r["cpu_s"] for r in runs if r["cpu_s"] is not None],
               **{p: [r["phases"][p] for r in runs if p in r["phases"]] for p in shown}}
    head = ["starts", *columns]
    cells = [f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" if v else "-"
             for v in columns.values()]
    return "\n".join(harness.md_table(head, [[str(len(runs)), *cells]]))


def packages_table(rows: list[tuple[int, int, int, str]], n: int) -> str:
    per = seconds_per_package(rows)
    body = [[name, f"{seconds:.3f}"] for name, seconds in sorted(per.items(), key=lambda kv: -kv[1])[:n]]
    body.append(["(all)", f"{sum(per.values()):.3f}"])
    return "\n".join(harness.md_table(["package", "self s"], body))


def heaviest_table(rows: list[tuple[int, int, int, str]], n: int) -> str:
    body = [[module, f"{seconds:.3f}", str(depth)] for module, seconds, depth in heaviest(rows, n)]
    return "\n".join(harness.md_table(["import", "cumulative s", "depth"], body))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="diffusers model directory")
    p.add_argument("--runs", type=int, default=5, help="starts to take the median of")
    p.add_argument("--python", default=sys.executable, help="the interpreter that serves")
    p.add_argument("--serve-args", default="", help="more `ditserve serve` flags")
    p.add_argument("--importtime", action="store_true",
                   help="one more start under -X importtime: per-package and heaviest imports")
    p.add_argument("--top", type=int, default=20, help="rows of the import tables")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to ready, per start")
    a = p.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="serve-imports-"))

    def command(*python_flags: str) -> tuple[list[str], str]:
        port = free_port()
        cmd = [a.python, "-P", *python_flags, "-m", "ditserve.engine.cli", "serve",
               "--host", "127.0.0.1", "--port", str(port), "--model", str(a.model),
               *shlex.split(a.serve_args)]
        return cmd, f"http://127.0.0.1:{port}"

    runs = []
    for i in range(a.runs):
        cmd, url = command()
        harness.log(f"start {i + 1}/{a.runs}: {shlex.join(cmd)}")
        runs.append(start_once(cmd, url, logs / f"start-{i}.log", a.timeout))
        harness.log(f"ready in {runs[-1]['ready_s']:.2f}s, phases {runs[-1]['phases']}")
    print(runs_table(runs))
    if a.importtime:
        cmd, url = command("-X", "importtime")
        stderr = logs / "importtime.log"
        harness.log(f"importtime start: {shlex.join(cmd)} (stderr: {stderr})")
        start_once(cmd, url, logs / "importtime-stdout.log", a.timeout, stderr_path=stderr)
        rows = import_rows(stderr.read_text(errors="replace"))
        print()
        print(packages_table(rows, a.top))
        print()
        print(heaviest_table(rows, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
