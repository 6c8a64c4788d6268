#!/usr/bin/env python3
"""Job store overhead: a video job's end-to-end time on one replica with the default SQLite
job store vs a shared Redis one (``--job-store redis://...``), and, with ``--replicas N``,
N replicas on that Redis taking jobs from a burst spread over all of them. With ``--s3``, a
third single replica keeps its results in an S3 bucket (``--job-results``, moto's server).

It launches `ditserve serve` on ``--model`` (the tiny Wan model, built in a temp dir, unless
given) twice side by side - one replica on SQLite, one on Redis - runs ``--warmup``
unmeasured jobs on each, then ``--jobs`` rounds of one job on each, one after another and in
alternating order (so a shared machine's changing load falls on both alike): POST
/v1/videos, follow the job's SSE stream to its completed event, download the MP4. A job's
end-to-end time is POST to the end of the download. Then a burst per store: ``--burst`` jobs
posted at once; its makespan and how many jobs each replica ran (its /metrics). With
``--replicas N`` (N > 1), N replicas on the Redis store: jobs created round-robin, followed
and downloaded on a replica chosen at random (events of a job another replica runs are read
every 0.25 s, which their end-to-end times show), then a burst over them.
Printed as a table, with the issue's target as an ok/NO row: the shared store's p50
end-to-end time within 1.05x of SQLite's on one replica. redis-server (Debian's package)
is started by the bench in a temp dir.

  CPU (tiny Wan, as recorded in docs/benchmarks.md):
    OMP_NUM_THREADS=1 python bench/jobs.py --jobs 30 --out jobs.json
  a real model (GPU; redis-server on PATH): python3 -P bench/jobs.py --model /dev/shm/wan \\
      --device cuda --server-cmd "python3 -P -m ditserve.engine.cli" --steps 20 \\
      --size 832x480 --frames 33 --max-num-seqs 4 --jobs 10 --burst 8 --replicas 0
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from job_processes import free_port, start_moto, stop, wait_ready

TARGET = 1.05
STARTUP_TIMEOUT_S = 300.0


def start_redis(directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory),
         "--appendonly", "yes", "--appendfsync", "everysec", "--save", ""],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return process, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)  # polling a child process's port
    raise SystemExit("redis-server did not start")


def launch(args: argparse.Namespace, tmp: Path, name: str, flags: list[str]
           ) -> tuple[subprocess.Popen[bytes], str, Path]:
    port = free_port()
    cmd = [*shlex.split(args.server_cmd), "serve", "--model", str(args.model),
           "--host", "127.0.0.1", "--port", str(port), "--device", args.device,
           "--max-num-seqs", str(args.max_num_seqs), "--max-frames", str(args.frames),
           "--max-queue", str(args.burst + 8), *flags]
    log = tmp / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "DITSERVE_HOME": str(tmp / "home")})
    return process, f"http://127.0.0.1:{port}", log


def one_job(create_on: str, follow_on: str, body: dict[str, Any]) -> float:
    """POST on one replica, follow and download on another; seconds end to end."""
    started = time.perf_counter()
    with httpx.Client(timeout=600) as client:
        job = client.post(f"{create_on}/v1/videos", json=body)
        job.raise_for_status()
        video_id = job.json()["id"]
        with client.stream("GET", f"{follow_on}/v1/videos/{video_id}/events") as events:
            text = "".join(events.iter_text())
        if "event: video.completed" not in text:
            raise SystemExit(f"job {video_id} did not complete: {text[-400:]}")
        content = client.get(f"{follow_on}/v1/videos/{video_id}/content")
        content.raise_for_status()
    return time.perf_counter() - started


def jobs_run(url: str) -> float:
    """Videos this replica generated (its /metrics)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith("ditserve:videos_generated_total "):
            return float(line.split()[-1])
    return 0.0


def burst(args: argparse.Namespace, urls: list[str], rng: random.Random
          ) -> tuple[float, list[int]]:
    """``--burst`` jobs at once, round-robin over ``urls``: (makespan, jobs each ran)."""
    body = job_body(args)
    before = [jobs_run(u) for u in urls]
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.burst) as pool:
        list(pool.map(lambda i: one_job(urls[i % len(urls)], rng.choice(urls), body),
                      range(args.burst)))
    makespan = time.perf_counter() - started
    return makespan, [int(jobs_run(u) - b) for u, b in zip(urls, before, strict=True)]


def job_body(args: argparse.Namespace) -> dict[str, Any]:
    return {"prompt": "waves at dusk", "size": args.size, "num_frames": args.frames,
            "num_inference_steps": args.steps, "seed": 1}


def summary(label: str, urls: list[str], times: list[float], args: argparse.Namespace,
            burst_result: tuple[float, list[int]]) -> dict[str, Any]:
    return {"label": label, "replicas": len(urls), "jobs": len(times),
            "p50_s": statistics.median(times), "mean_s": statistics.fmean(times),
            "min_s": min(times), "max_s": max(times), "burst": args.burst,
            "burst_makespan_s": burst_result[0], "burst_jobs_per_replica": burst_result[1],
            "times_s": times}


def start(args: argparse.Namespace, tmp: Path, label: str, replicas: int,
          redis_url: str | None) -> list[tuple[subprocess.Popen[bytes], str, Path]]:
    shared = tmp / f"videos-{label}"
    started = []
    for i in range(replicas):
        flags = ["--video-dir", str(shared if redis_url else tmp / f"videos-{label}-{i}")]
        if label.endswith("-s3"):  # results in moto's bucket (main started it)
            flags = ["--job-results", f"s3://bench/{label}"]
        if redis_url:
            flags += ["--job-store", redis_url, "--job-namespace", label]
        started.append(launch(args, tmp, f"{label}-{i}", flags))
    return started


