"""Resident vs ditserve DLO vs diffusers group offloading of one DiT on one GPU: the runner that
``offload_families.py`` and ``offload_conditioned.py`` share (a module, not a program).

A program describes its DiTs with a ``Models`` record (how to build one, the timed forwards,
its own targets) and hands it to ``Comparison`` with the parsed ``add_arguments`` options.
For each method the comparison builds a fresh random DiT, puts it under the method, times
every workload cell (median of CUDA-event timings, peak HBM), and checks the shared targets
(peak HBM under DLO, pinned host bytes) plus the program's own. It prints a markdown table
and writes JSON and markdown to ``--out``. ``--tiny`` runs the same path on a CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
import torch

from ditserve.engine.config import OffloadConfig
from ditserve.engine.offload import enable_offload

GIB = 1024**3
METHODS = ("resident", "dlo", "diffusers-block", "diffusers-leaf")
Workload = tuple[str, Callable[[], Any]]
Target = dict[str, Any]


@dataclass(frozen=True)
class Models:
    """What a program compares. ``build_dit(model, size, device, seed, stock_blocks)``: a random
    bf16 DiT on ``device``; ``workloads(model, size, batches, dit, device)``: (cell label, one
    denoise forward) per timed cell; ``block_lists(model, dit)``: DLO's block lists when the
    DiT does not declare its own; ``targets(results)``: the program's own targets;
    ``compares(model, method)``: False for a method a model is not compared under."""

    build_dit: Callable[[str, str, torch.device, int, bool], torch.nn.Module]
    workloads: Callable[[str, str, tuple[int, ...], torch.nn.Module, torch.device],
                        list[Workload]]
    targets: Callable[[dict[str, Any]], list[Target]]
    block_lists: Callable[[str, torch.nn.Module], tuple[str, ...] | None] = (
        lambda model, dit: None)
    compares: Callable[[str, str], bool] = lambda model, method: True
    # DLO's host_modules: modules that stay in host memory (Cosmos3's token table and head).
    host_modules: Callable[[str, torch.nn.Module, torch.device], Any] = (
        lambda model, dit, device: ())


def add_arguments(p: argparse.ArgumentParser, *, models: tuple[str, ...], out: str,
                  methods: tuple[str, ...] = METHODS) -> None:
    """The options every comparison program takes."""
    p.add_argument("--model", choices=models, required=True)
    p.add_argument("--size", default=None, help="WIDTHxHEIGHT (images) or WxHxFRAMES (video)")
    p.add_argument("--batches", type=int, nargs="+", default=None)
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(methods))
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=None, help="timed steps per cell")
    p.add_argument("--out", default=out)
    p.add_argument("--tiny", action="store_true", help="tiny DiTs: a smoke run on a CPU")
    p.add_argument("--stock-blocks", action="store_true",
                   help="Wan: diffusers' own block forward (whole-sequence float32 math) "
                        "instead of the engine's sliced one")


def run(program: str, args: argparse.Namespace, models: Models) -> int:
    """Run the comparison ``args`` asks for; 2 without CUDA unless ``--tiny``."""
    if not args.tiny and not torch.cuda.is_available():
        print(f"bench/{program} needs a CUDA device (or --tiny on a CPU)", file=sys.stderr)
        return 2
    comparison = Comparison(args, models)
    try:
        comparison.run()
    finally:
        comparison.save()
    return 0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def release_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        empty = getattr(torch._C, "_host_emptyCache", None)  # the pinned caching allocator
        if empty is not None:
            empty()


def time_steps(step: Callable[[], Any], warmup: int, iters: int) -> list[float]:
    """Per-step ms from CUDA events; steps are queued back to back like a denoise loop."""
    with torch.no_grad():
        for _ in range(warmup):
            step()
        if not torch.cuda.is_available():  # --tiny on a CPU: wall clock
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                step()
                times.append((time.perf_counter() - t0) * 1e3)
            return times
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters)]
        for start, end in events:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def h2d_gbps(device: torch.device, nbytes: int = 2 * GIB, reps: int = 8) -> float | None:
    """Pinned host -> device copy rate on a side stream (as DLO's copies), GB/s."""
    if device.type != "cuda":
        return None
    host = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    gbps = harness.copy_gbps(dev, host, torch.cuda.Stream(device=device), reps)
    del host, dev
    release_memory()
    return gbps


def pinned_allocated() -> int:
    try:
        return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
    except Exception:  # not a CUDA build
        return 0


def weight_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def plain(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.items() if isinstance(v, (int, float, str, bool, type(None)))}


class Comparison:
    """One model under each method in turn; see the module docstring."""

    def __init__(self, args: argparse.Namespace, models: Models) -> None:
        self.args, self.models = args, models
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if torch.cuda.is_available() else torch.device("cpu"))
        self.dit_size = "tiny" if args.tiny else "full"
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.results: dict[str, Any] = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "gpu": (torch.cuda.get_device_name(self.device) if self.device.type == "cuda"
                    else "cpu"),
            "torch": torch.__version__, "python": platform.python_version(),
            "model": args.model, "size": args.size, "command": " ".join(sys.argv),
            "cells": [], "methods": {},
            "wan_blocks": "stock" if args.stock_blocks else "sliced float32 math (engine)",
            "quantization": getattr(args, "quantization", None),
            "baseline": getattr(args, "baseline", None),  # another run's results, to compare
        }

    def save(self) -> None:
        (self.out / "offload_families.json").write_text(json.dumps(self.results, indent=1))

    def enable(self, method: str, dit: torch.nn.Module) -> dict[str, Any]:
        """Put ``dit`` under ``method``; what it reports about itself."""
        cuda = self.device.type == "cuda"
        started, before = time.monotonic(), pinned_allocated()
        info: dict[str, Any] = {}
        if method == "resident":
            info["weights_bytes"] = weight_bytes(dit)
        elif method == "dlo":
            handle = enable_offload(dit, OffloadConfig(enabled=True), device=self.device,
                                    block_lists=self.models.block_lists(self.args.model, dit),
                                    host_modules=self.models.host_modules(
                                        self.args.model, dit, self.device))
            info["handle"] = handle
            info["report"] = plain(handle.report())
        else:
            kwargs: dict[str, Any] = dict(
                onload_device=self.device, offload_device=torch.device("cpu"),
                offload_type="block_level" if method == "diffusers-block" else "leaf_level",
                use_stream=cuda, record_stream=cuda)
            if method == "diffusers-block":
                kwargs["num_blocks_per_group"] = 1
            dit.enable_group_offload(**kwargs)  # type: ignore[operator]
            info["pinned_host_bytes"] = pinned_allocated() - before
        release_memory()
        info["enable_s"] = time.monotonic() - started
        return info

    def run(self) -> None:
        a = self.args
        self.results["h2d_gbps"] = h2d_gbps(self.device)
        log(f"{self.results['gpu']}: pinned H2D {self.results['h2d_gbps']} GB/s")
        for method in a.methods:
            if not self.models.compares(a.model, method):
                continue
            dit = self.models.build_dit(a.model, self.dit_size, self.device, 0, a.stock_blocks)
            if getattr(a, "quantization", None):  # in place, layer by layer, before offload
                from ditserve.engine.weights.quantize import quantize_dit

                quantize_dit(dit, a.quantization, device=self.device)
                release_memory()
            self.results.setdefault("weights_bytes", weight_bytes(dit))
            info = self.enable(method, dit)
            handle = info.pop("handle", None)
            self.results["methods"][method] = info
            log(f"{method}: enabled in {info['enable_s']:.1f}s")
            self.time_cells(method, dit)
            if handle is not None:
                info["report_at_end"] = plain(handle.report())
                handle.disable()
            del dit, handle
            release_memory()
            self.save()
        self.results["targets"] = shared_targets(self.results) + self.models.targets(
            self.results)
        self.save()
        table = markdown(self.results)
        (self.out / "offload_families.md").write_text(table)
        print(table, flush=True)

    def time_cells(self, method: str, dit: torch.nn.Module) -> None:
        """Every workload's cell; its step closures (which hold ``dit``) die with this frame,
        so ``release_memory`` can free the model before the next method is built (an
        instance-level block forward makes a block a reference cycle, freed only by gc)."""
        a = self.args
        for label, step in self.models.workloads(a.model, a.size, tuple(a.batches), dit,
                                                 self.device):
            self.time_cell(method, label, step)

    def time_cell(self, method: str, label: str, step: Callable[[], Any]) -> None:
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(self.device)
        times = time_steps(step, self.args.warmup, self.args.iters)
        cell: dict[str, Any] = {"method": method, "cell": label, "ms": statistics.median(times),
                "ms_all": [round(t, 1) for t in times],
                "peak_hbm_bytes": torch.cuda.max_memory_allocated(self.device) if cuda else 0}
        self.results["cells"].append(cell)
        log(f"{method:16s} {label:14s} {cell['ms']:9.1f} ms/step, peak "
            f"{cell['peak_hbm_bytes'] / GIB:6.2f} GiB")


