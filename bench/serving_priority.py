#!/usr/bin/env python3
"""Priority benchmark (``bench/serving.py --priority``): interactive requests in a batch stream.

One seeded trace: a saturating Poisson stream of low-priority requests (priority 1, default
1024x1024, 20 steps) with a share (default 10%) of high-priority ones (priority -1, same size
and steps). Two launched servers, one after the other, on the same trace:

- ``priority``: ``--scheduling-policy priority``. First, idle, the high-priority request alone
  ``--idle-requests`` times one after the other (its idle p90), then the trace.
- ``fcfs``: ``--scheduling-policy fcfs`` (arrival order: priorities ignored).

It prints one table (per server: throughput, p50/p90 of each class, preemptions from
/metrics) and the issue's targets as ok/NO rows: high-priority p90 under the trace <= 1.3x
its idle p90 (``--latency-target``; issue 47's Z-Image target is 1.5x), and total throughput
>= 0.95x fcfs's. ``--tiny`` is a CPU smoke run on the embedded tiny model (64x64, 4 steps).
Everything goes to ``--out`` as JSON.

A mixed load (issue 47): ``--low-sizes`` draws each low-priority request's size from a list
(seeded; the high-priority ones keep ``--priority-size``), and ``--rate-of-idle K`` sets the
trace's rate to K / (the idle high-priority p50), measured first on the priority server, so
"4x the rate an idle replica serves" is ``--rate-of-idle 4`` on any GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

HIGH, LOW = -1, 1
TARGET_LATENCY = 1.3  # high-priority p90 under load / idle p90, at most (--latency-target)
TARGET_THROUGHPUT = 0.95  # priority req/s / fcfs req/s, at least


@dataclass(frozen=True)
class Arrival:
    index: int
    arrival_s: float
    priority: int
    size: str | None = None  # None: the run's --priority-size


@dataclass
class Outcome:
    index: int
    priority: int
    arrival_s: float
    status: int
    latency_s: float
    finished_s: float
    error: str | None = None
    # The server's queue_seconds: arrival to admission into a step plan (issue 47: splits a
    # high-priority latency into waiting for a step boundary and running its steps).
    queue_s: float | None = None


def trace(count: int, rate: float, high_share: float, seed: int,
          low_sizes: list[str] | None = None) -> list[Arrival]:
    """Poisson arrivals at ``rate``/s (<= 0: all at once); each high priority with
    probability ``high_share``, at least one of each class when ``count`` >= 2; a
    low-priority one of a size drawn from ``low_sizes`` when given."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(count):
        priority = HIGH if rng.random() < high_share else LOW
        size = rng.choice(low_sizes) if low_sizes else None
        out.append(Arrival(i, t, priority, size if priority == LOW else None))
        if rate > 0:
            t += rng.expovariate(rate)
    if count >= 2 and len({a.priority for a in out}) == 1:  # a tiny trace still has both
        first = out[count // 2]
        flipped = -first.priority
        out[count // 2] = Arrival(first.index, first.arrival_s, flipped,
                                  first.size if flipped == LOW else None)
    return out


async def send(url: str, arrivals: list[Arrival], *, size: str, steps: int, timeout: float,
               headers: dict[str, str]) -> list[Outcome]:
    async with httpx.AsyncClient(timeout=timeout, headers=headers) as client:
        start = time.monotonic()

        async def one(a: Arrival) -> Outcome:
            await asyncio.sleep(max(0.0, a.arrival_s - (time.monotonic() - start)))
            sent = time.monotonic()
            body = {"prompt": f"request {a.index}", "size": a.size or size,
                    "num_inference_steps": steps, "priority": a.priority, "seed": a.index}
            try:
                r = await client.post(f"{url}/v1/images/generations", json=body)
                status, error = r.status_code, None if r.status_code == 200 else r.text[:300]
                meta = r.json().get("ditserve", {}) if status == 200 else {}
                queued = meta.get("queue_seconds")
            except httpx.HTTPError as e:
                status, error, queued = 0, f"{type(e).__name__}: {e}", None
            done = time.monotonic()
            return Outcome(a.index, a.priority, a.arrival_s, status, done - sent, done - start,
                           error, queued)

        return list(await asyncio.gather(*(one(a) for a in arrivals)))


def p(values: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def summary(outcomes: list[Outcome]) -> dict[str, Any]:
    ok = [o for o in outcomes if o.status == 200]
    duration = max((o.finished_s for o in ok), default=0.0) - min(
        (o.arrival_s for o in outcomes), default=0.0)
    out: dict[str, Any] = {"requests": len(outcomes), "ok": len(ok),
                           "errors": len(outcomes) - len(ok), "duration_s": duration,
                           "throughput_rps": len(ok) / duration if duration > 0 else None}
    for name, level in (("high", HIGH), ("low", LOW)):
        latencies = [o.latency_s for o in ok if o.priority == level]
        out[f"{name}_count"] = len(latencies)
        out[f"{name}_p50_s"], out[f"{name}_p90_s"] = p(latencies, 0.5), p(latencies, 0.9)
    queued = [o.queue_s for o in ok if o.priority == HIGH and o.queue_s is not None]
    out["high_queue_p50_s"], out["high_queue_p90_s"] = p(queued, 0.5), p(queued, 0.9)
    return out


def targets(idle_p90: float | None, runs: dict[str, dict[str, Any]],
            latency_target: float = TARGET_LATENCY
            ) -> list[tuple[str, float | None, bool | None]]:
    """(target, measured ratio, met) rows; None where a run is missing."""
    prio, fcfs = runs.get("priority", {}), runs.get("fcfs", {})
    high = prio.get("high_p90_s")
    latency = high / idle_p90 if high is not None and idle_p90 else None
    rps, base = prio.get("throughput_rps"), fcfs.get("throughput_rps")
    throughput = rps / base if rps is not None and base else None
    return [(f"high-priority p90 <= {latency_target}x idle p90", latency,
             None if latency is None else latency <= latency_target),
            (f"throughput >= {TARGET_THROUGHPUT}x fcfs", throughput,
             None if throughput is None else throughput >= TARGET_THROUGHPUT)]


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_report(idle_p90: float | None, runs: dict[str, dict[str, Any]], *,
                 with_targets: bool = True, latency_target: float = TARGET_LATENCY) -> None:
    head = (f"{'policy':<10} {'ok/n':>7} {'req/s':>7} {'high p50':>9} {'high p90':>9} "
            f"{'low p50':>8} {'low p90':>8} {'preempt':>8} {'paused s':>9} {'high queue p90':>15}")
    print(head)
    print("-" * len(head))
    for name, s in runs.items():
        print(f"{name:<10} {s['ok']:>3}/{s['requests']:<3} {_fmt(s['throughput_rps'], '.3f'):>7} "
              f"{_fmt(s['high_p50_s']):>9} {_fmt(s['high_p90_s']):>9} {_fmt(s['low_p50_s']):>8} "
              f"{_fmt(s['low_p90_s']):>8} {_fmt(s.get('preemptions'), '.0f'):>8} "
              f"{_fmt(s.get('paused_seconds')):>9} {_fmt(s.get('high_queue_p90_s')):>15}")
    if not with_targets:
        return
    print(f"idle high-priority p90: {_fmt(idle_p90)} s")
    for target, ratio, met in targets(idle_p90, runs, latency_target):
        verdict = "-" if met is None else ("ok" if met else "NO")
        print(f"  {target:<40} {_fmt(ratio)}x  {verdict}")


def add_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("priorities (--priority)")
    g.add_argument("--priority", action="store_true",
                   help="the priority benchmark (bench/serving_priority.py)")
    g.add_argument("--high-share", type=float, default=0.1,
                   help="share of high-priority requests in the trace")
    g.add_argument("--idle-requests", type=int, default=5,
                   help="high-priority requests sent alone for the idle p90")
    g.add_argument("--priority-size", default="1024x1024", help="WxH of every request")
    g.add_argument("--priority-steps", type=int, default=20, help="steps of every request")
    g.add_argument("--aging-s", type=float, default=None,
                   help="--priority-aging-s of the priority server (default: the engine's)")
    g.add_argument("--low-sizes", default=None,
                   help="WxH list: each low-priority request's size, drawn (a mixed load)")
    g.add_argument("--rate-of-idle", type=float, default=None,
                   help="trace rate = this x 1 / idle high-priority p50 (overrides --rate)")
    g.add_argument("--latency-target", type=float, default=TARGET_LATENCY,
                   help="high-priority p90 / idle p90 bound judged (issue 47: 1.5)")


def main(args: argparse.Namespace, serving: Any, headers: dict[str, str]) -> int:
    """Run the benchmark; ``serving`` is bench/serving.py (launch, stop, scrape_metrics)."""
    size, steps = args.priority_size, args.priority_steps
    if args.tiny:
        args.serve_args = f"--device cpu {args.serve_args}".strip()
        size, steps = "64x64", 4
    low_sizes = args.low_sizes.split(",") if args.low_sizes else None
    arrivals = trace(args.requests, args.rate, args.high_share, args.seed, low_sizes)
    idle = [Arrival(i, 0.0, HIGH) for i in range(args.idle_requests)]
    out = Path(args.out)
    runs: dict[str, dict[str, Any]] = {}
    idle_p90: float | None = None
    records: dict[str, Any] = {}
    interrupted = False
    try:
        idle_p90 = _run_servers(args, serving, headers, arrivals, idle, size, steps, runs,
                                records)
    except KeyboardInterrupt:  # `timeout -s TERM`: report the servers that finished
        interrupted = True
        print("interrupted; reporting the finished servers", file=sys.stderr)
        idle_p90 = records.pop("idle_p90", None)
    if not runs:
        return 130 if interrupted else 1
    print()
    print_report(idle_p90, runs, latency_target=args.latency_target)
    arrivals = records.pop("trace", arrivals)
    out.write_text(json.dumps({
        "settings": vars(args), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "size": size, "steps": steps, "trace": [asdict(a) for a in arrivals],
        "idle_high_p90_s": idle_p90, "runs": runs, "records": records,
        "targets": [{"target": t, "ratio": r, "met": m}
                    for t, r, m in targets(idle_p90, runs, args.latency_target)],
    }, indent=2))
    print(f"wrote {out}")
    if interrupted:
        return 130
    return 0 if all(s["errors"] == 0 for s in runs.values()) else 1


def _run_servers(args: argparse.Namespace, serving: Any, headers: dict[str, str],
                 arrivals: list[Arrival], idle: list[Arrival], size: str, steps: int,
                 runs: dict[str, dict[str, Any]], records: dict[str, Any]) -> float | None:
    """Launch the priority server, then the fcfs one; fill ``runs`` and ``records`` as each
    finishes; return the idle high-priority p90."""
    out = Path(args.out)
    max_num_seqs = int(args.max_num_seqs.split(",")[-1])
    idle_p90: float | None = None
    for policy in ("priority", "fcfs"):
        flags = f"--scheduling-policy {policy}"
        if policy == "priority" and args.aging_s is not None:
            flags += f" --priority-aging-s {args.aging_s}"
        run = argparse.Namespace(**{**vars(args), "serve_args": f"{args.serve_args} {flags}",
                                    "out": str(out.with_name(f"{out.stem}-{policy}.json"))})
        process, url = serving.launch(run, max_num_seqs)

        def go(batch: list[Arrival], url: str = url) -> list[Outcome]:
            return asyncio.run(send(url, batch, size=size, steps=steps, timeout=args.timeout,
                                    headers=headers))

        try:
            # Warm-up, not measured, the same on both servers: alone, then a full batch.
            go(idle[:1])
            go([Arrival(i, 0.0, LOW) for i in range(max_num_seqs)])
            if policy == "priority":
                alone = [go([a])[0] for a in idle]  # one after the other: an idle server
                served = [o.latency_s for o in alone if o.status == 200]
                idle_p90 = p(served, 0.9)
                records["idle"], records["idle_p90"] = [asdict(o) for o in alone], idle_p90
                idle_p50 = p(served, 0.5)
                if args.rate_of_idle and idle_p50:
                    # K times the rate an idle replica serves these requests at; the fcfs
                    # server gets the same trace.
                    rate = args.rate_of_idle / idle_p50
                    arrivals[:] = trace(args.requests, rate, args.high_share, args.seed,
                                        args.low_sizes.split(",") if args.low_sizes else None)
                    records["trace_rate"], records["trace"] = rate, arrivals
            before = serving.scrape_metrics(url, headers)
            outcomes = go(arrivals)
            after = serving.scrape_metrics(url, headers)
        except BaseException:
            serving.stop(process, force=True)
            raise
        serving.stop(process)
        runs[policy] = summary(outcomes) | {
            "preemptions": after.get("ditserve:num_preemptions_total", 0.0)
            - before.get("ditserve:num_preemptions_total", 0.0),
            "paused_seconds": after.get("ditserve:request_paused_seconds_sum", 0.0)
            - before.get("ditserve:request_paused_seconds_sum", 0.0)}
        records[policy] = [asdict(o) for o in outcomes]
        print_report(idle_p90, {policy: runs[policy]}, with_targets=False)
    records.pop("idle_p90", None)
    return idle_p90


if __name__ == "__main__":
    print("run it as: python bench/serving.py --priority ...", file=sys.stderr)
    sys.exit(2)
