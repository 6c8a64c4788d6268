#!/usr/bin/env python3
"""Step syncs (issue 47): every host<->device synchronization in the engine's steady-state steps.

The step loop queues one step ahead of the GPU (``engine/runner/inflight.py``), so host work is
normally hidden behind the step the GPU runs; a synchronizing call in the step path (``.item()``,
``.cpu()``, ``.tolist()``, a blocking H2D copy, ``torch.nonzero``, a boolean mask index) makes
the GPU wait for the host's launches every step. Issue 47's priority run lost ~0.1-0.14 s a
step outside the forwards while urgent requests ran beside a few low-priority rows.

This starts an engine in this process on CUDA, configured as ``ditserve serve --max-num-seqs 8
--scheduling-policy priority --urgent-companions 1`` (and, with ``--policy both``, a second one
under fcfs), with the server's observers (metrics, step log). Each round submits a workload that
changes composition: low-priority requests of several sizes, more of them later, and urgent
(priority -1) requests arriving while they run, so pauses, resumes, admissions and finishes
happen (arrivals are submitted from the engine's loop thread after a given number of denoise
steps, so a round is the same every time). The first round warms up; during the second,
``torch.cuda.set_sync_debug_mode("warn")`` is on and every warning it raises is recorded with
the stack of the thread that warned. It prints, per policy, the window's denoise steps, wall
and forward time, pauses and resumes, each step's wall time and synchronizing calls (min,
median, max) beside the seconds spent recording them, and one row per synchronizing site -
the innermost frame in ditserve - with its count, its rate per step and an example
ditserve-only stack:

    python3 bench/step_syncs.py --model DIR --serve-args "--dtype bfloat16" --out syncs.json

``--sync-steps N`` keeps the mode on for the round's first N steps only; ``--no-stacks`` counts
the calls per step without walking their stacks (no sites table), which tells torch's own cost
of warning from the recording's. Each measured step prints a line as it ends.

Without ``--model`` it builds the tiny random-weight model of ``--family`` (``ditserve model
init-tiny``) in a temporary directory. ``--dry-run`` runs the same workload on the CPU without
the sync mode (it checks the workload, not the syncs). Sync debug mode reports stream syncs and
synchronous copies; it does not report event waits (the loop's fence on the step before, by
design) or ``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import shlex
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from sync_sites import SyncCapture, group_sites, package_roots

from ditserve.engine.cli.main import build_parser
from ditserve.engine.cli.main import main as ditserve_cli
from ditserve.engine.families import MODEL_VARIANTS
from ditserve.engine.loop.engine import DiffusionEngine, RequestHandle
from ditserve.engine.request import SamplingParams
from ditserve.engine.server.main import configs_from_args
from ditserve.engine.server.metrics import ServingMetrics
from ditserve.engine.server.state import engine_options

HIGH, LOW = -1, 1
SERVE_FLAGS = {"priority": ["--max-num-seqs", "8", "--scheduling-policy", "priority",
                            "--urgent-companions", "1"],
               "fcfs": ["--max-num-seqs", "8", "--scheduling-policy", "fcfs"]}
SIZES = {"cuda": "512x512,768x768,1024x1024,1024x512", "cpu": "32x32,48x48,64x64,64x32"}
URGENT_SIZE = {"cuda": "1024x1024", "cpu": "64x64"}


# -- the workload ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Arrival:
    """One request, submitted once its round has run ``at_step`` denoise steps."""

    at_step: int
    priority: int
    size: str  # WxH
    steps: int

    def params(self, seed: int) -> SamplingParams:
        width, height = (int(v) for v in self.size.split("x"))
        return SamplingParams(prompt=f"request {seed}", height=height, width=width,
                              num_inference_steps=self.steps, priority=self.priority, seed=seed)


def workload(requests: int, urgent: int, sizes: Sequence[str], urgent_size: str,
             steps: int) -> list[Arrival]:
    """Half the low-priority requests (sizes in turn) at once, the rest after two gaps of half
    a request's steps; urgent ones at odd gaps (the first while the first half runs), so urgent
    requests pause running rows, finish and let them resume, beside new admissions."""
    gap = max(1, steps // 2)
    first = (requests + 1) // 2
    lows = [Arrival(0 if i < first else 2 * gap, LOW, sizes[i % len(sizes)], steps)
            for i in range(requests)]
    highs = [Arrival((2 * i + 1) * gap, HIGH, urgent_size, steps) for i in range(urgent)]
    return sorted(lows + highs, key=lambda a: a.at_step)


@dataclass(frozen=True)
class SyncWindow:
    """The measured round's watch: ``count`` reads the synchronizing calls recorded so far;
    ``end`` (sync-debug mode off) is called after the round's ``steps``-th denoise step, or
    never when ``steps`` is None; ``state`` says what the mode is now and ``handler_s`` the
    seconds spent recording so far, for the line printed as each step ends."""

    count: Callable[[], int]
    steps: int | None = None
    end: Callable[[], None] = lambda: None
    state: Callable[[], str] = lambda: "-"
    handler_s: Callable[[], float] = lambda: 0.0


class Round:
    """An engine observer: counts the steps, forward time, pauses and resumes of the current
    round and submits its arrivals as their step comes (from the loop thread, between steps).
    Watched by a ``SyncWindow``, it also keeps each step's wall time (from the step before)
    and the synchronizing calls recorded during it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.begin([], lambda arrival: None)

    def begin(self, arrivals: list[Arrival], submit: Callable[[Arrival], None],
              window: SyncWindow | None = None) -> None:
        with self._lock:
            self._pending, self._submit = list(arrivals), submit
            self.steps, self.forward_s, self.pauses, self.resumes = 0, 0.0, 0, 0
            self._window = window
            self.step_walls: list[float] = []
            self.step_syncs: list[int] = []
            self._last = (time.monotonic(), window.count() if window else 0)
        self._submit_due()

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def _submit_due(self, *, at_least_one: bool = False) -> None:
        with self._lock:
            due = [a for a in self._pending if a.at_step <= self.steps]
            if at_least_one and not due and self._pending:
                due = self._pending[:1]
            self._pending = self._pending[len(due):]
            submit = self._submit
        for arrival in due:
            submit(arrival)

    def submit_next(self) -> None:
        """The engine ran out of work before the next arrival's step: submit it now."""
        self._submit_due(at_least_one=True)

    def on_step(self, *, requests: int, rows: int, seconds: float, groups: int = 1,
                tokens: int = 0) -> None:
        with self._lock:
            self.steps += 1
            self.forward_s += seconds
            window, steps = self._window, self.steps
            if window is not None:
                now, count = time.monotonic(), window.count()
                self.step_walls.append(now - self._last[0])
                self.step_syncs.append(count - self._last[1])
                self._last = (now, count)
        if window is not None:
            # As each step ends, not only in the table: on 2026-12-07 a run cut short by its
            # call's limit showed 33 s steps after the window should have closed, and
            # nothing of its own to say whether the mode was still on.
            print(f"  step {steps}: wall {self.step_walls[-1]:.2f} s, "
                  f"{self.step_syncs[-1]} synchronizing calls, recording {window.handler_s():.2f}"
                  f" s so far, sync-debug mode {window.state()}", file=sys.stderr, flush=True)
            if steps == window.steps:
                window.end()  # the rest of the round runs at full speed
                print(f"  sync window closed after step {steps}: sync-debug mode "
                      f"{window.state()}", file=sys.stderr, flush=True)
        self._submit_due()

    def on_preempted(self, request_id: str) -> None:
        with self._lock:
            self.pauses += 1

    def on_resumed(self, request_id: str, seconds: float) -> None:
        with self._lock:
            self.resumes += 1

    def on_finished(self, result: object) -> None: ...
    def on_failed(self, request_id: str, reason: str) -> None: ...


