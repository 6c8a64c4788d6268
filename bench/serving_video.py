#!/usr/bin/env python3
"""Video serving benchmark: Poisson arrivals of /v1/videos jobs, resident vs DLO and
--max-num-seqs 1 vs 4, measured like a client. Run it as `bench/serving.py video ...`.

For each configuration (``--configs resident:4,dlo:4,resident:1,dlo:1``) it launches one
`ditserve serve` on ``--model``, runs an unmeasured one-step warm-up job, then sends
``--jobs`` jobs whose arrivals are a Poisson process at ``--rate`` jobs/s, follows each
job's SSE stream until it ends, downloads its MP4, and stops the server. Reported per
configuration: videos per hour, job latency p50/p90 (POST to the completed event), server
queue time, mean step batch size and step time (/metrics deltas) and peak HBM (the GPU's
``memory.used`` from nvidia-smi, sampled every 0.2 s while the server lives, minus the
reading before it started). Then the issue's targets as ok/NO rows: DLO at the largest
max_num_seqs serves >= 0.97x the resident throughput at the same max_num_seqs, at <= 20% of
its peak HBM.

  on one H200 (builds the random Wan2.1-T2V-14B in /dev/shm if it is not there):
    python3 -P bench/serving.py video --model /dev/shm/wan --build --out $OUT/video.json
  CPU smoke (the tiny Wan model, built in a temp dir; tests/test_bench_video.py runs it):
    python bench/serving.py video --smoke --out video-smoke.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from harness import percentile, poisson_arrivals, scrape_metrics, step_summary
from job_processes import free_port, wait_ready

THROUGHPUT_TARGET = 0.97
HBM_TARGET = 0.20


@dataclass
class JobRecord:
    index: int
    steps: int
    arrival_s: float
    status: str
    latency_s: float
    queue_s: float | None
    mp4_bytes: int
    finished_s: float
    error: str | None = None


class HbmSampler:
    """The GPU's memory.used (MiB) every ``period`` s in a thread; None without nvidia-smi."""

    def __init__(self, period: float = 0.2) -> None:
        self.period, self.base = period, self._read()
        self.peak: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _read() -> float | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used",
                                  "--format=csv,noheader,nounits", "--id=0"],
                                 capture_output=True, text=True, timeout=10)
            return float(out.stdout.strip().splitlines()[0]) if out.returncode == 0 else None
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return None

    def _run(self) -> None:
        while not self._stop.wait(self.period):  # a sampling period, not a wait for work
            value = self._read()
            if value is not None:
                self.peak = value if self.peak is None else max(self.peak, value)

    def __enter__(self) -> HbmSampler:
        if self.base is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def peak_gib(self) -> float | None:
        if self.peak is None or self.base is None:
            return None
        return (self.peak - self.base) / 1024