def one_replica_each(args: argparse.Namespace, tmp: Path, redis_url: str
                     ) -> list[dict[str, Any]]:
    """SQLite and Redis side by side, one replica each, their jobs interleaved (A B B A ...)
    so that the machine's load drifts over both alike."""
    servers = {"sqlite": start(args, tmp, "sqlite", 1, None),
               "redis": start(args, tmp, "redis", 1, redis_url)}
    if args.s3:
        servers["redis-s3"] = start(args, tmp, "redis-s3", 1, redis_url)
    try:
        for group in servers.values():
            for process, url, log in group:
                wait_ready(process, url, log, timeout=STARTUP_TIMEOUT_S)
        urls = {label: group[0][1] for label, group in servers.items()}
        body, rng = job_body(args), random.Random(args.seed)
        for url in urls.values():
            for _ in range(args.warmup):
                one_job(url, url, body)
        times: dict[str, list[float]] = {label: [] for label in urls}
        for i in range(args.jobs):
            order = list(urls) if i % 2 == 0 else list(reversed(urls))
            for label in order:
                times[label].append(one_job(urls[label], urls[label], body))
        return [summary(label, [url], times[label], args, burst(args, [url], rng))
                for label, url in urls.items()]
    finally:
        for group in servers.values():
            for process, _, _ in group:
                stop(process)


def replicas_on_redis(args: argparse.Namespace, tmp: Path, redis_url: str) -> dict[str, Any]:
    """``--replicas`` replicas on one Redis: jobs created round-robin, followed and
    downloaded on a replica chosen at random."""
    label = f"redis-x{args.replicas}"
    group = start(args, tmp, label, args.replicas, redis_url)
    try:
        for process, url, log in group:
            wait_ready(process, url, log, timeout=STARTUP_TIMEOUT_S)
        urls = [url for _, url, _ in group]
        body, rng = job_body(args), random.Random(args.seed)
        for _ in range(args.warmup):
            one_job(urls[0], urls[0], body)
        times = [one_job(urls[i % len(urls)], rng.choice(urls), body) for i in range(args.jobs)]
        return summary(label, urls, times, args, burst(args, urls, rng))
    finally:
        for process, _, _ in group:
            stop(process)


def table(results: list[dict[str, Any]]) -> str:
    head = ("| store | replicas | jobs | p50 e2e s | mean e2e s | min..max s | burst | "
            "burst makespan s | burst jobs per replica |\n|---|---|---|---|---|---|---|---|---|")
    rows = [f"| {r['label']} | {r['replicas']} | {r['jobs']} | {r['p50_s']:.3f} | "
            f"{r['mean_s']:.3f} | {r['min_s']:.3f}..{r['max_s']:.3f} | {r['burst']} | "
            f"{r['burst_makespan_s']:.2f} | {r['burst_jobs_per_replica']} |" for r in results]
    return "\n".join([head, *rows])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="default: tiny Wan, built here")
    p.add_argument("--device", default="cpu")
    p.add_argument("--server-cmd", default=f"{sys.executable} -m ditserve.engine.cli",
                   help="how to run ditserve (the device machine: python3 -P -m ...)")
    p.add_argument("--jobs", type=int, default=20, help="sequential jobs measured per store")
    p.add_argument("--burst", type=int, default=6, help="jobs posted at once after them")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--replicas", type=int, default=3,
                   help="replicas of the extra shared-store run (0: skip it)")
    p.add_argument("--max-num-seqs", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--size", default="32x32")
    p.add_argument("--frames", type=int, default=9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--s3", action="store_true",
                   help="a third single replica: Redis jobs, results in an S3 bucket (moto's "
                        "server, started here; it measures moto's cost, an upper bound)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ditserve-bench-jobs-") as name:
        tmp = Path(name)
        if args.model is None:
            from ditserve.engine.makers.tiny_model import init_tiny

            args.model = init_tiny(tmp / "tiny-wan", family="wan")
        redis, url = start_redis(tmp)
        moto = start_moto() if args.s3 else None
        try:
            results = one_replica_each(args, tmp, url)
            if args.replicas > 1:
                results.append(replicas_on_redis(args, tmp, url))
        finally:
            stop(redis)
            if moto is not None:
                moto.stop()
    ratio = results[1]["p50_s"] / results[0]["p50_s"]
    paired = statistics.median(r / s for r, s in zip(results[1]["times_s"],
                                                     results[0]["times_s"], strict=True))
    print(table(results))
    print(f"median of paired ratios (each redis job / the sqlite job beside it): {paired:.3f}")
    print(f"target: redis p50 e2e / sqlite p50 e2e on one replica = {ratio:.3f} "
          f"(<= {TARGET}): {'ok' if ratio <= TARGET else 'NO'}")
    if args.s3:
        s3_ratio = results[2]["p50_s"] / results[0]["p50_s"]
        print(f"redis-s3 p50 e2e / sqlite p50 e2e on one replica = {s3_ratio:.3f} "
              f"(<= {TARGET}): {'ok' if s3_ratio <= TARGET else 'NO'}")
    if args.out is not None:
        args.out.write_text(json.dumps({"results": results, "ratio": ratio, "paired": paired,
                                        "target": TARGET, "args": {
                                            k: str(v) for k, v in vars(args).items()}},
                                       indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
