#!/usr/bin/env python3
"""Layerwise offload on one GPU: resident vs ditserve DLO vs diffusers group offloading.

One process, one random Flux-sized transformer (diffusers ``FluxTransformer2DModel`` default
config with guidance embeds: 11.9B parameters, bf16), 1024x1024 and 512x512 latents, batch
1/2/4. Methods:

- ``resident``: the whole transformer in HBM (the compute floor);
- ``dlo``: ``enable_offload`` with every block streamed;
- ``dlo-budget``: ``enable_offload`` with ``hbm_budget_gib`` at half the model;
- ``diffusers-block`` / ``diffusers-leaf``: ``enable_group_offload`` with
  block_level (num_blocks_per_group=1) and leaf_level, both use_stream=True, record_stream=True.

Reports ms/step (median of CUDA-event timings), peak HBM, pinned host bytes, the measured
pinned H2D bandwidth, host-synchronizing CUDA calls per step (torch profiler), and checks the
issue's targets. Prints a table; writes JSON, a markdown table and profiler traces to --out.

    python3 bench/offload.py --out out/offload
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from ditserve.engine.config import OffloadConfig
from ditserve.engine.offload import enable_offload
from ditserve.engine.offload.movement.copy_stream import make_transfer

GIB = 1024**3
RESOLUTIONS = (1024, 512)
BATCHES = (1, 2, 4)
TEXT_TOKENS = 512
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --tiny: a small config with the same structure, to smoke-test this script on a CPU.
TINY = dict(num_layers=3, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=64, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))
MODEL_KWARGS: dict[str, Any] = {}


def build_flux(device: torch.device, seed: int = 0, **config: Any) -> torch.nn.Module:
    """The default Flux transformer, random bf16 weights made on the GPU (no CPU init);
    ``config`` overrides MODEL_KWARGS (e.g. fewer blocks)."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model: Any = FluxTransformer2DModel(guidance_embeds=True, **{**MODEL_KWARGS, **config})
    model = model.to(torch.bfloat16).to_empty(device=device).eval()
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
        for b in model.buffers():
            b.zero_()
    return model


def flux_inputs(res: int, batch: int, device: torch.device) -> dict[str, Any]:
    side = res // 16  # VAE /8, then 2x2 patch packing
    g = torch.Generator(device=device).manual_seed(1)
    bf16 = torch.bfloat16

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=bf16)

    img_ids = torch.zeros(side, side, 3, device=device)
    img_ids[..., 1] = torch.arange(side, device=device)[:, None]
    img_ids[..., 2] = torch.arange(side, device=device)[None, :]
    cfg = {"in_channels": 64, "joint_attention_dim": 4096, "pooled_projection_dim": 768}
    cfg.update({k: v for k, v in MODEL_KWARGS.items() if k in cfg})
    return dict(
        hidden_states=randn(batch, side * side, cfg["in_channels"]),
        encoder_hidden_states=randn(batch, TEXT_TOKENS, cfg["joint_attention_dim"]),
        pooled_projections=randn(batch, cfg["pooled_projection_dim"]),
        timestep=torch.full((batch,), 0.5, device=device, dtype=bf16),
        guidance=torch.full((batch,), 3.5, device=device, dtype=bf16),
        img_ids=img_ids.reshape(-1, 3),
        txt_ids=torch.zeros(TEXT_TOKENS, 3, device=device),
        return_dict=False,
    )


HOST_MS: list[float] = []  # host time to queue each timed step (last cell): is the host ahead?


def time_steps(model: torch.nn.Module, inputs: dict[str, Any], warmup: int, iters: int) -> list[float]:
    """Per-step ms from CUDA events; steps are queued back to back like a denoise loop."""
    if not torch.cuda.is_available():  # --tiny smoke run on a CPU: wall clock
        with torch.no_grad():
            for _ in range(warmup):
                model(**inputs)
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                model(**inputs)
                times.append((time.perf_counter() - t0) * 1e3)
        return times
    with torch.no_grad():
        for _ in range(warmup):
            model(**inputs)
        sync()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        HOST_MS.clear()
        for s, e in zip(starts, ends, strict=True):
            t0 = time.perf_counter()
            s.record()
            model(**inputs)
            e.record()
            HOST_MS.append((time.perf_counter() - t0) * 1e3)
        sync()
    return [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]


