#!/usr/bin/env python3
"""Priority replay: the engine's StepScheduler over a recorded ``bench/serving.py --priority``
trace, on a model of step times instead of a GPU (issue 47's high-priority latency target).

Pure Python, no model. A step lasts ``--step-base-ms`` + ``--step-ms-per-ktoken`` x the rows x
tokens it denoises (compute-bound: Z-Image on one H200 measured 152.5 ms at b1 and 587.6 ms at
b4 for 1024x1024, 4096 tokens a row), plus ``--encode-ms`` per admitted request and
``--decode-ms-per-mpixel`` per decoded megapixel. As on the engine, the step loop plans step N+1
when step N starts on the GPU (``engine.runner.inflight``), so a request arriving during step N
is first planned into step N+2; the ``lookahead 0`` row plans at step ends instead. It
prints, per scheduling variant, the high-priority p50/p90 and their ratio to the modelled idle
latency, and one lower bound: the same trace with the
low-priority requests removed (the high-priority class alone on the GPU), which no handling
of the low-priority work can beat on this loop. Below it, a bound no scheduler can beat at
all: each high-priority request's own work on the model (its steps' per-token time, its encode
and decode, none of the per-step base that batching could share), run one at a time in
arrival order - the order that minimizes the largest latency on one machine - so the largest
high-priority latency can be no lower; with fewer than ten of them this bench's p90 is that
largest one. If it is above the target, the target cannot be met on this trace and GPU:

    python3 bench/priority_replay.py --trace z-prio.json

``--trace`` is the JSON that ``bench/serving.py --priority --out`` writes (its ``trace``,
``size`` and ``steps``); without it a seeded Poisson trace of the same shape is drawn.

``--fit-log`` (the servers' logs of that run, ``<out>-<policy>.server-N.log``) fits the
forward part of the model to the GPU that ran it: each ``engine.steps`` summary line gives a
window's step count, mean forward GPU time and mean rows x tokens, and a weighted least-squares
line through the windows (the first window of each log left out: it holds the warm-up's
first-use costs) replaces ``--step-base-ms`` and ``--step-ms-per-ktoken``. It also prints
each window's wall time outside the forwards (encodes, decodes, and whatever else kept the GPU
from the next forward), which the model charges only as encode and decode.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ditserve.engine.config import SchedulerConfig
from ditserve.engine.request import SamplingParams
from ditserve.engine.sched.scheduler import DEFAULT_WORK_RULE, StepScheduler
from ditserve.engine.sched.work import ResolvedScheduling
from ditserve.engine.step.plan import RunnerOutput

LOW_SIZES = ("512x512", "768x768", "1024x1024", "1360x768")


@dataclass(frozen=True)
class Arrival:
    at: float
    priority: int
    size: str


@dataclass(frozen=True)
class StepModel:
    """Seconds one step takes, from the work it does."""

    # Z-Image on one H200 (docs/benchmarks.md, issue 47): 152.5 ms a 1024x1024 step at b1,
    # 587.6 ms at b4; encode 63.1 ms, decode 91.3 ms a 1024x1024 image.
    base_ms: float = 7.45
    ms_per_ktoken: float = 35.41
    encode_ms: float = 63.1
    decode_ms_per_mpixel: float = 91.3

    def seconds(self, tokens: int, encoded: int, decoded_pixels: int) -> float:
        ms = (self.base_ms + self.ms_per_ktoken * tokens / 1000 + self.encode_ms * encoded
              + self.decode_ms_per_mpixel * decoded_pixels / 2**20)
        return ms / 1000


# One ``engine.steps`` summary (engine/loop/step_log.py): steps, wall s, mean forward ms, rows
# x tokens a step.
SUMMARY = re.compile(r"(\d+) steps in ([\d.]+) s: step ([\d.]+) ms mean .*?/ ([\d.]+) tokens")


@dataclass(frozen=True)
class Window:
    """One step-log summary: ``steps`` forwards of ``forward_ms`` mean GPU time over
    ``tokens`` mean rows x tokens, in ``wall_s`` seconds."""

    steps: int
    wall_s: float
    forward_ms: float
    tokens: float

    @property
    def outside_s(self) -> float:
        """Wall time of the window not spent in forwards."""
        return self.wall_s - self.steps * self.forward_ms / 1000


def log_windows(text: str, *, skip: int = 1) -> list[Window]:
    """The step-log windows of one server log, the first ``skip`` left out (warm-up)."""
    found = [Window(int(m[1]), float(m[2]), float(m[3]), float(m[4]))
             for m in SUMMARY.finditer(text)]
    return found[skip:]


def fit_forward(windows: list[Window]) -> tuple[float, float]:
    """(base ms, ms per 1000 tokens) of the line through the windows' mean forward times,
    each weighted by its step count (the mean of a linear model is the model of the mean)."""
    weight = sum(w.steps for w in windows)
    mean_x = sum(w.steps * w.tokens / 1000 for w in windows) / weight
    mean_y = sum(w.steps * w.forward_ms for w in windows) / weight
    spread = sum(w.steps * (w.tokens / 1000 - mean_x) ** 2 for w in windows)
    if spread <= 0:
        raise ValueError("the windows' mean tokens do not differ: no line to fit")
    slope = sum(w.steps * (w.tokens / 1000 - mean_x) * (w.forward_ms - mean_y)
                for w in windows) / spread
    return mean_y - slope * mean_x, slope


def load_trace(path: str) -> tuple[list[Arrival], str, int]:
    data = json.loads(Path(path).read_text())
    size = data["size"]
    return ([Arrival(a["arrival_s"], a["priority"], a["size"] or size) for a in data["trace"]],
            size, int(data["steps"]))


def draw_trace(count: int, rate: float, high_share: float, size: str, seed: int
               ) -> list[Arrival]:
    rng, at, out = random.Random(seed), 0.0, []
    for _ in range(count):
        high = rng.random() < high_share
        out.append(Arrival(at, -1 if high else 1, size if high else rng.choice(LOW_SIZES)))
        at += rng.expovariate(rate)
    return out


def params(arrival: Arrival, steps: int) -> SamplingParams:
    width, height = (int(v) for v in arrival.size.split("x"))
    return SamplingParams(prompt="p", height=height, width=width, num_inference_steps=steps,
                          priority=arrival.priority)


def replay(trace: list[Arrival], steps: int, model: StepModel, config: SchedulerConfig, *,
           lookahead: int = 1, plan_at: float = 0.0) -> dict[str, float]:
    """Latency (seconds from arrival to output) of every request, keyed by trace index.

    ``lookahead`` 1 is the engine's step loop (``engine.runner.inflight``): it plans and
    queues step N+1 as soon as step N starts on the GPU, so a step's admissions and pauses
    are decided one GPU step before it runs; 0 plans each step when the previous one ended.
    ``plan_at`` (with lookahead 1) is the engine's ``scheduler.plan_at``: the loop plans step
    N+1 once step N is that fraction through on the GPU.
    A request's output is ready when the step that decoded it ends."""
    host = gpu_free = 0.0  # when the loop plans next; when the GPU has run all it was given
    s = StepScheduler(ResolvedScheduling.for_family(config), clock=lambda: host)
    pending = sorted(range(len(trace)), key=lambda i: trace[i].at)
    done: dict[str, float] = {}
    for _ in range(100_000):
        while pending and trace[pending[0]].at <= host:
            i = pending.pop(0)
            request = params(trace[i], steps)
            s.add(str(i), request, DEFAULT_WORK_RULE.of(request), arrived_at=trace[i].at)
        if not s.has_work():
            if not pending:
                return done
            host = max(gpu_free, trace[pending[0]].at)  # an idle loop flushes, then waits
            continue
        plan = s.schedule()
        tokens = sum(s.get(rid).work.tokens for rid in plan.denoise)  # type: ignore[union-attr]
        pixels = sum(params(trace[int(rid)], steps).height * params(trace[int(rid)], steps).width
                     for rid in plan.decode)
        start = max(host, gpu_free)
        end = start + model.seconds(tokens, len(plan.encode), pixels)
        # Lookahead 1: the loop goes on once the step before this one has ended (its fence).
        host, gpu_free = (start + plan_at * (end - start) if lookahead else end), end
        s.update(plan, RunnerOutput(stepped=list(plan.denoise), decoded=list(plan.decode),
                                    finished={rid: None for rid in plan.decode}))
        for rid in plan.decode:
            done[rid] = end - trace[int(rid)].at
    raise SystemExit("the scheduler stopped making progress")