def run_round(engine: DiffusionEngine, tally: Round, arrivals: list[Arrival],
              timeout_s: float, window: SyncWindow | None = None) -> dict[str, Any]:
    """Submit ``arrivals`` as the round's steps come; wait for every request to end."""
    handles: list[RequestHandle] = []
    failed: list[str] = []
    lock = threading.Lock()

    def submit(arrival: Arrival) -> None:
        # Mostly called on the engine's loop thread (an observer): a refusal raised there
        # would end the loop, so it is recorded instead.
        with lock:
            seed = len(handles) + len(failed)
            try:
                handles.append(engine.add_request(arrival.params(seed)))
            except Exception as e:
                failed.append(f"{arrival}: refused: {type(e).__name__}: {e}")

    started = time.monotonic()
    tally.begin(arrivals, submit, window)
    while True:
        with lock:
            futures = [h.future for h in handles]
        if all(f.done() for f in futures):
            if not tally.pending:
                break
            tally.submit_next()
            continue
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"the round did not finish in {timeout_s} s")
        concurrent.futures.wait(futures, timeout=0.2,
                                return_when=concurrent.futures.FIRST_COMPLETED)
    finished = {"high": 0, "low": 0}
    for handle in handles:
        error = handle.future.exception()
        if error is None:
            finished["high" if handle.params.priority < 0 else "low"] += 1
        else:
            failed.append(f"{handle.request_id}: {error}")
    wall = time.monotonic() - started
    return {"requests": len(handles) + len(failed), "finished": finished, "failed": failed,
            "steps": tally.steps, "wall_s": wall, "forward_s": tally.forward_s,
            "outside_forwards_s": wall - tally.forward_s, "pauses": tally.pauses,
            "resumes": tally.resumes, "step_walls_s": tally.step_walls,
            "step_syncs": tally.step_syncs}