def copy_gbps(dev: torch.Tensor, host: torch.Tensor, stream: Any, reps: int) -> float:
    """GB/s of ``dev.copy_(host)`` on ``stream`` (median of ``reps`` CUDA-event timings)."""
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            s.record(stream)
            dev.copy_(host, non_blocking=True)
            e.record(stream)
        e.synchronize()
        times.append(s.elapsed_time(e))
    return host.numel() * host.element_size() / (statistics.median(times) * 1e-3) / 1e9


def measure_h2d(device: torch.device, nbytes: int = 2 * GIB, reps: int = 10) -> dict[str, float]:
    """Pinned host -> device copy bandwidth (GB/s), on a side stream like DLO's copies."""
    out: dict[str, float] = {}
    if device.type != "cuda":
        return {"registered_gbps": float("nan"), "caching-allocator_gbps": float("nan")}
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device=device)
    transfer = make_transfer(device)
    sources = {"registered": transfer.allocate_host(nbytes)}
    sources["registered"].fill_(1)
    sources["caching-allocator"] = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    for name, host in sources.items():
        out[f"{name}_gbps"] = copy_gbps(dev, host, stream, reps)
    out["registered_backing"] = transfer.backing  # type: ignore[assignment]
    transfer.free_host(sources["registered"])
    del sources, dev
    release_host_cache()
    return out


def release_host_cache() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def host_pinned_stats() -> dict[str, int]:
    try:
        stats = torch.cuda.host_memory_stats()
    except Exception:  # not a CUDA build, or no host allocator stats in this torch
        return {}
    return {k: int(v) for k, v in stats.items() if "bytes" in k and "current" in k}


def rss_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / GIB
    return float("nan")