def own_work_s(model: StepModel, arrival: Arrival, steps: int) -> float:
    """A request's work on the GPU that no batching can share: its rows x tokens at every
    step, one encode, one decode (the per-step base left out, as a batch amortizes it)."""
    request = params(arrival, steps)
    tokens = DEFAULT_WORK_RULE.of(request).tokens
    return model.seconds(steps * tokens, 1, request.height * request.width) - model.base_ms / 1000


def largest_latency_bound(arrivals: list[Arrival], steps: int, model: StepModel) -> float:
    """The smallest possible largest latency of ``arrivals`` on one GPU: their own work in
    arrival order (on one machine, first come first served minimizes the largest flow time,
    preemptive or not), nothing else on the GPU."""
    free, worst = 0.0, 0.0
    for arrival in sorted(arrivals, key=lambda a: a.at):
        free = max(free, arrival.at) + own_work_s(model, arrival, steps)
        worst = max(worst, free - arrival.at)
    return worst


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] if ordered else float("nan")


def variants(max_num_seqs: int) -> dict[str, SchedulerConfig]:
    def config(policy: str, companions: int | None = None, **kw: Any) -> SchedulerConfig:
        return SchedulerConfig(max_num_seqs=max_num_seqs, scheduling_policy=policy,
                               urgent_companions=companions, **kw)
    return {"fcfs": config("fcfs"), "priority": config("priority"),
            "priority K=1": config("priority", 1), "priority K=0": config("priority", 0)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=None, help="bench/serving.py --priority's JSON")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--rate", type=float, default=2.56, help="arrivals a second (no --trace)")
    p.add_argument("--high-share", type=float, default=0.25)
    p.add_argument("--size", default="1024x1024")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-base-ms", type=float, default=StepModel.base_ms)
    p.add_argument("--step-ms-per-ktoken", type=float, default=StepModel.ms_per_ktoken)
    p.add_argument("--encode-ms", type=float, default=StepModel.encode_ms)
    p.add_argument("--decode-ms-per-mpixel", type=float, default=StepModel.decode_ms_per_mpixel)
    p.add_argument("--fit-log", action="append", default=[],
                   help="a server log of the traced run: fit base and ms per ktoken to it")
    args = p.parse_args(argv)
    if args.fit_log:
        windows = []
        for path in args.fit_log:
            for w in log_windows(Path(path).read_text()):
                windows.append(w)
                print(f"{Path(path).name}: {w.steps} steps, {w.tokens:.0f} tokens, forward "
                      f"{w.forward_ms:.0f} ms, {w.outside_s:.2f} s of {w.wall_s:.1f} outside")
        args.step_base_ms, args.step_ms_per_ktoken = fit_forward(windows)
        print(f"fitted: step {args.step_base_ms:.2f} ms + {args.step_ms_per_ktoken:.2f} ms "
              f"per 1000 rows x tokens")
    if args.trace:
        trace, size, steps = load_trace(args.trace)
    else:
        size, steps = args.size, args.steps
        trace = draw_trace(args.requests, args.rate, args.high_share, size, args.seed)
    model = StepModel(args.step_base_ms, args.step_ms_per_ktoken, args.encode_ms,
                      args.decode_ms_per_mpixel)
    idle = replay([Arrival(0.0, -1, size)], steps, model, SchedulerConfig())["0"]
    high = [str(i) for i, a in enumerate(trace) if a.priority < 0]
    configs = variants(args.max_num_seqs)
    runs = {name: replay(trace, steps, model, config) for name, config in configs.items()}
    runs["priority K=0, lookahead 0"] = replay(trace, steps, model, configs["priority K=0"],
                                               lookahead=0)
    for k in (1, 0):  # --plan-at 0.8 (engine.runner.plan_point)
        runs[f"priority K={k}, plan at 0.8"] = replay(trace, steps, model,
                                                    configs[f"priority K={k}"], plan_at=0.8)
    only_high = [a if a.priority < 0 else Arrival(a.at, 1, "") for a in trace]
    bound = replay([a for a in only_high if a.size], steps, model,
                   SchedulerConfig(max_num_seqs=args.max_num_seqs))
    print(f"modelled idle latency of one {size} {steps}-step request: {idle:.2f} s; "
          f"{len(high)} high-priority of {len(trace)}")
    print(f"{'run':<26} {'high p50':>9} {'high p90':>9} {'p90/idle':>9} {'low p50':>8} "
          f"{'makespan':>9}")
    for name, done in runs.items():
        lat = [done[i] for i in high]
        low = [v for k, v in done.items() if k not in high]
        span = max(trace[int(k)].at + v for k, v in done.items())
        print(f"{name:<26} {statistics.median(lat):>9.2f} {p90(lat):>9.2f} "
              f"{p90(lat) / idle:>8.2f}x {statistics.median(low):>8.2f} {span:>9.2f}")
    lat = list(bound.values())
    print(f"{'high-priority alone':<26} {statistics.median(lat):>9.2f} {p90(lat):>9.2f} "
          f"{p90(lat) / idle:>8.2f}x {'-':>8} {'-':>9}")
    urgent = [a for a in trace if a.priority < 0]
    if urgent:
        floor = largest_latency_bound(urgent, steps, model)
        work = sum(own_work_s(model, a, steps) for a in urgent)
        span = max(a.at for a in urgent) - min(a.at for a in urgent)
        busy = f"{work / span:.0%} of the GPU between the first and last arrival" if span else \
            "all arriving at once"
        print(f"{'bound: any schedule':<26} {'':>9} {floor:>9.2f} {floor / idle:>8.2f}x "
              f"(largest high-priority latency; their own work alone: {work:.2f} s, {busy})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
