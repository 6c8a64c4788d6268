#!/usr/bin/env python3
"""Issue 51's target scenarios as one program: several `ditserve serve` replicas of the tiny
Wan model on one real redis-server, driven and checked from outside like a client would.

1. ``load``: ``--replicas`` replicas (default 3) on Redis and one shared video directory (or
   an S3 bucket with ``--results s3``: moto's server, which must be installed), ``--jobs``
   jobs (default 60) posted to random replicas at ``--rate`` jobs/s (default: 1.5x what the
   replicas' batch slots finish, measured by a warm-up job), each polled and downloaded on a
   replica chosen at random. Checked: 0 lost (every accepted job completed, its MP4
   downloaded), 0 run twice (the videos the replicas generated, from their /metrics, equal
   the jobs; no job claimed twice), and the replicas' queues sampled every 50 ms: how long
   any replica sat idle while another had 2+ requests waiting in its engine (the target: never
   longer than one denoise step), and while the shared queue held jobs no replica had taken.
2. ``faults``: the same replicas, ``--jobs`` jobs spread over ``--fault-span`` seconds (80),
   while Redis is stopped for ``--redis-down`` seconds (10) and started again on its
   append-only file, one replica is killed with SIGKILL mid-job (and started again), and
   every replica is restarted one by one (SIGTERM: drain, hand back). Checked: every
   accepted job completed or failed with a stated reason (an error code and message), none
   vanished (a 404); how many ran twice (a replica killed mid-job: its job runs again, as
   designed); which answers the POSTs that had to be retried got (503s while Redis is down).
3. ``sqlite``: one replica on its default SQLite store, one job finished, then SIGKILL during
   a second job and a restart: the finished job still downloads (same bytes), the interrupted
   one runs again or fails with a reason, never a 404.

Prints one table per scenario (ok/NO rows for the targets) and writes ``--out`` JSON. The
overhead target (the shared store's end-to-end time vs SQLite's on one replica) is
bench/jobs.py's.

  CPU (as recorded in docs/benchmarks.md):
    OMP_NUM_THREADS=1 python bench/job_scenarios.py --out scenarios.json
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from job_processes import free_port, start_moto, stop, wait_ready

STARTUP_TIMEOUT_S = 300.0
SAMPLE_S = 0.05
NAMESPACE = "scenarios"  # the replicas' --job-namespace (the queue's Redis key names it)
FINAL = ("completed", "failed")


# -- processes -------------------------------------------------------------------------------
class Redis:
    """redis-server on a fixed port with its append-only file, so it can stop and return."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.port = directory, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed (apt-get install redis-server)")
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
             str(self.directory), "--appendonly", "yes", "--appendfsync", "everysec",
             "--save", ""], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        import redis

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if redis.Redis.from_url(self.url).ping():
                    return
            except redis.RedisError:
                time.sleep(0.05)  # polling a child process's readiness
        raise SystemExit("redis-server did not start")

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process)  # SIGTERM: Redis flushes its append-only file first
            self.process = None


@dataclass
class Replica:
    """One `ditserve serve` on a fixed port (a restart keeps its address)."""

    name: str
    cmd: list[str]
    log: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen([*self.cmd, "--port", str(self.port)], stdout=out,
                                            stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        assert self.process is not None
        wait_ready(self.process, self.url, self.log, timeout=STARTUP_TIMEOUT_S, every_s=0.1)

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()  # SIGKILL: no drain, no hand-back
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process)


def replicas(args: argparse.Namespace, tmp: Path, label: str, n: int,
             flags: list[str]) -> list[Replica]:
    base = [*shlex.split(args.server_cmd), "serve", "--model", str(args.model), "--host",
            "127.0.0.1", "--device", args.device, "--max-num-seqs", str(args.max_num_seqs),
            "--max-frames", str(args.frames), "--max-queue", "256", "--video-max-jobs",
            "4096", "--job-lease", str(args.lease), "--shutdown-grace", "5", *flags]
    return [Replica(f"{label}-{i}", base, tmp / f"{label}-{i}.log") for i in range(n)]


# -- the client side ---------------------------------------------------------------------------
def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("ditserve:") and ("{" not in line or "video_jobs{" in line):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


