"""Per-step control overhead of a multi-process replica: rank 0 <-> worker messages alone.

Starts a real data-parallel executor (rank 0 in this process, spawned workers, the embedded
tiny model on the CPU over gloo by default) and times steps that compute nothing - every rank
runs the idle plan - so what is left is what every engine step pays for control: rank 0
sending each stepping worker its step, the workers answering, rank 0 receiving the replies.
Two step modes, as the engine runs them:

  together  every rank in one step (how ranks step under DLO AllGather, whose weight loads
            are collectives; offload is on here, but an idle step issues no gather)
  alone     one worker's step (how each rank steps at its own pace without a weight
            collective; the step of worker 1, whose loop is one of several in the engine)

Prints a table of microseconds per step (median, p10, p90, mean) per dp size and mode.

    python bench/control_overhead.py [--dp 2,3] [--steps 300] [--device cpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from ditserve.engine.config import EngineConfig, OffloadConfig, ParallelConfig, RunnerConfig
from ditserve.engine.executor import RankWork
from ditserve.engine.loop.startup import make_executor, resolve_model

WARM_STEPS = 20  # first steps pay for connection set-up and lazy allocation


def time_steps(step: Callable[[], object], steps: int) -> list[float]:
    for _ in range(WARM_STEPS):
        step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return times


def measure(dp: int, mode: str, *, steps: int, device: str) -> dict[str, object]:
    config = EngineConfig(device=device, parallel=ParallelConfig(data_parallel_size=dp),
                          offload=OffloadConfig(enabled=mode == "together"))
    executor = make_executor(RunnerConfig.of(config), parallel=config.parallel,
                             model_dir=resolve_model(config))
    try:
        if mode == "together":
            assert executor.step_groups == (tuple(range(dp)),), "expected one lockstep group"
            work = {rank: RankWork.idle() for rank in range(dp)}
        else:
            assert len(executor.step_groups) == dp, "expected one group per rank"
            work = {1: RankWork.idle()}
        times = time_steps(lambda: executor.step(work), steps)
    finally:
        executor.shutdown()
    micros = [t * 1e6 for t in times]
    deciles = statistics.quantiles(micros, n=10)
    return {"dp": dp, "mode": mode, "steps": steps, "median_us": statistics.median(micros),
            "p10_us": deciles[0], "p90_us": deciles[-1], "mean_us": statistics.fmean(micros)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", default="2,3", help="comma-separated data-parallel sizes")
    parser.add_argument("--modes", default="together,alone")
    parser.add_argument("--steps", type=int, default=300, help="timed steps per cell")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args()

    rows = [measure(int(dp), mode, steps=args.steps, device=args.device)
            for dp in args.dp.split(",") for mode in args.modes.split(",")]
    print(f"\n{'dp':>3} {'mode':<9} {'median us':>10} {'p10 us':>8} {'p90 us':>8} {'mean us':>8}")
    for r in rows:
        print(f"{r['dp']:>3} {r['mode']:<9} {r['median_us']:>10.0f} {r['p10_us']:>8.0f} "
              f"{r['p90_us']:>8.0f} {r['mean_us']:>8.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
