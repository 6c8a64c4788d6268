"""Host memory while an engine loads a pipeline (cold start), against issue 34's bound.

The program starts a child process that loads the model exactly as ``ditserve serve`` would
with the given engine flags (``ModelRunner``: the loader, DLO's host backing, the whole
pipeline's placement), and samples the child's ``/proc/PID/status`` every ``--interval``
seconds until it has loaded: ``VmRSS`` and its parts - ``RssAnon`` (private memory: pinned
slabs, parked encoders, loading buffers), ``RssFile`` and ``RssShmem`` (pages of mapped
files; a checkpoint under /dev/shm counts as shmem), shared with every process that maps the
same file. The child also reports the kernel's own peak (``VmHWM``), the offload's host
accounting (``engine.offload.accounting``: streamed, pinned and mapped bytes; a mapped
checkpoint must not also be copied, pinned bytes stay <= 1.02x streamed) and the bytes of
encoders parked in pinned host memory.

The bound judged at every sample: the RSS above the process's baseline (torch imported,
CUDA context up, nothing loaded) <= 1.15 x (pinned bytes: DLO's plus the offloaded
encoders') + the checkpoint pages mapped at that moment (RssFile + RssShmem above the
baseline's: pages shared with the page cache or /dev/shm, whether DLO streams from the
mapping or safetensors reads a shard through it while the loader copies it). The worst
sample's ratio is reported, with the log line the RSS peak fell after. ``--tiny`` runs it on a
tiny model (``--family``, default Flux) on a CPU (a smoke run: there the baseline dominates and
the ratio means nothing). Cosmos3-Nano: its DiT's token table and LM head (2 x 1.2 GB) stay in
host memory, never pinned: mapped checkpoint pages under ``checkpoint_mmap``, else private.
``--init-random FAMILY`` builds the full-size random pipeline first when ``--model-dir``
holds none, so one command measures a family's cold start:

    python3 bench/host_rss.py --init-random cosmos3 --model-dir /dev/shm/ditserve-rss-cosmos3 \
        --out out/rss-cosmos3
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GIB = 1 << 30
BOUND = 1.15
FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM")


def read_status(pid: int) -> dict[str, int] | None:
    """The memory fields of ``/proc/PID/status`` in bytes; None once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in FIELDS:
            out[key] = int(value.split()[0]) * 1024
    return out