async def run_jobs(url: str, plan: list[float], args: argparse.Namespace,
                   steps: int) -> list[JobRecord]:
    body = {"size": args.size, "num_frames": args.frames, "num_inference_steps": steps,
            "guidance_scale": args.guidance}
    limits = httpx.Limits(max_connections=2 * len(plan) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client:
        start = time.monotonic()

        async def one(i: int, at: float) -> JobRecord:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            sent = time.monotonic()
            made = await client.post("/v1/videos", json={
                **body, "prompt": f"benchmark video {i}: waves at dusk", "seed": i})
            if made.status_code != 200:
                now = time.monotonic()
                return JobRecord(i, steps, sent - start, f"http {made.status_code}",
                                 now - sent, None, 0, now - start, made.text[:300])
            job_id, final = made.json()["id"], None
            async with client.stream("GET", f"/v1/videos/{job_id}/events") as events:
                async for line in events.aiter_lines():
                    if line.startswith("data:"):
                        final = json.loads(line[5:])["video"]
            done = time.monotonic()
            status = final["status"] if final else "no events"
            size = 0
            if status == "completed":
                size = len((await client.get(f"/v1/videos/{job_id}/content")).content)
            meta = (final or {}).get("ditserve", {})
            return JobRecord(i, steps, sent - start, status, done - sent,
                             meta.get("queue_seconds"), size, done - start,
                             json.dumps((final or {}).get("error")) if status != "completed"
                             else None)

        return list(await asyncio.gather(*(one(i, at) for i, at in enumerate(plan))))


def summarize(records: list[JobRecord], before: dict[str, float], after: dict[str, float],
              peak_gib: float | None) -> dict[str, Any]:
    ok = [r for r in records if r.status == "completed"]
    duration = max((r.finished_s for r in records), default=0.0) - min(
        (r.arrival_s for r in records), default=0.0)
    latencies = [r.latency_s for r in ok]
    queues = [r.queue_s for r in ok if r.queue_s is not None]
    steps = step_summary(before, after)
    return {
        "jobs": len(records), "ok": len(ok), "errors": len(records) - len(ok),
        "duration_s": duration,
        "videos_per_hour": 3600 * len(ok) / duration if duration > 0 else None,
        "latency_p50_s": percentile(latencies, 0.5), "latency_p90_s": percentile(latencies, 0.9),
        "queue_mean_s": sum(queues) / len(queues) if queues else None,
        "denoise_steps": steps["denoise_steps"], "mean_batch_size": steps["mean_batch_size"],
        "mean_step_s": steps["mean_step_s"],
        "video_seconds": (after.get("ditserve:video_seconds_generated_total", 0.0)
                          - before.get("ditserve:video_seconds_generated_total", 0.0)),
        "mean_mp4_bytes": sum(r.mp4_bytes for r in ok) / len(ok) if ok else None,
        "peak_hbm_gib": peak_gib,
    }


def bench_config(args: argparse.Namespace, mode: str, seqs: int) -> dict[str, Any]:
    port = free_port()
    cmd = [*shlex.split(args.server_cmd), "serve", "--model", str(args.model), "--host",
           "127.0.0.1", "--port", str(port), "--max-num-seqs", str(seqs),
           "--max-queue", str(args.jobs + 4), "--request-timeout", str(args.timeout),
           "--max-frames", str(args.frames), *shlex.split(args.serve_args)]
    if mode == "dlo":
        cmd += ["--offload", "dlo"]
    log_path = Path(args.out).with_suffix(f".server-{mode}-{seqs}.log")
    print(f"launching: {shlex.join(cmd)}", file=sys.stderr)
    url = f"http://127.0.0.1:{port}"
    with HbmSampler() as hbm, log_path.open("wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(process, url, log_path, timeout=args.startup_timeout, every_s=0.5)
            for _ in range(args.warmup):  # first-job costs (kernels, allocator): not measured
                asyncio.run(run_jobs(url, [0.0], args, steps=1))
            before = scrape_metrics(url)
            records = asyncio.run(run_jobs(url, poisson_arrivals(args.jobs, args.rate, args.seed),
                                           args, steps=args.steps))
            after = scrape_metrics(url)
            offload = httpx.get(f"{url}/ready", timeout=30).json().get("offload")
        finally:
            stop(process)
    summary = summarize(records, before, after, hbm.peak_gib)
    return {"label": f"{mode}@{seqs}", "mode": mode, "max_num_seqs": seqs, "summary": summary,
            "offload": offload, "records": [asdict(r) for r in records]}


def stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def targets(results: list[dict[str, Any]]) -> list[tuple[str, float, float, bool]]:
    """(what, measured, bound, met) for DLO at the largest max_num_seqs vs resident there."""
    by = {(r["mode"], r["max_num_seqs"]): r["summary"] for r in results}
    seqs = max((s for m, s in by if m == "dlo" and ("resident", s) in by), default=None)
    if seqs is None:
        return []
    dlo, resident = by[("dlo", seqs)], by[("resident", seqs)]
    rows = []
    if dlo["videos_per_hour"] and resident["videos_per_hour"]:
        rows.append((f"DLO@{seqs} videos/h >= {THROUGHPUT_TARGET}x resident@{seqs}",
                     dlo["videos_per_hour"], THROUGHPUT_TARGET * resident["videos_per_hour"],
                     dlo["videos_per_hour"] >= THROUGHPUT_TARGET * resident["videos_per_hour"]))
    if dlo["peak_hbm_gib"] is not None and resident["peak_hbm_gib"]:
        bound = HBM_TARGET * resident["peak_hbm_gib"]
        rows.append((f"DLO@{seqs} peak HBM <= {HBM_TARGET:.0%} of resident@{seqs}'s (GiB)",
                     dlo["peak_hbm_gib"], bound, dlo["peak_hbm_gib"] <= bound))
    return rows


def fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_report(results: list[dict[str, Any]]) -> None:
    head = (f"{'config':<13} {'ok/n':>6} {'dur s':>7} {'videos/h':>9} {'p50 s':>7} "
            f"{'p90 s':>7} {'queue s':>8} {'batch':>6} {'step s':>7} {'peak HBM GiB':>12}")
    print(head)
    print("-" * len(head))
    for r in results:
        s = r["summary"]
        print(f"{r['label']:<13} {s['ok']:>3}/{s['jobs']:<2} {fmt(s['duration_s']):>7} "
              f"{fmt(s['videos_per_hour'], '.1f'):>9} {fmt(s['latency_p50_s']):>7} "
              f"{fmt(s['latency_p90_s']):>7} {fmt(s['queue_mean_s']):>8} "
              f"{fmt(s['mean_batch_size']):>6} {fmt(s['mean_step_s'], '.3f'):>7} "
              f"{fmt(s['peak_hbm_gib']):>12}")
    for what, measured, bound, met in targets(results):
        print(f"target: {what}: {measured:.2f} vs {bound:.2f}: {'ok' if met else 'NO'}")


def build_model(args: argparse.Namespace) -> None:
    """The random full-size Wan2.1-T2V-14B (on the GPU, seconds; writing ~29 GB), or the
    tiny one for --smoke."""
    model = Path(args.model)
    if (model / "model_index.json").is_file():
        return
    cmd = [*shlex.split(args.server_cmd), "model"]
    cmd += (["init-tiny", "--family", "wan", str(model)] if args.smoke else
            ["init-random", "--family", "wan", "--size", "full", "--components", "dit",
             str(model)])
    print(f"building: {shlex.join(cmd)}", file=sys.stderr)
    started = time.monotonic()
    subprocess.run(cmd, check=True)
    print(f"  built in {time.monotonic() - started:.0f}s", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="serving.py video", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a Wan model directory (with --build: made if missing)")
    p.add_argument("--build", action="store_true", help="build the random Wan2.1-T2V-14B")
    p.add_argument("--smoke", action="store_true",
                   help="CPU smoke run on the tiny Wan model (small jobs; resident:2,dlo:2)")
    p.add_argument("--configs", default="resident:4,dlo:4,resident:1,dlo:1",
                   help="comma list of MODE:MAX_NUM_SEQS, MODE resident or dlo (the pair the targets compare runs first)")
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--rate", type=float, default=0.5, help="mean job arrivals per second")
    p.add_argument("--size", default="832x480")
    p.add_argument("--frames", type=int, default=33)
    p.add_argument("--steps", type=int, default=4, help="denoise steps per job")
    p.add_argument("--guidance", type=float, default=5.0, help="> 1: CFG, two rows per job")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--serve-args", default="--dtype bfloat16")
    p.add_argument("--server-cmd", default=f"{sys.executable} -m ditserve.engine.cli")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--out", default="serving-video.json")
    args = p.parse_args(argv)
    if args.smoke:
        args.model = args.model or str(Path(tempfile.mkdtemp(prefix="ditserve-bench-")) / "wan")
        args.build, args.size, args.frames, args.steps = True, "32x32", 9, 2
        args.jobs, args.rate, args.warmup, args.serve_args = 3, math.inf, 0, "--device cpu"
        if args.configs == p.get_default("configs"):
            args.configs = "resident:2,dlo:2"
    if not args.model:
        p.error("give --model (or --smoke)")
    if args.build:
        build_model(args)
    configs = [(mode, int(n)) for mode, n in (c.split(":") for c in args.configs.split(","))]
    results: list[dict[str, Any]] = []
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        for mode, seqs in configs:
            results.append(bench_config(args, mode, seqs))
            print_report(results[-1:])
            write_report(args, results)  # keep what is done if a later run is cut off
    except KeyboardInterrupt:
        print("interrupted; reporting the finished configurations", file=sys.stderr)
    if not results:
        return 1
    print()
    print_report(results)
    write_report(args, results)
    print(f"wrote {args.out}")
    return 0 if all(r["summary"]["errors"] == 0 for r in results) else 1


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # so `timeout` (SIGTERM) still stops the server and reports


def write_report(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    report = {"settings": vars(args), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "host": os.uname().nodename, "results": results,
              "targets": [{"what": w, "measured": m, "bound": b, "met": ok}
                          for w, m, b, ok in targets(results)]}
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    sys.exit(main())