def guest_physical_gib(address: int) -> float | None:
    """(Guest-)physical address in GiB of the page holding ``address``, from
    /proc/self/pagemap; None where the page is not present or the frame numbers are hidden
    (they read as 0 without CAP_SYS_ADMIN)."""
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(address // 4096 * 8)
            entry = int.from_bytes(f.read(8), "little")
    except OSError:
        return None
    pfn = entry & ((1 << 55) - 1) if entry >> 63 else 0  # bit 63: present; bits 0-54: frame
    return pfn * 4096 / GIB if pfn else None


def profile_steps(model: torch.nn.Module, inputs: dict[str, Any], steps: int, path: Path) -> dict[str, Any]:
    """Profile steady-state steps; count host-synchronizing CUDA calls inside them.

    Each step runs under a ``bench_step`` range, so the profiler's own synchronize at stop
    (after the last step) is not counted. Also reports how busy the copy engine was.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with torch.no_grad():
        model(**inputs)  # warm
        sync()
        with profile(activities=activities) as prof:
            for _ in range(steps):
                with record_function("bench_step"):
                    model(**inputs)
    sync()
    raw = path.with_suffix("")
    prof.export_chrome_trace(str(raw))
    result = analyze_trace(json.loads(raw.read_text())["traceEvents"], steps)
    with open(raw, "rb") as src, gzip.open(path, "wb", compresslevel=6) as dst:
        dst.write(src.read())
    raw.unlink()
    result["trace"] = path.name
    return result


def analyze_trace(events: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    ranges = [(e["ts"], e["ts"] + e["dur"]) for e in events
              if e.get("name") == "bench_step" and e.get("cat") == "user_annotation"]

    def inside(e: dict[str, Any]) -> bool:
        return any(a <= e["ts"] <= b for a, b in ranges)

    runtime = [e for e in events if e.get("cat") == "cuda_runtime" and inside(e)]
    counts = Counter(e["name"] for e in runtime)
    copies = sorted((e for e in events if e.get("cat") == "gpu_memcpy"), key=lambda e: e["ts"])
    result: dict[str, Any] = {
        "steps": steps,
        "sync_calls_per_step": {n: counts.get(n, 0) / steps for n in SYNC_CALLS},
        "memcpy_async_per_step": counts.get("cudaMemcpyAsync", 0) / steps,
        "stream_wait_event_per_step": counts.get("cudaStreamWaitEvent", 0) / steps,
    }
    if copies:
        busy = sum(e["dur"] for e in copies)
        span = copies[-1]["ts"] + copies[-1]["dur"] - copies[0]["ts"]
        nbytes = sum(int(e.get("args", {}).get("bytes", 0)) for e in copies)
        result["h2d_busy_fraction"] = busy / span if span else None
        result["h2d_gbps_while_busy"] = nbytes / (busy * 1e-6) / 1e9 if busy else None
    return result


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if torch.cuda.is_available() else torch.device("cpu"))
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        self.results: dict[str, Any] = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "gpu": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cells": [],
            "methods": {},
            "skipped": [],
        }

    def over_deadline(self) -> bool:
        return time.monotonic() - self.started > self.args.deadline_s

    def save(self) -> None:
        (self.out / "offload_bench.json").write_text(json.dumps(self.results, indent=1))

    def cells(self, method: str, model: torch.nn.Module, batches_for: dict[int, tuple[int, ...]] | None = None) -> None:
        for res in self.args.resolutions:
            for batch in (batches_for or {}).get(res, self.args.batches):
                if self.over_deadline():
                    self.results["skipped"].append(f"{method} {res} b{batch}")
                    continue
                inputs = flux_inputs(res, batch, self.device)
                cuda = self.device.type == "cuda"
                if cuda:
                    sync()
                    torch.cuda.reset_peak_memory_stats(self.device)
                times = time_steps(model, inputs, self.args.warmup, self.args.iters)
                cell = {
                    "method": method, "res": res, "batch": batch,
                    "ms": statistics.median(times), "ms_all": [round(t, 2) for t in times],
                    "peak_hbm_bytes": torch.cuda.max_memory_allocated(self.device) if cuda else 0,
                    "host_queue_ms": [round(t, 1) for t in HOST_MS],
                }
                self.results["cells"].append(cell)
                log(f"{method:16s} {res}^2 b{batch}: {cell['ms']:8.1f} ms/step, "
                    f"peak {cell['peak_hbm_bytes'] / GIB:6.2f} GiB")
                del inputs
                self.save()

    def run(self) -> None:
        a = self.args
        log(f"GPU {self.results['gpu']}, torch {torch.__version__}")
        self.results["h2d"] = measure_h2d(self.device)
        log(f"pinned H2D: {self.results['h2d']}")

        model = build_flux(self.device)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        self.results["model"] = {
            "params": sum(p.numel() for p in model.parameters()), "bytes": weights,
        }
        log(f"model: {self.results['model']['params'] / 1e9:.2f}B params, {weights / GIB:.2f} GiB")
        if "resident" in a.methods:
            self.results["methods"]["resident"] = {"weights_bytes": weights}
            self.cells("resident", model)

        if "dlo" in a.methods:
            t0 = time.monotonic()
            handle = enable_offload(model, OffloadConfig(enabled=True), device=self.device)
            release_host_cache()
            info = {"enable_s": time.monotonic() - t0, "report_at_start": handle.report(),
                    "rss_gib": rss_gib()}
            log(f"dlo enabled in {info['enable_s']:.1f}s: {info['report_at_start']}")
            self.results["methods"]["dlo"] = info
            self.cells("dlo", model)
            if not self.over_deadline():
                before = handle.report()["bytes_transferred"]
                info["profile"] = profile_steps(
                    model, flux_inputs(1024, 1, self.device), 3, self.out / "dlo_trace.json.gz")
                info["bytes_per_profiled_step"] = (handle.report()["bytes_transferred"] - before) / 4
                log(f"dlo profile: {info['profile']}")
            info["report_at_end"] = handle.report()
            handle.disable()
            self.save()

        if "dlo-budget" in a.methods:
            budget = a.budget_gib or round(weights / 2 / GIB, 2)
            if a.tiny:
                budget = a.budget_gib or weights / 2 / GIB
            t0 = time.monotonic()
            reserve = None if a.activation_reserve_gib is None else int(a.activation_reserve_gib * GIB)
            handle = enable_offload(
                model, OffloadConfig(enabled=True, hbm_budget_gib=budget), device=self.device,
                activation_reserve_bytes=reserve)
            release_host_cache()
            info = {"budget_gib": budget, "enable_s": time.monotonic() - t0,
                    "report_at_start": handle.report()}
            log(f"dlo-budget ({budget} GiB) enabled: {info['report_at_start']}")
            self.results["methods"]["dlo-budget"] = info
            self.cells("dlo-budget", model)
            info["report_at_end"] = handle.report()
            handle.disable()
            self.save()
        del model
        release_host_cache()

        for method, offload_type in (("diffusers-block", "block_level"), ("diffusers-leaf", "leaf_level")):
            if method not in a.methods or self.over_deadline():
                continue
            model = build_flux(self.device)
            before = host_pinned_stats()
            t0 = time.monotonic()
            kwargs: dict[str, Any] = dict(
                onload_device=self.device, offload_device=torch.device("cpu"),
                offload_type=offload_type, use_stream=self.device.type == "cuda",
                record_stream=self.device.type == "cuda")
            if offload_type == "block_level":
                kwargs["num_blocks_per_group"] = 1
            model.enable_group_offload(**kwargs)  # type: ignore[operator]
            release_host_cache_device_only()
            info = {"enable_s": time.monotonic() - t0, "host_pinned_before": before,
                    "host_pinned_after": host_pinned_stats(), "rss_gib": rss_gib(),
                    "pinned_bytes_pow2_estimate": sum(
                        1 << max(p.numel() * p.element_size() - 1, 0).bit_length()
                        for p in model.parameters())}
            log(f"{method} enabled in {info['enable_s']:.1f}s, pinned {info['host_pinned_after']}")
            self.results["methods"][method] = info
            self.cells(method, model)
            if method == "diffusers-block" and not self.over_deadline():
                info["profile"] = profile_steps(model, flux_inputs(1024, 1, self.device), 2,
                                                self.out / "diffusers_block_trace.json.gz")
                log(f"{method} profile: {info['profile']}")
            del model
            release_host_cache()
            self.save()
        self.results["targets"] = targets(self.results)
        self.save()
        table = markdown_table(self.results)
        (self.out / "offload_bench.md").write_text(table)
        print(table, flush=True)


def release_host_cache_device_only() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def cell(results: dict[str, Any], method: str, res: int, batch: int) -> dict[str, Any] | None:
    for c in results["cells"]:
        if (c["method"], c["res"], c["batch"]) == (method, res, batch):
            return c
    return None


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with measured value, bound and verdict."""
    out: list[dict[str, Any]] = []
    bw = r["h2d"]["registered_gbps"] * 1e9  # bytes/s
    dlo = r["methods"].get("dlo", {}).get("report_at_start")
    budget = r["methods"].get("dlo-budget", {}).get("report_at_start")

    def add(name: str, value: float | None, bound: float | None, unit: str) -> None:
        ok = None if value is None or bound is None else value <= bound
        out.append({"target": name, "value": value, "bound": bound, "unit": unit, "ok": ok})

    c = cell(r, "dlo", 1024, 1)
    if dlo and c:
        add("transfer-bound: DLO b1 1024^2 <= 1.02 x streamed/bandwidth", c["ms"],
            1.02 * dlo["streamed_bytes"] / bw * 1e3, "ms")
        best = [cell(r, m, 1024, 1) for m in ("diffusers-block", "diffusers-leaf")]
        best_ms = min((x["ms"] for x in best if x), default=None)
        if best_ms:
            add("DLO b1 1024^2 at least 1.13x faster than diffusers' best", c["ms"] * 1.13, best_ms, "ms")
    c, res_c = cell(r, "dlo", 1024, 4), cell(r, "resident", 1024, 4)
    if c and res_c:
        add("compute-bound: DLO b4 1024^2 <= 1.02 x resident", c["ms"], 1.02 * res_c["ms"], "ms")
    c = cell(r, "dlo-budget", 1024, 1)
    if budget and c:
        add("budget: DLO b1 1024^2 <= 1.02 x streamed(remaining)/bandwidth", c["ms"],
            1.02 * budget["streamed_bytes"] / bw * 1e3, "ms")
    if dlo:
        weights = r["model"]["bytes"]
        for res in RESOLUTIONS:
            for batch in BATCHES:
                c, rc = cell(r, "dlo", res, batch), cell(r, "resident", res, batch)
                if c and rc:
                    activations = rc["peak_hbm_bytes"] - weights
                    bound = 2 * dlo["slot_bytes"] + activations + dlo["resident_module_bytes"]
                    add(f"peak HBM {res}^2 b{batch} <= 2 x largest block + activations + resident",
                        c["peak_hbm_bytes"] / GIB, bound / GIB, "GiB")
        add("host pinned <= 1.02 x streamed bytes", dlo["pinned_host_bytes"] / GIB,
            1.02 * dlo["streamed_bytes"] / GIB, "GiB")
        prof = r["methods"]["dlo"].get("profile")
        if prof:
            add("host-blocking CUDA syncs per steady-state step", sum(prof["sync_calls_per_step"].values()), 0, "calls")
    return out


def markdown_table(r: dict[str, Any]) -> str:
    methods = [m for m in ("resident", "dlo", "dlo-budget", "diffusers-block", "diffusers-leaf")
               if any(c["method"] == m for c in r["cells"])]
    lines = [f"GPU: {r['gpu']}, torch {r['torch']}, {r['date']}; model "
             f"{r['model']['params'] / 1e9:.2f}B params ({r['model']['bytes'] / GIB:.2f} GiB bf16); "
             f"pinned H2D {r['h2d']['registered_gbps']:.1f} GB/s (registered), "
             f"{r['h2d']['caching-allocator_gbps']:.1f} GB/s (caching allocator)", ""]
    head = "| res | batch | " + " | ".join(f"{m} ms/step (peak GiB)" for m in methods) + " |"
    lines += [head, "|" + "---|" * (2 + len(methods))]
    for res in RESOLUTIONS:
        for batch in BATCHES:
            row = [str(res), str(batch)]
            for m in methods:
                c = cell(r, m, res, batch)
                row.append(f"{c['ms']:.0f} ({c['peak_hbm_bytes'] / GIB:.1f})" if c else "-")
            lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines.append("| method | streamed GiB/step | pinned host GiB | notes |")
    lines.append("|---|---|---|---|")
    for m in ("dlo", "dlo-budget"):
        rep = r["methods"].get(m, {}).get("report_at_start")
        if rep:
            lines.append(f"| {m} | {rep['streamed_bytes'] / GIB:.2f} | {rep['pinned_host_bytes'] / GIB:.2f} | "
                         f"{rep['streamed_blocks']} streamed / {rep['resident_blocks']} resident blocks, "
                         f"slot {rep['slot_bytes'] / GIB:.2f} GiB, {rep['backing']} |")
    for m in ("diffusers-block", "diffusers-leaf"):
        info = r["methods"].get(m)
        if info:
            # Pinned bytes held by the caching host allocator for this model (its
            # "allocated" counter; "active" also counts freed blocks it keeps cached).
            after = info.get("host_pinned_after", {}).get("allocated_bytes.current")
            before = info.get("host_pinned_before", {}).get("allocated_bytes.current", 0)
            pinned = after - before if after else info["pinned_bytes_pow2_estimate"]
            lines.append(f"| {m} | {r['model']['bytes'] / GIB:.2f} | {pinned / GIB:.2f} | "
                         f"caching host allocator (power-of-two rounding) |")
    lines.append("")
    lines.append("| target | value | bound | ok |")
    lines.append("|---|---|---|---|")
    for t in r.get("targets", []):
        v = "-" if t["value"] is None else f"{t['value']:.2f} {t['unit']}"
        b = "-" if t["bound"] is None else f"{t['bound']:.2f} {t['unit']}"
        lines.append(f"| {t['target']} | {v} | {b} | {'yes' if t['ok'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out/offload"))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--budget-gib", type=float, default=None, help="default: half the model")
    p.add_argument("--activation-reserve-gib", type=float, default=None,
                   help="HBM the budget keeps for activations (default: the library's)")
    p.add_argument("--deadline-s", type=float, default=420.0, help="skip cells after this")
    p.add_argument("--resolutions", type=int, nargs="+", default=list(RESOLUTIONS))
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--tiny", action="store_true", help="small model: smoke-test on a CPU")
    p.add_argument("--methods", nargs="+",
                   default=["resident", "dlo", "dlo-budget", "diffusers-block", "diffusers-leaf"])
    args = p.parse_args(argv)
    if args.tiny:
        MODEL_KWARGS.update(TINY)
    elif not torch.cuda.is_available():
        print("bench/offload.py needs a CUDA device (or --tiny for a CPU smoke run)", file=sys.stderr)
        return 2
    bench = Bench(args)
    try:
        bench.run()
    finally:
        bench.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
