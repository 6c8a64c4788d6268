#!/usr/bin/env python3
"""Admission replay: the engine's StepScheduler over the mixed serving workload, with and
without LoRA adapters, and the rows a step that each gets (issue 45, item 13). Pure Python:
no model, no GPU, a perfect runner (every planned request steps; decodes finish at once).

The workload is ``bench/serving.py --mixed``'s (1024x1024, 768x768, 512x512, 1344x768; 8-20
steps; 20% true CFG; 10% n=2), seeded; in the adapter run request i names adapter i mod 4
(ranks ``--ranks``). Arrivals: all at once (``--every 0``, the saturated case where the
budget binds), or one request every N steps. It prints, per run, the steps to serve every
request, the mean rows and requests a step, and the steps whose admissions differ from the
adapter-free run's:

    python3 bench/admission.py --requests 40 --every 0 2 5

On the H200 the same question is asked of a real server by ``bench/serving.py --mixed
--mixed-configs dlo:4,dlo+lora:4`` (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from ditserve.engine.config import SchedulerConfig
from ditserve.engine.request import LoraRef, SamplingParams
from ditserve.engine.sched.scheduler import StepScheduler
from ditserve.engine.sched.work import ResolvedScheduling, WorkRule
from ditserve.engine.step.plan import RunnerOutput, StepPlan

SIZES = ((1024, 1024), (768, 768), (512, 512), (1344, 768))


def workload(count: int, seed: int) -> list[SamplingParams]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        width, height = rng.choice(SIZES)
        steps, cfg, n = rng.randint(8, 20), rng.random() < 0.2, 2 if rng.random() < 0.1 else 1
        out.append(SamplingParams(prompt="p", height=height, width=width, num_images=n,
                                  num_inference_steps=steps,
                                  negative_prompt="blurry" if cfg else None,
                                  true_cfg_scale=4.0 if cfg else 1.0))
    return out


def replay(requests: list[SamplingParams], *, every: int, max_num_seqs: int,
           max_loras: int) -> list[StepPlan]:
    config = ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=max_num_seqs),
                                           max_loras=max_loras)
    s, rule, plans, added = StepScheduler(config, clock=lambda: 0.0), WorkRule(), [], 0
    while added < len(requests) or s.has_work():
        while added < len(requests) and added * every <= len(plans):
            s.add(str(added), requests[added], rule.of(requests[added]))
            added += 1
        plan = s.schedule()
        out = RunnerOutput(stepped=list(plan.denoise), decoded=list(plan.decode))
        out.finished = {rid: None for rid in plan.decode}
        s.update(plan, out)
        plans.append(plan)
        if len(plans) > 100 * max(1, len(requests)) * (every + 1):
            raise SystemExit("the scheduler stopped making progress")
    return plans


def summary(requests: list[SamplingParams], plans: list[StepPlan]) -> dict[str, float]:
    rule = WorkRule()
    busy = [p for p in plans if p.denoise]
    rows = [sum(rule.rows(requests[int(rid)]) for rid in p.denoise) for p in busy]
    return {"steps": len(busy), "rows_per_step": sum(rows) / len(busy),
            "requests_per_step": sum(len(p.denoise) for p in busy) / len(busy)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--every", type=int, nargs="+", default=[0, 2, 5],
                   help="steps between arrivals (0: all at once); one run each")
    p.add_argument("--ranks", default="16,32,64,128", help="the adapters' ranks")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the table as JSON here")
    args = p.parse_args(argv)
    ranks = [int(r) for r in args.ranks.split(",")]
    adapters = [LoraRef(f"a{i}", f"/a{i}.safetensors", rank=r, version=i)
                for i, r in enumerate(ranks)]
    rows: list[dict[str, Any]] = []
    print(f"{'arrivals':<14} {'run':<10} {'steps':>6} {'rows/step':>10} {'reqs/step':>10} "
          f"{'differing steps':>16}")
    for every in args.every:
        plain = workload(args.requests, args.seed)
        adapted = [replace(r, loras=(adapters[i % len(adapters)],)) for i, r in enumerate(plain)]
        runs = {name: replay(reqs, every=every, max_num_seqs=args.max_num_seqs,
                             max_loras=args.max_loras)
                for name, reqs in (("plain", plain), ("adapters", adapted))}
        base = [(p.encode, p.denoise) for p in runs["plain"]]
        for name, reqs in (("plain", plain), ("adapters", adapted)):
            plans = runs[name]
            decisions = [(p.encode, p.denoise) for p in plans]
            differ = sum(a != b for a, b in zip(decisions, base, strict=False)) + abs(
                len(decisions) - len(base))
            row = {"every": every, "run": name, **summary(reqs, plans), "differing": differ}
            rows.append(row)
            label = "all at once" if every == 0 else f"1 per {every} steps"
            print(f"{label:<14} {name:<10} {row['steps']:>6} {row['rows_per_step']:>10.2f} "
                  f"{row['requests_per_step']:>10.2f} {differ:>16}")
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "runs": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