def find(r: dict[str, Any], method: str, label: str) -> dict[str, Any] | None:
    return next((c for c in r["cells"] if (c["method"], c["cell"]) == (method, label)), None)


def target(name: str, value: float | None, bound: float | None, unit: str) -> Target:
    ok = None if value is None or bound is None else value <= bound
    return {"target": name, "value": value, "bound": bound, "unit": unit, "ok": ok}


def shared_targets(r: dict[str, Any]) -> list[Target]:
    """Every model's DLO bounds: peak HBM per cell, and pinned host bytes."""
    dlo = r["methods"].get("dlo", {}).get("report")
    if not dlo:
        return []
    out = []
    for label in sorted({c["cell"] for c in r["cells"]}):
        d, res = find(r, "dlo", label), find(r, "resident", label)
        if d and res and res["peak_hbm_bytes"]:
            activations = res["peak_hbm_bytes"] - r["weights_bytes"]
            bound = 2 * dlo["slot_bytes"] + activations + dlo["resident_module_bytes"]
            out.append(target(f"peak HBM {label} <= 2 x largest block + activations + "
                              "resident modules", d["peak_hbm_bytes"] / GIB, bound / GIB, "GiB"))
    out.append(target("DLO pinned host <= 1.02 x streamed bytes", dlo["pinned_host_bytes"] / GIB,
                      1.02 * dlo["streamed_bytes"] / GIB, "GiB"))
    return out


