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
Model, inputs, timer and profiler are ``bench/harness.py``'s; the offload is read through its
typed report (``handle.snapshot()``).

    python3 bench/offload.py --out out/offload
    python3 bench/offload.py --methods resident dlo --resolutions 1024 --batches 1 4 --out $OUT
    python3 bench/offload.py --tiny --methods resident dlo --resolutions 64 --profile-res 64  # CPU
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import harness
import torch

from ditserve.engine.config import OffloadConfig
from ditserve.engine.offload import enable_offload

GIB = harness.GIB
RESOLUTIONS = (1024, 512)
BATCHES = (1, 2, 4)
log = harness.log


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if torch.cuda.is_available() else torch.device("cpu"))
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        self.results: dict[str, Any] = {
            **harness.environment(self.device), "cells": [], "methods": {}, "skipped": [],
        }

    def over_deadline(self) -> bool:
        return time.monotonic() - self.started > self.args.deadline_s

    def save(self) -> None:
        harness.write_json(self.out / "offload_bench.json", self.results)

    def model(self) -> torch.nn.Module:
        return harness.build_flux(self.device, tiny=self.args.tiny)

    def cells(self, method: str, model: torch.nn.Module, batches_for: dict[int, tuple[int, ...]] | None = None) -> None:
        for res in self.args.resolutions:
            for batch in (batches_for or {}).get(res, self.args.batches):
                if self.over_deadline():
                    self.results["skipped"].append(f"{method} {res} b{batch}")
                    continue
                inputs = harness.flux_inputs(model, res, batch, self.device)
                cuda = self.device.type == "cuda"
                if cuda:
                    harness.sync()
                    torch.cuda.reset_peak_memory_stats(self.device)
                times = harness.time_steps(model, inputs, self.args.warmup, self.args.iters)
                cell = {
                    "method": method, "res": res, "batch": batch,
                    "ms": times.median, "ms_all": [round(t, 2) for t in times.ms],
                    "peak_hbm_bytes": torch.cuda.max_memory_allocated(self.device) if cuda else 0,
                    "host_queue_ms": [round(t, 1) for t in times.host_queue_ms],
                }
                self.results["cells"].append(cell)
                log(f"{method:16s} {res}^2 b{batch}: {cell['ms']:8.1f} ms/step, "
                    f"peak {cell['peak_hbm_bytes'] / GIB:6.2f} GiB")
                del inputs
                self.save()

    def run(self) -> None:
        a = self.args
        log(f"GPU {self.results['gpu']}, torch {torch.__version__}")
        self.results["h2d"] = harness.measure_h2d(self.device)
        log(f"pinned H2D: {self.results['h2d']}")

        model = self.model()
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
            harness.release_host_cache()
            info = {"enable_s": time.monotonic() - t0,
                    "report_at_start": handle.snapshot().to_json(), "rss_gib": harness.rss_gib()}
            log(f"dlo enabled in {info['enable_s']:.1f}s: {info['report_at_start']}")
            self.results["methods"]["dlo"] = info
            self.cells("dlo", model)
            if not self.over_deadline():
                before = handle.snapshot().traffic.bytes_transferred
                info["profile"] = harness.profile_steps(
                    model, harness.flux_inputs(model, self.args.profile_res, 1, self.device), 3,
                    self.out / "dlo_trace.json.gz")
                moved = handle.snapshot().traffic.bytes_transferred - before
                info["bytes_per_profiled_step"] = moved / 4
                log(f"dlo profile: {info['profile']}")
            info["report_at_end"] = handle.snapshot().to_json()
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
            harness.release_host_cache()
            info = {"budget_gib": budget, "enable_s": time.monotonic() - t0,
                    "report_at_start": handle.snapshot().to_json()}
            log(f"dlo-budget ({budget} GiB) enabled: {info['report_at_start']}")
            self.results["methods"]["dlo-budget"] = info
            self.cells("dlo-budget", model)
            info["report_at_end"] = handle.snapshot().to_json()
            handle.disable()
            self.save()
        del model
        harness.release_host_cache()

        for method, offload_type in (("diffusers-block", "block_level"), ("diffusers-leaf", "leaf_level")):
            if method not in a.methods or self.over_deadline():
                continue
            model = self.model()
            before = harness.host_pinned_stats()
            t0 = time.monotonic()
            kwargs: dict[str, Any] = dict(
                onload_device=self.device, offload_device=torch.device("cpu"),
                offload_type=offload_type, use_stream=self.device.type == "cuda",
                record_stream=self.device.type == "cuda")
            if offload_type == "block_level":
                kwargs["num_blocks_per_group"] = 1
            model.enable_group_offload(**kwargs)  # type: ignore[operator]
            harness.release_device_cache()
            info = {"enable_s": time.monotonic() - t0, "host_pinned_before": before,
                    "host_pinned_after": harness.host_pinned_stats(), "rss_gib": harness.rss_gib(),
                    "pinned_bytes_pow2_estimate": sum(
                        1 << max(p.numel() * p.element_size() - 1, 0).bit_length()
                        for p in model.parameters())}
            log(f"{method} enabled in {info['enable_s']:.1f}s, pinned {info['host_pinned_after']}")
            self.results["methods"][method] = info
            self.cells(method, model)
            if method == "diffusers-block" and not self.over_deadline():
                info["profile"] = harness.profile_steps(
                    model, harness.flux_inputs(model, self.args.profile_res, 1, self.device), 2,
                    self.out / "diffusers_block_trace.json.gz")
                log(f"{method} profile: {info['profile']}")
            del model
            harness.release_host_cache()
            self.save()
        self.results["targets"] = targets(self.results)
        self.save()
        table = markdown_table(self.results)
        (self.out / "offload_bench.md").write_text(table)
        print(table, flush=True)


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
    rows = []
    for res, batch in dict.fromkeys((c["res"], c["batch"]) for c in r["cells"]):
        row = [str(res), str(batch)]
        for m in methods:
            c = cell(r, m, res, batch)
            row.append(f"{c['ms']:.0f} ({c['peak_hbm_bytes'] / GIB:.1f})" if c else "-")
        rows.append(row)
    lines += harness.md_table(["res", "batch", *(f"{m} ms/step (peak GiB)" for m in methods)],
                              rows)
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
    p.add_argument("--profile-res", type=int, default=1024,
                   help="resolution of the profiled batch-1 steps")
    p.add_argument("--tiny", action="store_true", help="small model: smoke-test on a CPU")
    p.add_argument("--methods", nargs="+",
                   default=["resident", "dlo", "dlo-budget", "diffusers-block", "diffusers-leaf"])
    args = p.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
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