# -- the program ----------------------------------------------------------------------------------
def build_engine(model: str, policy: str, device: str, serve_args: str,
                 tally: Round) -> DiffusionEngine:
    """The engine ``ditserve serve`` would build from these flags, with its observers."""
    flags = ["serve", "--model", model, "--device", device, *SERVE_FLAGS[policy],
             *shlex.split(serve_args)]
    engine_config, server_config = configs_from_args(build_parser().parse_args(flags))
    built: list[DiffusionEngine] = []
    metrics = ServingMetrics(lambda: built[0] if built else None)
    options = engine_options(engine_config, server_config, metrics,
                             lambda: built[0] if built else None)
    built.append(DiffusionEngine(engine_config, observers=[*options["observers"], tally],
                                 warmup=options["warmup"]))
    return built[0]


def measure(args: argparse.Namespace, model: str, policy: str,
            arrivals: list[Arrival]) -> dict[str, Any]:
    """Warm-up rounds, then one round with sync debug mode on (on CUDA)."""
    cuda = not args.dry_run
    tally = Round()
    engine = build_engine(model, policy, "cuda" if cuda else "cpu", args.serve_args,
                          tally).start()
    try:
        for _ in range(args.warmup_rounds):
            run_round(engine, tally, arrivals, args.timeout)
        if cuda:
            torch.cuda.synchronize()  # the warm-up's own work is not the window's

        def end_window() -> None:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")

        def sync_mode() -> str:  # torch reports 0 (default), 1 (warn) or 2 (error)
            return str(torch.cuda.get_sync_debug_mode()) if cuda else "off (dry run)"

        with SyncCapture(stacks=not args.no_stacks) as capture:
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                window = run_round(engine, tally, arrivals, args.timeout,
                                   SyncWindow(lambda: capture.count, args.sync_steps, end_window,
                                              sync_mode, lambda: capture.handler_s))
            finally:
                end_window()
    finally:
        engine.shutdown()
    window["sync_steps"] = min(window["steps"], args.sync_steps or window["steps"])
    window["stacks"] = capture.stacks
    window["sites"] = group_sites(capture.records, package_roots(), window["sync_steps"]) \
        if capture.stacks else []
    window["syncs"] = len(capture.records)
    window["capture_intact"] = capture.intact
    window["handler_s"] = capture.handler_s
    return window


