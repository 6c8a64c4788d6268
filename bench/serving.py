#!/usr/bin/env python3
"""Serving benchmark: Poisson arrivals against `ditserve serve`, measured like a client.

Sends N generation requests (mixed step counts) whose arrival times are a Poisson process at
``--rate`` requests/s, waits for every response, and reports throughput, client latency
percentiles, server queue time, and - from /metrics deltas - the mean step batch size and
step time. Two ways to run it:

  against a running server:
    python bench/serving.py --url http://127.0.0.1:8000 --requests 32 --rate 4
  launching one server per --max-num-seqs value (same workload, one after the other):
    python bench/serving.py --launch --max-num-seqs 1,4 --serve-args "--offload dlo" ...
  video jobs (/v1/videos; resident vs DLO, its own options: bench/serving_video.py):
    python bench/serving.py video --smoke

It prints a table and writes everything (settings, per-request records, summaries, the
throughput ratio of the last to the first configuration) to ``--out`` as JSON.

``--mixed`` (issue 23) sends a mixed workload instead - several sizes (one non-square), step
counts drawn from a range, a share of true-CFG requests and of n=2 requests, seeded Poisson
arrivals - to one launched server per ``--mixed-configs`` entry (default: DLO at max_num_seqs 1
and 4, and resident at 4), and reports the mean shape groups, rows and tokens per step, req/s,
p50/p90 latency and the issue's targets as ok/NO rows. ``--tiny`` makes that a CPU smoke run
on the embedded tiny model (small sizes, few steps, ``--device cpu``).

Issue 45's two throughput questions are --mixed configurations too. ``MODE+lora:N`` serves
random adapters made for the model (``--adapter-ranks``, default 16,32,64,128, the last a kohya
file; bench/adapter_files.py) and each request names one of them in turn: ``dlo:4,dlo+lora:4``
judges adapters >= 0.95x the adapter-free throughput (and prints the mean rows a step of
both). On a whole-pipeline model (``model init-random --size full``, encoders included),
``dlo:4,resident:4`` judges DLO with streamed encoders (``--offload dlo``'s default) against
resident, and ``dlo-dit:4`` adds DLO of the DiT alone (``--dlo-components dit``); the table
counts encoder passes per request and prompts encoded ahead.

``--priority`` (issue 38; bench/serving_priority.py) sends a saturating low-priority stream
with a share of high-priority requests to a ``--scheduling-policy priority`` server and to an
fcfs one, and judges high-priority p90 against its idle p90 and throughput against fcfs's
(``--tiny``: a CPU smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from harness import percentile, scrape_metrics, step_summary
from job_processes import free_port

from ditserve.engine.loop.step_log import copy_rates_of

GEN = "/v1/images/generations"


@dataclass
class Record:
    index: int
    steps: int
    arrival_s: float
    status: int
    latency_s: float
    queue_s: float | None
    images: int
    finished_s: float
    error: str | None = None


def workload(n: int, rate: float, steps: list[int], seed: int) -> list[tuple[float, int]]:
    """(arrival offset in s, num_inference_steps) per request; rate <= 0 or inf: all at 0."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append((t, rng.choice(steps)))
        if 0 < rate < math.inf:
            t += rng.expovariate(rate)
    return out