class Sampler:
    """Every SAMPLE_S: each replica's (running, waiting) requests in its engine (None if it
    is down), and the jobs of the shared queue no replica has taken yet (``undelivered``)."""

    def __init__(self, fleet: list[Replica], undelivered: Any) -> None:
        self.fleet, self.undelivered = fleet, undelivered
        self.samples: list[tuple[float, list[Any], int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _one(self, replica: Replica) -> tuple[float, float] | None:
        try:
            m = metrics(replica.url)
            return m.get("ditserve:num_requests_running", 0), m.get(
                "ditserve:num_requests_waiting", 0)
        except httpx.HTTPError:
            return None

    def _run(self) -> None:
        with ThreadPoolExecutor(len(self.fleet) + 1) as pool:
            while not self._stop.wait(SAMPLE_S):
                queue = pool.submit(self.undelivered)  # read beside the replicas' scrapes
                states = list(pool.map(self._one, self.fleet))
                self.samples.append((time.monotonic(), states, queue.result()))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def longest_idle_beside_a_queue(self) -> float:
        """The longest stretch in which one replica (up) held nothing while another had 2+
        requests waiting in its engine."""
        return self._longest(lambda up, _: any(r + w == 0 for r, w in up)
                             and any(w >= 2 for _, w in up))

    def longest_idle_beside_unclaimed(self) -> float:
        """The longest stretch in which one replica held nothing while the shared queue had
        jobs no replica had taken (each sample reads Redis and the replicas at about the same
        moment; a replica's scrape may lag its worker by a few ms)."""
        return self._longest(lambda up, queue: queue > 0 and any(r + w == 0 for r, w in up))

    def _longest(self, is_bad: Any) -> float:
        longest, since, t = 0.0, None, 0.0
        for t, states, queue in self.samples:
            up = [s for s in states if s is not None]
            bad = bool(up) and is_bad(up, queue)
            if bad and since is None:
                since = t
            elif not bad and since is not None:
                longest, since = max(longest, t - since), None
        return max(longest, t - since if since is not None else 0.0)


def call(method: str, url: str, **kw: Any) -> httpx.Response | None:
    """One request; None if the replica is down (connection refused: it restarts)."""
    try:
        return httpx.request(method, url, timeout=30, **kw)
    except httpx.TransportError:
        return None


def submit(fleet: list[Replica], body: dict[str, Any], rng: random.Random,
           retried: list[str] | None = None, give_up_s: float = 60.0
           ) -> tuple[str | None, str]:
    """POST to a random replica until one accepts: (id, "") or (None, why it never did).
    503 (Redis down, a draining replica) and a refused connection are retried (each one's
    status and error code go to ``retried``)."""
    deadline, last = time.monotonic() + give_up_s, ""
    while time.monotonic() < deadline:
        r = call("POST", f"{rng.choice(fleet).url}/v1/videos", json=body)
        if r is not None and r.status_code == 200:
            return r.json()["id"], ""
        last = "no connection" if r is None else f"{r.status_code} {r.text[:120]}"
        if retried is not None:
            retried.append("no connection" if r is None else f"{r.status_code} {_code(r)}")
        time.sleep(0.2)  # a client's retry after Retry-After / a refused connection
    return None, last


def _code(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"].get("code"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return ""


def follow(fleet: list[Replica], video_id: str, rng: random.Random, limit_s: float
           ) -> dict[str, Any]:
    """Poll a random replica each time until the job is final; download its MP4 from another
    random one. The job's last object, with ``vanished`` (a 404 seen) and ``bytes``."""
    deadline, vanished, job = time.monotonic() + limit_s, 0, None
    while time.monotonic() < deadline:
        r = call("GET", f"{rng.choice(fleet).url}/v1/videos/{video_id}")
        if r is not None and r.status_code == 404:
            vanished += 1
        elif r is not None and r.status_code == 200:
            job = r.json()
            if job["status"] in FINAL:
                break
        time.sleep(0.1)  # a client's poll interval
    out = {"id": video_id, "status": job["status"] if job else "unknown", "vanished": vanished,
           "error": job.get("error") if job else None, "bytes": 0,
           "attempts": job["ditserve"]["attempts"] if job else 0}
    while out["status"] == "completed" and time.monotonic() < deadline:
        r = call("GET", f"{rng.choice(fleet).url}/v1/videos/{video_id}/content")
        if r is not None and r.status_code == 200:
            out["bytes"] = len(r.content)
            break
        time.sleep(0.1)
    return out


def drive(fleet: list[Replica], args: argparse.Namespace, rate: float, seed: int,
          during: Any = None, retried: list[str] | None = None
          ) -> tuple[list[dict[str, Any]], list[str], float]:
    """``--jobs`` jobs at ``rate``/s, each followed to its end: (outcomes, refusals, seconds).
    ``during`` runs beside the load (the faults)."""
    body = {"prompt": "waves at dusk", "size": args.size, "num_frames": args.frames,
            "num_inference_steps": args.steps}
    started = time.monotonic()

    def one(i: int) -> tuple[dict[str, Any] | None, str]:
        time.sleep(max(0.0, started + i / rate - time.monotonic()))  # open-loop arrivals
        local = random.Random(seed * 1000 + i)
        video_id, why = submit(fleet, {**body, "seed": i}, local, retried)
        if video_id is None:
            return None, why
        return follow(fleet, video_id, local, args.job_limit), ""

    with ThreadPoolExecutor(args.jobs + 1) as pool:
        fault = pool.submit(during) if during is not None else None
        results = list(pool.map(one, range(args.jobs)))
        if fault is not None:
            fault.result()
    return ([o for o, _ in results if o is not None], [w for o, w in results if o is None],
            time.monotonic() - started)


def generated(fleet: list[Replica]) -> float:
    return sum(metrics(r.url).get("ditserve:videos_generated_total", 0) for r in fleet)


# -- the scenarios -----------------------------------------------------------------------------
def warm_job_s(fleet: list[Replica], args: argparse.Namespace) -> float:
    """One job end to end on an idle fleet (also warms every replica's first request)."""
    times = []
    for replica in fleet:
        began = time.monotonic()
        out = follow([replica], submit([replica], {
            "prompt": "warm", "size": args.size, "num_frames": args.frames,
            "num_inference_steps": args.steps, "seed": 0}, random.Random(0))[0] or "",
            random.Random(0), args.job_limit)
        assert out["status"] == "completed", out
        times.append(time.monotonic() - began)
    return min(times)


def undelivered(redis_url: str) -> Any:
    """How many entries of the shared queue no replica has taken: the stream's length less
    its pending (delivered, not yet done) entries - a job's entry is deleted once it ends."""
    import redis

    client = redis.Redis.from_url(redis_url)
    key = f"ditserve:{{{NAMESPACE}}}:queue"

    def read() -> int:
        pending = client.xpending(key, "workers")["pending"] if client.exists(key) else 0
        return int(client.xlen(key)) - int(pending)
    return read


def load(fleet: list[Replica], redis: Redis, args: argparse.Namespace, job_s: float
         ) -> dict[str, Any]:
    rate = args.rate or 1.5 * len(fleet) * args.max_num_seqs / job_s
    before = generated(fleet)
    with Sampler(fleet, undelivered(redis.url)) as sampler:
        outcomes, refused, seconds = drive(fleet, args, rate, seed=1)
    ran = generated(fleet) - before
    step_s = job_s / args.steps
    idle = sampler.longest_idle_beside_a_queue()
    unclaimed = sampler.longest_idle_beside_unclaimed()
    done = [o for o in outcomes if o["status"] == "completed" and o["bytes"] > 0]
    return {"scenario": "load", "replicas": len(fleet), "jobs": args.jobs, "rate": rate,
            "accepted": len(outcomes), "refused": refused, "completed": len(done),
            "lost": len(outcomes) - len(done), "generated": ran,
            "claimed_twice": sum(o["attempts"] > 1 for o in outcomes),
            "run_twice": int(ran) - len(done), "vanished": sum(o["vanished"] > 0 for o in
                                                               outcomes),
            "seconds": seconds, "job_s": job_s, "step_s": step_s,
            "longest_idle_beside_queue_s": idle, "longest_idle_beside_unclaimed_s": unclaimed,
            "most_unclaimed": max((q for _, _, q in sampler.samples), default=0),
            "samples": len(sampler.samples)}


def faults(fleet: list[Replica], redis: Redis, args: argparse.Namespace) -> dict[str, Any]:
    # Arrivals spread over the faults' whole span, so each fault meets jobs under way.
    rate = args.jobs / args.fault_span
    events: list[str] = []

    def busy(replica: Replica) -> bool:
        try:
            return metrics(replica.url).get("ditserve:num_requests_running", 0) > 0
        except httpx.HTTPError:
            return False

    def during() -> None:
        t0 = time.monotonic()
        while not any(busy(r) for r in fleet) and time.monotonic() - t0 < 60:
            time.sleep(0.02)  # until jobs run
        redis.stop()  # first, while jobs run and arrive
        events.append(f"{time.monotonic() - t0:.1f}s: redis stopped")
        time.sleep(args.redis_down)  # the outage itself
        redis.start()
        events.append(f"{time.monotonic() - t0:.1f}s: redis back")
        victim = fleet[0]
        while not busy(victim) and time.monotonic() - t0 < 120:
            time.sleep(0.02)  # until it runs a job
        victim.kill()
        events.append(f"{time.monotonic() - t0:.1f}s: SIGKILL {victim.name} (busy)")
        victim.start()
        victim.wait_ready()
        events.append(f"{time.monotonic() - t0:.1f}s: {victim.name} back")
        for replica in fleet:  # a rolling restart under load
            replica.stop()
            replica.start()
            replica.wait_ready()
            events.append(f"{time.monotonic() - t0:.1f}s: {replica.name} restarted (SIGTERM)")

    retried: list[str] = []
    outcomes, refused, seconds = drive(fleet, args, rate, seed=2, during=during,
                                       retried=retried)
    answers: dict[str, int] = {}
    for why in retried:
        answers[why] = answers.get(why, 0) + 1
    ended = [o for o in outcomes if o["status"] == "completed" and o["bytes"] > 0
             or o["status"] == "failed" and o["error"] and o["error"].get("message")]
    reasons: dict[str, int] = {}
    for o in outcomes:
        if o["status"] == "failed":
            code = (o["error"] or {}).get("code", "?")
            reasons[code] = reasons.get(code, 0) + 1
    return {"scenario": "faults", "replicas": len(fleet), "jobs": args.jobs, "rate": rate,
            "accepted": len(outcomes), "refused": len(refused),
            "refused_reasons": sorted(set(r.split(" ")[0] for r in refused)),
            "retried_posts": answers,
            "completed": sum(o["status"] == "completed" for o in outcomes),
            "failed": reasons, "unaccounted": len(outcomes) - len(ended),
            "vanished": sum(o["vanished"] > 0 for o in outcomes),
            "claimed_twice": sum(o["attempts"] > 1 for o in outcomes),
            "seconds": seconds, "events": events}


def sqlite_restart(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    (replica,) = replicas(args, tmp, "sqlite", 1, ["--video-dir", str(tmp / "videos-sqlite")])
    replica.start()
    replica.wait_ready()
    rng = random.Random(3)
    body = {"prompt": "one", "size": args.size, "num_frames": args.frames,
            "num_inference_steps": args.steps, "seed": 1}
    try:
        first = follow([replica], submit([replica], body, rng)[0] or "", rng, args.job_limit)
        before = httpx.get(f"{replica.url}/v1/videos/{first['id']}/content", timeout=30).content
        long_body = {**body, "num_inference_steps": args.steps * 25}  # long enough to catch
        second, _ = submit([replica], long_body, rng)
        while True:
            job = httpx.get(f"{replica.url}/v1/videos/{second}", timeout=30).json()
            if job["status"] == "in_progress" or job["status"] in FINAL:
                break
            time.sleep(0.02)  # until it runs
        interrupted_at = job["progress"]
        replica.kill()
        replica.start()
        replica.wait_ready()
        after = httpx.get(f"{replica.url}/v1/videos/{first['id']}/content", timeout=30)
        rerun = follow([replica], second or "", rng, args.job_limit * 25)
    finally:
        replica.stop()
    return {"scenario": "sqlite", "killed_at_progress": interrupted_at,
            "finished_job_after_restart": after.status_code,
            "same_bytes": after.content == before and len(before) > 0,
            "interrupted_job": rerun["status"], "interrupted_error": rerun["error"],
            "attempts": rerun["attempts"], "vanished": rerun["vanished"]}


def report(results: list[dict[str, Any]]) -> str:
    lines = []
    for r in results:
        if r["scenario"] == "load":
            ok = r["lost"] == 0 and r["run_twice"] == 0 and r["claimed_twice"] == 0
            lines += [
                "| load | replicas | jobs | rate /s | accepted | completed | lost | run twice | "
                "longest idle beside 2+ waiting s | longest idle beside unclaimed jobs s "
                "(most unclaimed) | one step s | wall s |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|",
                f"| | {r['replicas']} | {r['jobs']} | {r['rate']:.2f} | {r['accepted']} | "
                f"{r['completed']} | {r['lost']} | {r['run_twice']} (claimed twice: "
                f"{r['claimed_twice']}) | {r['longest_idle_beside_queue_s']:.2f} | "
                f"{r['longest_idle_beside_unclaimed_s']:.2f} ({r['most_unclaimed']}) | "
                f"{r['step_s']:.3f} | {r['seconds']:.1f} |",
                f"target: 0 lost, 0 run twice: {'ok' if ok else 'NO'}; no replica idle beside "
                f"2+ waiting for longer than a step: "
                f"{'ok' if r['longest_idle_beside_queue_s'] <= r['step_s'] else 'NO'}", ""]
        elif r["scenario"] == "faults":
            ok = r["unaccounted"] == 0 and r["vanished"] == 0
            lines += [
                "| faults | accepted | completed | failed (code: n) | unaccounted | vanished | "
                "claimed twice | never accepted | POSTs retried (answer: n) | wall s |",
                "|---|---|---|---|---|---|---|---|---|---|",
                f"| | {r['accepted']} | {r['completed']} | {r['failed'] or '-'} | "
                f"{r['unaccounted']} | {r['vanished']} | {r['claimed_twice']} | "
                f"{r['refused']} {r['refused_reasons']} | {r['retried_posts'] or '-'} | "
                f"{r['seconds']:.1f} |",
                *[f"  {e}" for e in r["events"]],
                f"target: every accepted job completed or failed with a reason, none "
                f"vanished: {'ok' if ok else 'NO'}", ""]
        else:
            ok = (r["finished_job_after_restart"] == 200 and r["same_bytes"]
                  and r["vanished"] == 0 and (r["interrupted_job"] == "completed"
                                              or r["interrupted_error"]))
            lines += [
                "| sqlite restart | killed at | finished job after | same bytes | "
                "interrupted job | attempts | vanished |", "|---|---|---|---|---|---|---|",
                f"| | {r['killed_at_progress']}% | {r['finished_job_after_restart']} | "
                f"{r['same_bytes']} | {r['interrupted_job']} | {r['attempts']} | "
                f"{r['vanished']} |",
                f"target: finished jobs stay, the interrupted one re-runs or fails with a "
                f"reason, never a 404: {'ok' if ok else 'NO'}", ""]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="default: tiny Wan, built here")
    p.add_argument("--device", default="cpu")
    p.add_argument("--server-cmd", default=f"{sys.executable} -m ditserve.engine.cli")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--jobs", type=int, default=60)
    p.add_argument("--rate", type=float, default=None, help="jobs/s (default: see above)")
    p.add_argument("--max-num-seqs", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--size", default="32x32")
    p.add_argument("--frames", type=int, default=9)
    p.add_argument("--lease", type=float, default=5.0, help="--job-lease of the replicas")
    p.add_argument("--redis-down", type=float, default=10.0)
    p.add_argument("--fault-span", type=float, default=80.0,
                   help="seconds the fault run's arrivals are spread over (the faults take "
                        "about this long on a 2-core machine with 3 replicas)")
    p.add_argument("--job-limit", type=float, default=300.0, help="seconds a job may take")
    p.add_argument("--results", choices=["dir", "s3"], default="dir",
                   help="where the replicas keep videos: one shared directory, or a bucket "
                        "of moto's S3 server started here (--job-results)")
    p.add_argument("--scenarios", nargs="+", default=["load", "faults", "sqlite"],
                   choices=["load", "faults", "sqlite"])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ditserve-bench-scenarios-") as name:
        tmp = Path(name)
        if args.model is None:
            from ditserve.engine.makers.tiny_model import init_tiny

            args.model = init_tiny(tmp / "tiny-wan", family="wan")
        if {"load", "faults"} & set(args.scenarios):
            redis = Redis(tmp)
            redis.start()
            moto = start_moto() if args.results == "s3" else None
            where = (["--job-results", "s3://bench/videos"] if moto is not None
                     else ["--video-dir", str(tmp / "videos-shared")])
            fleet = replicas(args, tmp, "redis", args.replicas, [
                "--job-store", redis.url, "--job-namespace", NAMESPACE, *where])
            try:
                for replica in fleet:
                    replica.start()
                for replica in fleet:
                    replica.wait_ready()
                job_s = warm_job_s(fleet, args)
                if "load" in args.scenarios:
                    results.append(load(fleet, redis, args, job_s))
                if "faults" in args.scenarios:
                    results.append(faults(fleet, redis, args))
            finally:
                for replica in fleet:
                    replica.stop()
                redis.stop()
                if moto is not None:
                    moto.stop()
        if "sqlite" in args.scenarios:
            results.append(sqlite_restart(args, tmp))
    print(report(results))
    if args.out is not None:
        args.out.write_text(json.dumps({"results": results, "args": {
            k: str(v) for k, v in vars(args).items()}}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