def markdown(r: dict[str, Any]) -> str:
    methods = [m for m in METHODS if any(c["method"] == m for c in r["cells"])]
    labels = list(dict.fromkeys(c["cell"] for c in r["cells"]))
    gbps = r.get("h2d_gbps")
    lines = [f"{r['model']} {r['size']}: {r['weights_bytes'] / GIB:.1f} GiB "
             f"{r.get('quantization') or 'bf16'} DiT weights; "
             f"{r['gpu']}, torch {r['torch']}, {r['date']}; pinned H2D "
             f"{'-' if gbps is None else f'{gbps:.1f} GB/s'}", "",
             "| cell | " + " | ".join(f"{m} ms/step (peak GiB)" for m in methods) + " |",
             "|" + "---|" * (1 + len(methods))]
    for label in labels:
        row = [label]
        for m in methods:
            c = find(r, m, label)
            row.append(f"{c['ms']:.0f} ({c['peak_hbm_bytes'] / GIB:.1f})" if c else "-")
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "| method | pinned host GiB | notes |", "|---|---|---|"]
    for m in methods:
        info = r["methods"][m]
        if m == "dlo":
            rep = info["report"]
            lines.append(f"| dlo | {rep['pinned_host_bytes'] / GIB:.2f} | {rep['streamed_blocks']} "
                         f"blocks streamed ({rep['streamed_bytes'] / GIB:.1f} GiB/pass), "
                         f"{rep['slots']} slots x {rep['slot_bytes'] / GIB:.2f} GiB |")
        elif "pinned_host_bytes" in info:
            lines.append(f"| {m} | {info['pinned_host_bytes'] / GIB:.2f} | caching host "
                         "allocator (power-of-two rounding) |")
    lines += ["", "| target | value | bound | ok |", "|---|---|---|---|"]
    for t in r.get("targets", []):
        v = "-" if t["value"] is None else f"{t['value']:.2f} {t['unit']}"
        b = "-" if t["bound"] is None else f"{t['bound']:.2f} {t['unit']}"
        ok = "-" if t["ok"] is None else "yes" if t["ok"] else "NO"  # None: nothing to judge
        lines.append(f"| {t['target']} | {v} | {b} | {ok} |")
    return "\n".join(lines) + "\n"