async def run_workload(url: str, plan: list[tuple[float, int]], *, size: str, n_images: int,
                       headers: dict[str, str], timeout: float) -> list[Record]:
    limits = httpx.Limits(max_connections=len(plan) + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout,
                                 limits=limits) as client:
        start = time.monotonic()

        async def one(i: int, arrival: float, steps: int) -> Record:
            await asyncio.sleep(max(0.0, start + arrival - time.monotonic()))
            body = {"prompt": f"benchmark prompt {i}: a lighthouse at dusk", "seed": i,
                    "num_inference_steps": steps, "size": size, "n": n_images}
            sent = time.monotonic()
            try:
                response = await client.post(GEN, json=body)
            except httpx.HTTPError as e:
                now = time.monotonic()
                return Record(i, steps, sent - start, 0, now - sent, None, 0, now - start,
                              repr(e))
            now = time.monotonic()
            data = response.json() if response.headers.get("content-type", "").startswith(
                "application/json") else {}
            if response.status_code != 200:
                return Record(i, steps, sent - start, response.status_code, now - sent, None, 0,
                              now - start, json.dumps(data.get("error")))
            meta = data.get("ditserve", {})
            return Record(i, steps, sent - start, 200, now - sent, meta.get("queue_seconds"),
                          len(data.get("data", [])), now - start)

        return list(await asyncio.gather(*(one(i, a, s) for i, (a, s) in enumerate(plan))))


def summarize(records: list[Record], before: dict[str, float], after: dict[str, float]
              ) -> dict[str, Any]:
    ok = [r for r in records if r.status == 200]
    duration = max((r.finished_s for r in records), default=0.0) - min(
        (r.arrival_s for r in records), default=0.0)
    latencies = [r.latency_s for r in ok]
    queues = [r.queue_s for r in ok if r.queue_s is not None]
    return {
        "requests": len(records), "ok": len(ok), "errors": len(records) - len(ok),
        "images": sum(r.images for r in ok), "duration_s": duration,
        "throughput_rps": len(ok) / duration if duration > 0 else None,
        "throughput_images_per_s": sum(r.images for r in ok) / duration if duration else None,
        "latency_mean_s": sum(latencies) / len(latencies) if latencies else None,
        "latency_p50_s": percentile(latencies, 0.5),
        "latency_p90_s": percentile(latencies, 0.9),
        "latency_p99_s": percentile(latencies, 0.99),
        "queue_mean_s": sum(queues) / len(queues) if queues else None,
        "queue_p50_s": percentile(queues, 0.5), "queue_p90_s": percentile(queues, 0.9),
        "queue_p99_s": percentile(queues, 0.99),
    } | step_summary(before, after)


def bench_url(url: str, args: argparse.Namespace, headers: dict[str, str]) -> dict[str, Any]:
    steps = [int(s) for s in args.steps.split(",")]
    for i in range(args.warmup):  # not measured: first-request costs (kernels, allocator)
        asyncio.run(run_workload(url, [(0.0, steps[0])], size=args.size, n_images=args.n,
                                 headers=headers, timeout=args.timeout))
        print(f"  warm-up request {i + 1}/{args.warmup} done", file=sys.stderr)
    plan = workload(args.requests, args.rate, steps, args.seed)
    before = scrape_metrics(url, headers)
    records = asyncio.run(run_workload(url, plan, size=args.size, n_images=args.n,
                                       headers=headers, timeout=args.timeout))
    after = scrape_metrics(url, headers)
    ready = httpx.get(f"{url}/ready", timeout=30).json()
    summary = summarize(records, before, after)
    summary["h2d_gbps_per_rank"] = copy_rates_of(ready.get("offload"))
    return {"summary": summary, "server": ready, "records": [asdict(r) for r in records]}


def launch(args: argparse.Namespace, max_num_seqs: int) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [*shlex.split(args.server_cmd), "serve", "--host", "127.0.0.1", "--port", str(port),
           "--max-num-seqs", str(max_num_seqs), "--max-queue", str(max(64, args.requests)),
           "--request-timeout", str(args.timeout), *shlex.split(args.serve_args)]
    if args.model:
        cmd += ["--model", args.model]
    log = open(Path(args.out).with_suffix(f".server-{max_num_seqs}.log"), "wb")  # noqa: SIM115
    print(f"launching: {shlex.join(cmd)}", file=sys.stderr)
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited with {process.returncode}; see {log.name}")
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)  # polling a child process's HTTP readiness
    process.kill()
    raise SystemExit(f"server not ready after {args.startup_timeout}s; see {log.name}")


