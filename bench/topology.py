#!/usr/bin/env python3
"""Topology study: data-parallel layouts with and without DLO AllGather, Poisson arrivals.

For each layout (``dpN:ag`` AllGather shards, ``dpN:local`` rank-local replicas, ``dp1:resident``
the single-request resident baseline) it starts an engine replica in-process (ranks 1..N-1 are
spawned workers), replays one Poisson workload through the engine API, and reports: per-rank
pinned host bytes (from the offload reports), total host memory of the replica (PSS of every
process, /proc/PID/smaps_rollup), mean denoise-forward time, throughput (images/h), p50/p90
latency, and the throughput ratio to the resident single-request baseline.

    python bench/topology.py --layouts dp1:resident,dp2:ag,dp2:local            # CPU, tiny model
    python bench/topology.py --model DIR --dtype bfloat16 --size 1024 --steps 20 \\
        --layouts dp1:resident,dp4:ag,dp4:local,dp8:ag,dp8:local --requests 32 --rate 0.5

Sequence-parallel layouts (DP1xSP8, DP4xSP2) are not runnable: SP execution is not
implemented yet (the engine refuses sequence_parallel_size > 1).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from ditserve.engine.config import EngineConfig, OffloadConfig, ParallelConfig, SchedulerConfig
from ditserve.engine.loop.engine import DiffusionEngine
from ditserve.engine.request import SamplingParams


@dataclass(frozen=True)
class Layout:
    name: str
    dp: int
    offload: bool
    allgather: bool

    @classmethod
    def parse(cls, text: str) -> Layout:
        dp_part, _, mode = text.partition(":")
        if not dp_part.startswith("dp") or mode not in ("ag", "local", "resident"):
            raise SystemExit(f"bad layout {text!r}: use dpN:ag, dpN:local or dpN:resident")
        dp = int(dp_part[2:])
        return cls(text, dp, offload=mode != "resident", allgather=mode == "ag")


class ForwardTimes:
    """EngineObserver collecting every rank's denoise-forward time."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._lock = threading.Lock()

    def on_step(self, *, requests: int, rows: int, seconds: float, groups: int = 1,
                tokens: int = 0) -> None:
        with self._lock:
            self.seconds.append(seconds)

    def on_finished(self, result: Any) -> None:
        pass

    def on_failed(self, request_id: str, reason: str) -> None:
        print(f"request {request_id} failed: {reason}", file=sys.stderr)


def pss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def workload(n: int, rate: float, steps: list[int], seed: int) -> list[tuple[float, int]]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        out.append((t, steps[i % len(steps)]))
        if rate > 0:
            t += rng.expovariate(rate)
    return out


def run_layout(layout: Layout, args: argparse.Namespace) -> dict[str, Any]:
    # The resident baseline serves one request at a time; the others batch.
    seqs = 1 if not layout.offload and layout.dp == 1 else args.max_num_seqs
    config = EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype,
        parallel=ParallelConfig(data_parallel_size=layout.dp),
        offload=OffloadConfig(enabled=layout.offload, use_allgather=layout.allgather),
        scheduler=SchedulerConfig(max_num_seqs=seqs, max_queue=None),
    )
    times = ForwardTimes()
    started = time.perf_counter()
    engine = DiffusionEngine(config, observers=[times]).start()
    load_s = time.perf_counter() - started
    try:
        reports = []
        report = engine.offload_report()
        if report is not None:
            reports = report.get("ranks") or [report]
        pids = [os.getpid(), *getattr(engine.executor, "worker_pids", dict)().values()]
        plan = workload(args.requests, args.rate, [int(s) for s in args.steps.split(",")],
                        args.seed)
        t0 = time.perf_counter()
        handles = []
        for i, (arrival, steps) in enumerate(plan):
            delay = t0 + arrival - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            handles.append(engine.add_request(SamplingParams(
                prompt=f"topology {i}", height=args.size, width=args.size,
                num_inference_steps=steps, seed=i)))
        results = [h.result() for h in handles]
        wall = time.perf_counter() - t0
        memory = sum(pss_bytes(pid) for pid in pids)
    finally:
        engine.shutdown()
    latencies = sorted(r.latency_seconds for r in results)
    images = sum(len(r.images) for r in results)
    return {
        "layout": layout.name, "dp": layout.dp, "max_num_seqs": seqs, "load_s": load_s,
        "host_weight_bytes_per_rank": [r.get("host_bytes", 0) for r in reports],
        "pinned_host_bytes_per_rank": [r.get("pinned_host_bytes", 0) for r in reports],
        "host_pss_bytes": memory,
        "mean_forward_s": statistics.fmean(times.seconds) if times.seconds else None,
        "images_per_h": images / wall * 3600, "wall_s": wall,
        "p50_latency_s": statistics.median(latencies),
        "p90_latency_s": latencies[int(0.9 * (len(latencies) - 1))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="diffusers dir (default: tiny model)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", default="20", help="comma-separated step counts, cycled")
    parser.add_argument("--layouts", default="dp1:resident,dp2:ag,dp2:local")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--rate", type=float, default=0.0, help="Poisson rate/s (0: all at once)")
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    rows = [run_layout(Layout.parse(text), args) for text in args.layouts.split(",")]
    base = next((r for r in rows if r["layout"].endswith(":resident") and r["dp"] == 1), None)
    gib, mib = 1 << 30, 1 << 20
    print(f"\n{'layout':<14} {'seqs':>4} {'weights/rank MiB':>16} {'pinned/rank MiB':>15} "
          f"{'host PSS GiB':>12} "
          f"{'fwd ms':>8} {'images/h':>10} {'p50 s':>7} {'p90 s':>7} {'vs base':>7}")
    for r in rows:
        weights, pinned = r["host_weight_bytes_per_rank"], r["pinned_host_bytes_per_rank"]
        weights_txt = f"{max(weights) / mib:.2f}" if weights else "-"
        pinned_txt = f"{max(pinned) / mib:.2f}" if pinned else "-"
        fwd = f"{r['mean_forward_s'] * 1000:.1f}" if r["mean_forward_s"] else "-"
        ratio = f"{r['images_per_h'] / base['images_per_h']:.2f}x" if base else "-"
        print(f"{r['layout']:<14} {r['max_num_seqs']:>4} {weights_txt:>16} {pinned_txt:>15} "
              f"{r['host_pss_bytes'] / gib:>12.2f} {fwd:>8} {r['images_per_h']:>10.0f} "
              f"{r['p50_latency_s']:>7.2f} {r['p90_latency_s']:>7.2f} {ratio:>7}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
