"""Continuous-batching benchmark: throughput and latency vs max_num_seqs.

Submits a fixed set of concurrent requests (mixed step counts, fixed seeds) to an engine
with max_num_seqs 1, 2, 4, 8 and prints a table of images/s, mean/p90 latency and the mean
number of rows per denoise forward. Defaults run on CPU with the embedded tiny model.

    python bench/batching.py [--model DIR] [--requests 16] [--size 64] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from ditserve.engine.config import EngineConfig, SchedulerConfig
from ditserve.engine.loop.engine import DiffusionEngine
from ditserve.engine.request import SamplingParams


def run(model: str | None, device: str, seqs: int, requests: int, size: int, dtype: str) -> dict:
    config = EngineConfig(model=model, device=device, dtype=dtype,
                          scheduler=SchedulerConfig(max_num_seqs=seqs, max_queue=None))
    engine = DiffusionEngine(config).start()
    try:
        steps = [4, 8, 6, 10]
        started = time.perf_counter()
        handles = [
            engine.add_request(SamplingParams(prompt=f"bench prompt {i}", height=size, width=size,
                                              num_inference_steps=steps[i % len(steps)], seed=i))
            for i in range(requests)
        ]
        results = [h.result() for h in handles]
        wall = time.perf_counter() - started
        stats = engine.stats()
    finally:
        engine.shutdown()
    latencies = sorted(r.latency_seconds for r in results)
    return {
        "max_num_seqs": seqs,
        "requests": requests,
        "images_per_s": requests / wall,
        "mean_latency_s": statistics.fmean(latencies),
        "p90_latency_s": latencies[int(0.9 * (len(latencies) - 1))],
        "forwards": stats.steps_run,
        "mean_rows": stats.mean_batch_rows,
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="diffusers dir (default: tiny model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--seqs", default="1,2,4,8", help="comma-separated max_num_seqs values")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args()

    rows = [run(args.model, args.device, int(s), args.requests, args.size, args.dtype)
            for s in args.seqs.split(",")]
    base = rows[0]["images_per_s"]
    print(f"\n{'max_num_seqs':>12} {'images/s':>9} {'speedup':>8} {'mean lat s':>10} "
          f"{'p90 lat s':>9} {'forwards':>8} {'rows/fwd':>8}")
    for r in rows:
        print(f"{r['max_num_seqs']:>12} {r['images_per_s']:>9.2f} {r['images_per_s'] / base:>7.2f}x "
              f"{r['mean_latency_s']:>10.3f} {r['p90_latency_s']:>9.3f} {r['forwards']:>8} "
              f"{r['mean_rows']:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