def child(args: argparse.Namespace) -> int:
    """Load the engine's model runner, report what it holds, exit."""
    import torch

    from ditserve.engine.config import RunnerConfig
    from ditserve.engine.config.flags import add_engine_options, engine_config_from_args
    from ditserve.engine.offload.accounting import host_accounting
    from ditserve.engine.runner.model_runner import ModelRunner

    # What the loader is doing when (wall time, as the parent's samples): the runner's own
    # log lines, so the report can say which phase the RSS peak fell in.
    phases: list[tuple[float, str]] = [(time.time(), "start")]

    class Phases(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            phases.append((time.time(), f"{record.name}: {record.getMessage().splitlines()[0]}"[:160]))

    logging.getLogger().addHandler(Phases(logging.INFO))
    logging.getLogger().setLevel(logging.INFO)
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_options(parser, with_config_file=False)
    config = engine_config_from_args(parser.parse_args(
        [*shlex.split(args.flags), "--model", str(args.model_dir)]))
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")  # the CUDA context belongs to the baseline, not the load
    baseline = read_status(os.getpid())
    started = time.perf_counter()
    runner = ModelRunner(RunnerConfig.of(config), model_dir=args.model_dir)
    load_s = time.perf_counter() - started
    out: dict[str, Any] = {"load_s": load_s, "status": read_status(os.getpid()),
                           "baseline": baseline}
    if runner.offload is not None:
        accounting = host_accounting(runner.offload.snapshot())
        out["accounting"] = {"streamed_bytes": accounting.streamed_bytes,
                             "pinned_bytes": accounting.pinned_bytes,
                             "mapped_bytes": accounting.mapped_bytes,
                             "private_bytes": accounting.private_bytes,
                             "pinned_ratio": accounting.pinned_ratio,
                             "problems": list(accounting.problems)}
    plan = runner.pipeline_report().get("plan", [])
    out["parked_bytes"] = sum(int(row["bytes"]) for row in plan
                              if row.get("name") != "transformer"
                              and str(row.get("lives", "")).startswith(("parked", "streamed")))
    out["plan"] = plan
    if torch.cuda.is_available():
        stats = torch.cuda.host_memory_stats()
        out["host_allocator_bytes"] = int(stats.get("allocated_bytes.all.current", 0))
    out["phases"] = phases
    Path(args.report).write_text(json.dumps(out))
    runner.close()
    return 0


def measure(args: argparse.Namespace, model: Path, flags: str) -> dict[str, Any]:
    """Run the child on ``model`` with ``flags``, sampling its memory; its report plus peaks."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--model-dir",
               str(model), "--flags", flags, "--report", str(report)]
        proc = subprocess.Popen(cmd)
        peaks: dict[str, int] = {}
        peak_at: dict[str, float] = {}
        series: list[tuple[float, int, int]] = []  # (time, VmRSS, shared file+shmem pages)
        samples = 0
        while proc.poll() is None:
            status = read_status(proc.pid)
            if status is not None:
                samples += 1
                series.append((time.time(), status.get("VmRSS", 0),
                               status.get("RssFile", 0) + status.get("RssShmem", 0)))
                for key, value in status.items():
                    if value > peaks.get(key, -1):
                        peaks[key], peak_at[key] = value, time.time()
            time.sleep(args.interval)
        if proc.returncode != 0 or not report.is_file():
            raise SystemExit(f"the loading child failed (exit {proc.returncode}): "
                             f"{shlex.join(cmd)}")
        out: dict[str, Any] = json.loads(report.read_text())
    out |= {"flags": flags, "sampled_peaks": peaks, "samples": samples,
            "peak_phase": {key: phase_at(out.get("phases", []), at)
                           for key, at in peak_at.items() if key in ("VmRSS", "RssAnon")}}
    final = out.get("status") or {}
    peak_rss = max(final.get("VmHWM", 0), peaks.get("VmRSS", 0))
    acct = out.get("accounting") or {}
    pinned = int(acct.get("pinned_bytes", 0)) + int(out["parked_bytes"])
    base = out.get("baseline") or {}
    base_rss = int(base.get("VmRSS", 0))
    base_shared = int(base.get("RssFile", 0)) + int(base.get("RssShmem", 0))
    # Judged at every sample: the RSS the load added against 1.15 x pinned plus the mapped
    # checkpoint pages resident at that moment (file or shmem pages, shared with the page
    # cache: DLO's mapping, or safetensors reading a shard it copies from).
    worst = (0.0, 0, 0)  # (ratio, RSS added, bound)
    for _, rss, shared in series:
        bound_t = BOUND * pinned + max(0, shared - base_shared)
        ratio = (rss - base_rss) / bound_t if bound_t else 0.0
        worst = max(worst, (ratio, rss - base_rss, bound_t))
    ratio, loaded_at_worst, bound = worst
    out |= {"peak_rss_bytes": peak_rss, "load_rss_bytes": peak_rss - base_rss,
            "pinned_total_bytes": pinned, "bound_bytes": bound,
            "load_rss_at_worst_bytes": loaded_at_worst,
            "ratio_to_bound": ratio if bound else None}
    return out


def phase_at(phases: list[tuple[float, str]], at: float) -> str:
    """The last log line the child wrote before wall time ``at`` (where a peak fell)."""
    before = [(t, line) for t, line in phases if t <= at]
    if not before:
        return "before the first log line"
    t, line = before[-1]
    return f"{at - t:.1f} s after: {line}"


def table(rows: list[dict[str, Any]]) -> str:
    def gib(n: Any) -> str:
        return "-" if n is None else f"{n / GIB:.2f}"

    lines = ["| flags | streamed GiB | pinned GiB (DLO + parked) | mapped checkpoint GiB (shared)"
             " | peak RSS GiB (above baseline) | peak anon GiB | peak file+shmem GiB"
             " | bound at the worst sample GiB"
             " | load RSS / bound | accounting |", "|" + "---|" * 10]
    for r in rows:
        acct = r.get("accounting") or {}
        peaks = r["sampled_peaks"]
        ratio = r["ratio_to_bound"]
        lines.append(" | ".join([
            f"| `{r['flags']}`", gib(acct.get("streamed_bytes")),
            f"{gib(acct.get('pinned_bytes', 0))} + {gib(r['parked_bytes'])}",
            gib(acct.get("mapped_bytes")),
            f"{gib(r['peak_rss_bytes'])} ({gib(r['load_rss_bytes'])})", gib(peaks.get("RssAnon")),
            gib(peaks.get("RssFile", 0) + peaks.get("RssShmem", 0)), gib(r["bound_bytes"]),
            "-" if ratio is None else f"{ratio:.2f}",
            ("ok" if not acct.get("problems") else "; ".join(acct["problems"]))
            if acct else "-"]) + " |")
    for r in rows:
        for key, where in r.get("peak_phase", {}).items():
            lines.append(f"\n`{r['flags']}`: peak {key} {where}")
    return "\n".join(lines)


def init_random(model: Path, family: str, *, size: str = "full", device: str = "cuda") -> None:
    """Build the random pipeline into ``model`` unless one is there (at full size every
    component at its released shape). A child process builds it, so none of the build's
    memory stays beside the loads measured."""
    if (model / "model_index.json").is_file():
        return
    cmd = [sys.executable, "-P", "-m", "ditserve.engine.cli", "model", "init-random", "--family",
           family, "--size", size, "--components", "all" if size == "full" else "dit",
           "--device", device, str(model)]
    print(f"building {family} at full size in {model}: {shlex.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, default=None,
                   help="a pipeline directory (e.g. from `ditserve model init-random`)")
    p.add_argument("--flags", action="append", default=None,
                   help="engine flags of one load (repeat for several; default "
                        "'--offload dlo')")
    p.add_argument("--interval", type=float, default=0.02, help="sampling period, seconds")
    p.add_argument("--tiny", action="store_true", help="a tiny model on a CPU (a smoke run)")
    p.add_argument("--family", default="flux",
                   help="--tiny: the tiny model's family (ditserve model init-tiny --family)")
    p.add_argument("--init-random", metavar="FAMILY", default=None,
                   help="build a full-size random FAMILY pipeline (ditserve model init-random "
                        "--size full --components all, on the GPU, in a process of its own) "
                        "into --model-dir when it holds none (default dir: "
                        "/dev/shm/ditserve-rss-FAMILY)")
    p.add_argument("--out", type=Path, default=None, help="write host_rss.json and .md here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--report", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.flags = args.flags[0]
        return child(args)
    flag_sets = args.flags or ["--offload dlo"]
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model_dir
        if args.tiny:
            from ditserve.engine.makers.tiny_model import init_tiny

            model = init_tiny(Path(scratch) / "tiny", family=args.family)
            flag_sets = [f"{f} --device cpu --dtype float32" for f in flag_sets]
        elif args.init_random:
            model = model or Path(f"/dev/shm/ditserve-rss-{args.init_random}")
            init_random(model, args.init_random)
        elif model is None:
            p.error("--model-dir is required (or --init-random FAMILY, or --tiny)")
        rows = [measure(args, Path(model), flags) for flags in flag_sets]
    text = table(rows)
    print(text, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host_rss.json").write_text(json.dumps(rows, indent=1))
        (args.out / "host_rss.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