def print_run(policy: str, run: dict[str, Any], dry_run: bool) -> None:
    watched = "" if run["sync_steps"] == run["steps"] else \
        f"; sync-debug mode on for the first {run['sync_steps']}"
    print(f"\n== {policy}: {run['steps']} denoise steps{watched} in {run['wall_s']:.2f} s (forwards "
          f"{run['forward_s']:.2f} s, outside them {run['outside_forwards_s']:.2f} s), "
          f"{run['pauses']} pauses, {run['resumes']} resumes, finished "
          f"{run['finished']['low']} low + {run['finished']['high']} high of "
          f"{run['requests']}; {run['syncs']} synchronizing calls")
    for failure in run["failed"]:
        print(f"  FAILED {failure}")
    if run["step_walls_s"]:
        walls, counts = sorted(run["step_walls_s"]), sorted(run["step_syncs"])
        print(f"  per step: wall {quantiles(walls)} s, synchronizing calls {quantiles(counts)} "
              f"(min/median/max); recording them took {run['handler_s']:.2f} s of the window")
    if not run["capture_intact"]:
        print("  note: the warning handler was replaced during the window; counts may be short")
    if dry_run:
        print("  (dry run: sync debug mode off, nothing captured)")
        return
    if not run.get("stacks", True):
        print("  (--no-stacks: calls counted, no stack walked, no sites)")
        return
    if not run["sites"]:
        print("  no synchronizing call in the window")
        return
    print(f"  {'site':<60} {'count':>6} {'per step':>9}  threads")
    for site in run["sites"]:
        per_step = "-" if site["per_step"] is None else f"{site['per_step']:.2f}"
        print(f"  {site['site']:<60} {site['count']:>6} {per_step:>9}  "
              f"{','.join(site['threads'])}")
        for frame in site["stack"]:
            print(f"      {frame}")
        print(f"      -> {site['callee']}")


def quantiles(ordered: Sequence[float]) -> str:
    """``min/median/max`` of sorted values, compactly."""
    return "/".join(f"{v:.3g}" for v in (ordered[0], ordered[len(ordered) // 2], ordered[-1]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a model directory (default: a tiny one)")
    p.add_argument("--family", choices=tuple(MODEL_VARIANTS), default="z-image",
                   help="the tiny model's family, without --model")
    p.add_argument("--steps", type=int, default=8, help="denoise steps of every request")
    p.add_argument("--requests", type=int, default=6, help="low-priority requests a round")
    p.add_argument("--urgent", type=int, default=3, help="high-priority requests a round")
    p.add_argument("--sizes", default=None, help="WxH list of the low-priority requests "
                   f"(default {SIZES['cuda']}; dry run {SIZES['cpu']})")
    p.add_argument("--urgent-size", default=None, help="WxH of the high-priority ones "
                   f"(default {URGENT_SIZE['cuda']}; dry run {URGENT_SIZE['cpu']})")
    p.add_argument("--policy", choices=("priority", "fcfs", "both"), default="both")
    p.add_argument("--warmup-rounds", type=int, default=1)
    p.add_argument("--sync-steps", type=int, default=None,
                   help="run only the measured round's first N denoise steps under sync-debug "
                   "mode (default: all; the mode can slow a step by seconds)")
    p.add_argument("--no-stacks", action="store_true",
                   help="count the synchronizing calls per step without walking their stacks "
                   "(no sites table): tells torch's cost of warning from the recording's")
    p.add_argument("--serve-args", default="", help="more `ditserve serve` engine flags")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a round may take")
    p.add_argument("--dry-run", action="store_true",
                   help="the same workload on the CPU, without sync debug mode")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.dry_run and not torch.cuda.is_available():
        print("step_syncs needs CUDA: sync debug mode only sees CUDA synchronizations "
              "(--dry-run runs the workload on the CPU)", file=sys.stderr)
        return 2
    where = "cpu" if args.dry_run else "cuda"
    sizes = (args.sizes or SIZES[where]).split(",")
    arrivals = workload(args.requests, args.urgent, sizes, args.urgent_size or URGENT_SIZE[where],
                        args.steps)
    policies = ["priority", "fcfs"] if args.policy == "both" else [args.policy]
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="step-syncs-") as scratch:
        model = args.model
        if model is None:
            model = str(Path(scratch) / f"tiny-{args.family}")
            if ditserve_cli(["model", "init-tiny", model, "--family", args.family]) != 0:
                return 1
        for policy in policies:
            runs[policy] = measure(args, model, policy, arrivals)
            print_run(policy, runs[policy], args.dry_run)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "settings": vars(args), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "device": torch.cuda.get_device_name() if where == "cuda" else "cpu",
            "torch": torch.__version__, "workload": [asdict(a) for a in arrivals],
            "runs": runs}, indent=2))
        print(f"wrote {args.out}")
    return 0 if all(not r["failed"] for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