def stop(process: subprocess.Popen[bytes], *, force: bool = False) -> None:
    if force:  # interrupted: do not wait for the server's drain
        process.kill()
    else:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # so `timeout` (SIGTERM) still stops launched servers and reports


def fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[tuple[str, dict[str, Any]]]) -> None:
    head = (f"{'config':<22} {'ok/n':>6} {'dur s':>7} {'req/s':>7} {'img/s':>7} {'p50 s':>7} "
            f"{'p90 s':>7} {'p99 s':>7} {'queue s':>8} {'batch':>6} {'step s':>7}  H2D GB/s")
    print(head)
    print("-" * len(head))
    for label, s in rows:
        print(f"{label:<22} {s['ok']:>3}/{s['requests']:<2} {fmt(s['duration_s']):>7} "
              f"{fmt(s['throughput_rps'], '.3f'):>7} {fmt(s['throughput_images_per_s'], '.3f'):>7} "
              f"{fmt(s['latency_p50_s']):>7} {fmt(s['latency_p90_s']):>7} "
              f"{fmt(s['latency_p99_s']):>7} {fmt(s['queue_mean_s']):>8} "
              f"{fmt(s['mean_batch_size']):>6} {fmt(s['mean_step_s'], '.3f'):>7}  "
              + ("/".join(fmt(r, ".1f") for r in s.get("h2d_gbps_per_rank") or []) or "-"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["video"]:  # the /v1/videos mode lives in its own file
        return _bench_module("serving_video").main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running server (omit with --launch)")
    p.add_argument("--launch", action="store_true", help="start one server per --max-num-seqs")
    p.add_argument("--max-num-seqs", default="1,4", help="with --launch: comma list")
    p.add_argument("--serve-args", default="", help="with --launch: extra `serve` flags")
    p.add_argument("--server-cmd", default=f"{sys.executable} -m ditserve.engine.cli",
                   help="with --launch: how to run the ditserve CLI")
    p.add_argument("--model", default=None, help="with --launch: --model for the server")
    p.add_argument("--label", default="", help="prefix of the configuration names")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--rate", type=float, default=4.0, help="mean arrivals per second (inf: all at once)")
    p.add_argument("--steps", default="4,8,12", help="step counts, drawn uniformly")
    p.add_argument("--size", default="64x64")
    p.add_argument("--n", type=int, default=1, help="images per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--out", default="serving-bench.json")
    add_mixed_options(p)
    priority = _bench_module("serving_priority")
    priority.add_options(p)
    args = p.parse_args(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # the server logs go beside it
    headers = {}
    if os.environ.get("DITSERVE_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['DITSERVE_API_KEY']}"

    signal.signal(signal.SIGTERM, _interrupt)
    if args.mixed:
        return mixed_main(args, headers)
    if args.priority:
        return int(priority.main(args, sys.modules[__name__], headers))
    results: list[dict[str, Any]] = []
    interrupted = False
    try:
        if args.launch:
            for value in [int(v) for v in args.max_num_seqs.split(",")]:
                process, url = launch(args, value)
                try:
                    result = bench_url(url, args, headers)
                except BaseException:
                    stop(process, force=True)
                    raise
                stop(process)
                result["label"] = f"{args.label}max_num_seqs={value}"
                result["max_num_seqs"] = value
                results.append(result)
                print_table([(result["label"], result["summary"])])
                write_report(args, results)  # keep what is done if a later run is cut off
        elif args.url:
            result = bench_url(args.url.rstrip("/"), args, headers)
            result["label"] = args.label or args.url
            results.append(result)
        else:
            p.error("give --url or --launch")
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted; reporting the finished configurations", file=sys.stderr)
    if not results:
        return 130 if interrupted else 1
    print()
    print_table([(r["label"], r["summary"]) for r in results])
    report = write_report(args, results)
    if "throughput_ratio_last_vs_first" in report:
        print(f"\nthroughput ratio {results[-1]['label']} / {results[0]['label']}: "
              f"{report['throughput_ratio_last_vs_first']:.2f}x")
    print(f"wrote {args.out}")
    if interrupted:
        return 130
    return 0 if all(r["summary"]["errors"] == 0 for r in results) else 1


def _bench_module(name: str) -> Any:
    """bench/<name>.py (the video and priority modes), loaded by path (`python3 -P` puts no
    script dir on sys.path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def write_report(args: argparse.Namespace, results: list[dict[str, Any]]) -> dict[str, Any]:
    report: dict[str, Any] = {
        "settings": vars(args), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "results": results,
    }
    first, last = results[0]["summary"], results[-1]["summary"]
    if len(results) > 1 and first["throughput_rps"] and last["throughput_rps"]:
        report["throughput_ratio_last_vs_first"] = last["throughput_rps"] / first["throughput_rps"]
    Path(args.out).write_text(json.dumps(report, indent=2))
    return report



# -- mixed workload (issue 23): sizes, steps, true CFG and n=2 against DLO@1, DLO@4, resident --
# Kept apart from the one-size code above (and from the video mode) so each mode reads alone.

MIXED_SIZES = "1024x1024,768x768,512x512,1344x768"  # WxH; 1344x768 is the non-square one
# What a CFG request of the mixed workload adds (Flux, Qwen-Image: true CFG); --cfg-body.
CFG_BODY: dict[str, Any] = {"negative_prompt": "blurry, low quality", "true_cfg_scale": 4.0}
TINY_SIZES = "64x64,32x64,48x48"
MIXED_TARGETS = (  # (what, numerator config, denominator config, bound)
    ("DLO@4 req/s >= 2.3x DLO@1", "dlo:4", "dlo:1", 2.3),
    ("DLO@4 req/s >= 0.95x resident@4", "dlo:4", "resident:4", 0.95),
    # Issue 34: --dlo-hbm-budget-gib auto keeps a model that fits resident.
    ("DLO auto@4 req/s >= 0.99x resident@4", "dlo-auto:4", "resident:4", 0.99),
    # Issue 47 (Z-Image, sizes 512-1360 with n>1): continuous batching's gain.
    ("resident@8 req/s >= 2.5x resident@1", "resident:8", "resident:1", 2.5),
    # Issue 45: requests naming one of four adapters each, against none.
    ("DLO+lora@4 req/s >= 0.95x DLO@4", "dlo+lora:4", "dlo:4", 0.95),
    ("resident+lora@4 req/s >= 0.95x resident@4", "resident+lora:4", "resident:4", 0.95),
)
# Serve flags of each --mixed-configs mode (dlo-auto: the whole-pipeline budget set to the
# GPU's free memory, docs/offload.md "One HBM budget").
MIXED_MODES = {"dlo": "--offload dlo", "dlo-auto": "--offload dlo --dlo-hbm-budget-gib auto",
               "dlo-dit": "--offload dlo --dlo-components dit", "resident": ""}
ADAPTER_RANKS = "16,32,64,128"  # issue 45's four adapters (the last one kohya)


@dataclass(frozen=True)
class MixedRequest:
    index: int
    arrival_s: float
    width: int
    height: int
    steps: int
    cfg: bool  # CFG: --cfg-body (a negative prompt and true_cfg_scale 4), twice the rows
    n: int
    adapter: str | None = None  # the LoRA adapter it names (a +lora configuration)


def add_mixed_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mixed workload (--mixed)")
    g.add_argument("--mixed", action="store_true",
                   help="a mixed workload against one launched server per --mixed-configs")
    g.add_argument("--mixed-configs", default="dlo:1,dlo:4,resident:4",
                   help="comma list of MODE[+lora]:N, MODE one of dlo, dlo-auto, dlo-dit, "
                        "resident (N: --max-num-seqs; +lora: each request names an adapter)")
    g.add_argument("--adapter-ranks", default=ADAPTER_RANKS,
                   help="+lora configurations: one random adapter per rank (the last kohya)")
    g.add_argument("--sizes", default=None, help=f"WxH list (default {MIXED_SIZES})")
    g.add_argument("--steps-range", default=None, help="MIN,MAX steps, uniform (default 8,20)")
    g.add_argument("--cfg-share", type=float, default=0.2, help="share of true-CFG requests")
    g.add_argument("--cfg-body", default=json.dumps(CFG_BODY),
                   help="JSON fields a CFG request adds (default: Flux/Qwen-Image's true CFG; "
                        'Z-Image Base: \'{"negative_prompt": "blurry", "guidance_scale": 4}\')')
    g.add_argument("--n2-share", type=float, default=0.1, help="share of n=2 requests")
    g.add_argument("--tiny", action="store_true",
                   help=f"CPU smoke run: the tiny model, sizes {TINY_SIZES}, steps 2,4, "
                        "--device cpu")


def mixed_workload(count: int, rate: float, sizes: list[tuple[int, int]], steps: tuple[int, int],
                   *, cfg_share: float, n2_share: float, seed: int) -> list[MixedRequest]:
    """Seeded: the same list for every configuration. rate <= 0 or inf: all at once."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(count):
        width, height = rng.choice(sizes)
        out.append(MixedRequest(i, t, width, height, rng.randint(*steps),
                                rng.random() < cfg_share, 2 if rng.random() < n2_share else 1))
        if 0 < rate < math.inf:
            t += rng.expovariate(rate)
    return out


def mixed_body(request: MixedRequest, cfg_body: dict[str, Any] | None = None
               ) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": f"benchmark prompt {request.index}: a lighthouse at dusk",
        "seed": request.index, "num_inference_steps": request.steps,
        "size": f"{request.width}x{request.height}", "n": request.n}
    if request.cfg:
        body |= CFG_BODY if cfg_body is None else cfg_body
    if request.adapter is not None:
        body["loras"] = [{"name": request.adapter, "scale": 1.0}]
    return body


async def send_mixed(url: str, plan: list[MixedRequest], *, headers: dict[str, str],
                     timeout: float, cfg_body: dict[str, Any] | None = None) -> list[Record]:
    limits = httpx.Limits(max_connections=len(plan) + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout,
                                 limits=limits) as client:
        start = time.monotonic()

        async def one(request: MixedRequest) -> Record:
            await asyncio.sleep(max(0.0, start + request.arrival_s - time.monotonic()))
            sent = time.monotonic()
            record = Record(request.index, request.steps, sent - start, 0, 0.0, None, 0, 0.0)
            try:
                response = await client.post(GEN, json=mixed_body(request, cfg_body))
            except httpx.HTTPError as e:
                response, record.error = None, repr(e)
            now = time.monotonic()
            record.latency_s, record.finished_s = now - sent, now - start
            if response is not None:
                record.status = response.status_code
                data = response.json() if response.headers.get("content-type", "").startswith(
                    "application/json") else {}
                if response.status_code == 200:
                    record.queue_s = data.get("ditserve", {}).get("queue_seconds")
                    record.images = len(data.get("data", []))
                else:
                    record.error = json.dumps(data.get("error"))
            return record

        return list(await asyncio.gather(*(one(r) for r in plan)))


def step_shapes(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Mean shape groups, rows and tokens (rows x latent tokens) per step, and the text
    encoder's passes and prompts encoded ahead over the run, from /metrics."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    steps = delta("ditserve:step_shape_groups_count")
    return {name: (delta(f"ditserve:{metric}_sum") / steps if steps else None)
            for name, metric in (("mean_groups", "step_shape_groups"),
                                 ("mean_rows", "step_batch_rows"),
                                 ("mean_tokens", "step_batch_tokens"))} | {
        "encoder_passes": delta("ditserve:encoder_passes_total"),
        "prompts_ahead": delta("ditserve:encoder_prompts_ahead_total")}


def mixed_configs(spec: str) -> list[tuple[str, str, int, bool]]:
    """``dlo+lora:4`` -> (label, extra serve flags, max_num_seqs, requests name adapters)."""
    out = []
    for item in spec.split(","):
        mode, _, value = item.strip().partition(":")
        base, plus, extra = mode.partition("+")
        if base not in MIXED_MODES or (plus and extra != "lora") or not value.isdigit():
            raise SystemExit(f"--mixed-configs: {item!r} is not MODE[+lora]:N with MODE one "
                             f"of {', '.join(MIXED_MODES)}")
        out.append((f"{mode}:{value}", MIXED_MODES[base], int(value), bool(plus)))
    return out


def mixed_targets(summaries: dict[str, dict[str, Any]]) -> list[tuple[str, float | None, bool | None]]:
    """(target, measured ratio, met) for each target whose two configurations ran."""
    rows = []
    for what, top, bottom, bound in MIXED_TARGETS:
        a = (summaries.get(top) or {}).get("throughput_rps")
        b = (summaries.get(bottom) or {}).get("throughput_rps")
        ratio = a / b if a and b else None
        rows.append((what, ratio, None if ratio is None else ratio >= bound))
    return rows


def print_mixed(results: list[dict[str, Any]]) -> None:
    head = (f"{'config':<16} {'ok/n':>6} {'dur s':>7} {'req/s':>7} {'img/s':>7} {'p50 s':>7} "
            f"{'p90 s':>7} {'groups':>6} {'rows':>6} {'tokens':>7} {'step s':>7} "
            f"{'enc/req':>7} {'ahead':>5}")
    print(head)
    print("-" * len(head))
    for r in results:
        s = r["summary"]
        passes = s.get("encoder_passes")
        print(f"{r['label']:<16} {s['ok']:>3}/{s['requests']:<2} {fmt(s['duration_s']):>7} "
              f"{fmt(s['throughput_rps'], '.3f'):>7} {fmt(s['throughput_images_per_s'], '.3f'):>7} "
              f"{fmt(s['latency_p50_s']):>7} {fmt(s['latency_p90_s']):>7} "
              f"{fmt(s['mean_groups']):>6} {fmt(s['mean_rows']):>6} "
              f"{fmt(s['mean_tokens'], '.0f'):>7} {fmt(s['mean_step_s'], '.3f'):>7} "
              f"{fmt(passes / s['ok'] if passes is not None and s['ok'] else None):>7} "
              f"{fmt(s.get('prompts_ahead'), '.0f'):>5}")
    print()
    for what, ratio, met in mixed_targets({r["label"]: r["summary"] for r in results}):
        shown = "-" if ratio is None else f"{ratio:.2f}x"
        print(f"{what:<44} {shown:>7}  {'-' if met is None else ('ok' if met else 'NO')}")


@dataclass(frozen=True)
class AdapterSet:
    """Random adapters written for the served model (bench/adapter_files.py), in a scratch
    folder (/dev/shm when there is one: no disk writes), removed after the run."""

    folder: Path
    files: dict[str, Path]

    @classmethod
    def made_for(cls, args: argparse.Namespace, ranks: list[int]) -> AdapterSet:
        import tempfile

        from ditserve.engine.makers.tiny_model import ensure_tiny

        model = args.model or str(ensure_tiny())  # a launched server without --model: tiny
        shm = Path("/dev/shm")
        folder = Path(tempfile.mkdtemp(prefix="ditserve-bench-loras-",
                                       dir=shm if shm.is_dir() else None))
        files = _bench_module("adapter_files").write_adapters(model, folder, ranks)
        print(f"adapters for {model}: " + ", ".join(
            f"{name} (rank {rank}, {path.stat().st_size / 2**20:.0f} MiB)"
            for (name, path), rank in zip(files.items(), ranks, strict=True)), file=sys.stderr)
        return cls(folder, files)

    def serve_flags(self) -> str:
        return "--lora-modules " + " ".join(shlex.quote(f"{name}={path}")
                                            for name, path in self.files.items())

    def named(self, plan: list[MixedRequest]) -> list[MixedRequest]:
        """Request i names adapter i mod n."""
        names = list(self.files)
        return [replace(r, adapter=names[r.index % len(names)]) for r in plan]

    def remove(self) -> None:
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


def mixed_main(args: argparse.Namespace, headers: dict[str, str]) -> int:
    if args.tiny:
        args.serve_args = f"--device cpu {args.serve_args}".strip()
    sizes = []
    for text in (args.sizes or (TINY_SIZES if args.tiny else MIXED_SIZES)).split(","):
        width, _, height = text.partition("x")
        sizes.append((int(width), int(height)))
    low, high = (int(v) for v in (args.steps_range or ("2,4" if args.tiny else "8,20")).split(","))
    plan = mixed_workload(args.requests, args.rate, sizes, (low, high), cfg_share=args.cfg_share,
                          n2_share=args.n2_share, seed=args.seed)
    warmup = [MixedRequest(i, 0.0, w, h, min(2, low), False, 1) for i, (w, h) in enumerate(sizes)]
    cfg_body = json.loads(args.cfg_body)
    configs = mixed_configs(args.mixed_configs)
    adapters = AdapterSet.made_for(args, [int(r) for r in args.adapter_ranks.split(",")]) \
        if any(lora for *_, lora in configs) else None
    results: list[dict[str, Any]] = []
    out = Path(args.out)
    interrupted = False
    try:
        for label, flags, max_num_seqs, lora in configs:
            tag = label.replace(":", "-").replace("+", "-")
            if lora:
                assert adapters is not None
                flags = f"{flags} {adapters.serve_flags()}"
            run = argparse.Namespace(**{**vars(args), "serve_args": f"{args.serve_args} {flags}",
                                        "out": str(out.with_name(f"{out.stem}-{tag}.json"))})
            sent = adapters.named(plan) if lora and adapters else plan
            first = adapters.named(warmup) if lora and adapters else warmup
            process, url = launch(run, max_num_seqs)
            try:
                for _ in range(args.warmup):  # not measured: first use of every size
                    asyncio.run(send_mixed(url, first, headers=headers, timeout=args.timeout))
                before = scrape_metrics(url, headers)
                records = asyncio.run(send_mixed(url, sent, headers=headers,
                                                 timeout=args.timeout, cfg_body=cfg_body))
                after = scrape_metrics(url, headers)
            except BaseException:
                stop(process, force=True)
                raise
            stop(process)
            summary = summarize(records, before, after) | step_shapes(before, after)
            results.append({"label": label, "max_num_seqs": max_num_seqs, "summary": summary,
                            "adapters": [r.adapter for r in sent],
                            "records": [asdict(r) for r in records]})
            print_mixed(results[-1:])
            write_mixed(out, args, plan, results)
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted; reporting the finished configurations", file=sys.stderr)
    finally:
        if adapters is not None:
            adapters.remove()
    if not results:
        return 130 if interrupted else 1
    print()
    print_mixed(results)
    write_mixed(out, args, plan, results)
    print(f"wrote {out}")
    if interrupted:
        return 130
    return 0 if all(r["summary"]["errors"] == 0 for r in results) else 1


def write_mixed(out: Path, args: argparse.Namespace, plan: list[MixedRequest],
                results: list[dict[str, Any]]) -> None:
    targets = mixed_targets({r["label"]: r["summary"] for r in results})
    out.write_text(json.dumps({
        "settings": vars(args), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "workload": [asdict(r) for r in plan], "results": results,
        "targets": [{"target": t, "ratio": r, "met": m} for t, r, m in targets],
    }, indent=2))


if __name__ == "__main__":
    sys.exit(main())
