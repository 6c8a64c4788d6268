#!/usr/bin/env python3
"""Layerwise offload for the Qwen-Image and Wan families on one GPU: resident vs ditserve
DLO vs diffusers group offloading.

One process per model, random full-size DiTs built in memory (bf16, initialized on the GPU;
nothing is written to disk), the shapes of the released models (``engine.model_builders``):

- ``--model qwen-image``: Qwen-Image (20.4B) at 1024x1024, batch 1 and 4;
- ``--model wan``: Wan2.1-T2V-14B at 832x480, 81 frames, batch 1 (``--size 1280x720x81``
  for 720p);
- ``--model wan2.2``: Wan2.2-T2V-A14B, two 14B experts as one ``ExpertStack`` streamed
  through one set of device slots: a step of the high-noise expert and a step of a batch
  straddling the boundary (one row per expert, one forward per expert, as the Wan pipeline
  runs it).

Methods: ``resident`` (the whole DiT in HBM), ``dlo`` (``enable_offload``, every block
streamed), ``diffusers-block`` / ``diffusers-leaf`` (``enable_group_offload`` with
block_level and one block per group, and leaf_level; both with streams). Reports ms/step
(median of CUDA-event timings), peak HBM, pinned host bytes and the pinned H2D rate, and
checks the issue's targets. Prints a table; writes JSON and markdown to --out.

    python3 -P bench/offload_families.py --model qwen-image --out out/families-qwen
    python3 -P bench/offload_families.py --model wan --out out/families-wan
    python3 -P bench/offload_families.py --model wan2.2 --out out/families-wan22

``--tiny`` runs the same program on tiny DiTs on a CPU (a smoke test; tests run it).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ditserve.engine.config import OffloadConfig
from ditserve.engine.families import WAN
from ditserve.engine.model_builders import make_dit
from ditserve.engine.offload import enable_offload
from ditserve.engine.pipelines.experts import ExpertStack
from ditserve.engine.pipelines.wan_block import chunk_token_math

GIB = 1024**3
TEXT_TOKENS = {"qwen-image": 256, "wan": 512}  # a typical Qwen prompt; Wan pads to 512
DEFAULT_SIZES = {"qwen-image": "1024x1024", "wan": "832x480x81", "wan2.2": "832x480x81"}
DEFAULT_BATCHES = {"qwen-image": (1, 4), "wan": (1,), "wan2.2": (1,)}
# Timed steps per cell (after one warm-up step): a full Wan step at 832x480x81 takes seconds.
DEFAULT_ITERS = {"qwen-image": 3, "wan": 2, "wan2.2": 2}
METHODS = ("resident", "dlo", "diffusers-block", "diffusers-leaf")
TINY_SIZES = {"qwen-image": "64x64", "wan": "64x64x5", "wan2.2": "64x64x5"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        empty = getattr(torch._C, "_host_emptyCache", None)  # the pinned caching allocator
        if empty is not None:
            empty()


def variant_of(model: str) -> str:
    return "wan" if model.startswith("wan") else model


def build_dit(model: str, size: str, device: torch.device, seed: int,
              stock_blocks: bool = False) -> torch.nn.Module:
    """A random DiT in bf16 (keep-in-float32 modules in float32, as a load gives) made on
    ``device`` (seconds on a GPU for 20B parameters, no host copy); for wan2.2 the stack of
    two experts. Wan blocks get the sliced float32 math the engine serves them with
    (``chunk_token_math``, bit-identical) for every method, unless ``stock_blocks``."""
    def one(s: int) -> torch.nn.Module:
        dit: torch.nn.Module = make_dit(variant_of(model), size, dtype=torch.bfloat16,
                                        device=device, seed=s)
        if variant_of(model) == "wan" and not stock_blocks:
            chunk_token_math(dit)
        return dit

    if model == "wan2.2":
        return ExpertStack({"transformer": one(seed), "transformer_2": one(seed + 1)})
    return one(seed)


def block_lists(model: str, dit: torch.nn.Module) -> tuple[str, ...] | None:
    return dit.block_lists(WAN.block_lists) if isinstance(dit, ExpertStack) else None


def workloads(model: str, size: str, batches: tuple[int, ...], dit: torch.nn.Module,
              device: torch.device) -> list[tuple[str, Callable[[], Any]]]:
    """(label, one denoise forward) per timed cell, inputs made once on the device."""
    g = torch.Generator(device=device).manual_seed(1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16)

    dims = [int(x) for x in size.split("x")]
    first_dit: Any = dit.expert(0) if isinstance(dit, ExpertStack) else dit
    config = first_dit.config
    out: list[tuple[str, Callable[[], Any]]] = []
    if model == "qwen-image":
        width, height = dims
        h, w = height // 16, width // 16  # 8x VAE, then 2x2 packing
        for b in batches:
            kw = dict(hidden_states=randn(b, h * w, config.in_channels),
                      encoder_hidden_states=randn(b, TEXT_TOKENS["qwen-image"],
                                                  config.joint_attention_dim),
                      timestep=torch.full((b,), 0.5, device=device, dtype=torch.bfloat16),
                      img_shapes=[[(1, h, w)]] * b, return_dict=False)
            out.append((f"b{b}", lambda kw=kw: dit(**kw)))
        return out
    width, height, frames = dims
    latent = ((frames - 1) // 4 + 1, height // 8, width // 8)

    def wan_inputs(b: int, t: float) -> dict[str, Any]:
        return dict(hidden_states=randn(b, config.in_channels, *latent),
                    encoder_hidden_states=randn(b, TEXT_TOKENS["wan"], config.text_dim),
                    timestep=torch.full((b,), t, device=device), return_dict=False)

    if not isinstance(dit, ExpertStack):
        for b in batches:
            kw = wan_inputs(b, 500.0)
            out.append((f"b{b}", lambda kw=kw: dit(**kw)))
        return out
    high, low = wan_inputs(1, 950.0), wan_inputs(1, 500.0)
    first, second = dit.expert(0), dit.expert(1)
    out.append(("expert1 b1", lambda: first(**high)))
    # A batch straddling the boundary: one forward per expert over its own rows.
    out.append(("straddle b1+1", lambda: (first(**high), second(**low))))
    return out


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
        sync()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters)]
        for start, end in events:
            start.record()
            step()
            end.record()
        sync()
    return [s.elapsed_time(e) for s, e in events]


def h2d_gbps(device: torch.device, nbytes: int = 2 * GIB, reps: int = 8) -> float | None:
    """Pinned host -> device copy rate on a side stream (as DLO's copies), GB/s."""
    if device.type != "cuda":
        return None
    host = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device=device)
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            s.record(stream)
            dev.copy_(host, non_blocking=True)
            e.record(stream)
        e.synchronize()
        times.append(s.elapsed_time(e))
    del host, dev
    release_memory()
    return nbytes / (statistics.median(times) * 1e-3) / 1e9


def pinned_allocated() -> int:
    try:
        return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
    except Exception:  # not a CUDA build
        return 0


def weight_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
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
                                    block_lists=block_lists(self.args.model, dit))
            info["handle"] = handle
            info["report"] = {k: v for k, v in handle.report().items()
                              if isinstance(v, (int, float, str, bool, type(None)))}
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
            if a.model == "wan2.2" and method.startswith("diffusers"):
                continue  # diffusers offloads one model at a time; not compared for the stack
            dit = build_dit(a.model, self.dit_size, self.device, seed=0,
                            stock_blocks=a.stock_blocks)
            self.results.setdefault("weights_bytes", weight_bytes(dit))
            info = self.enable(method, dit)
            handle = info.pop("handle", None)
            self.results["methods"][method] = info
            log(f"{method}: enabled in {info['enable_s']:.1f}s")
            self.time_cells(method, dit)
            if handle is not None:
                info["report_at_end"] = {k: v for k, v in handle.report().items()
                                         if isinstance(v, (int, float, str, bool, type(None)))}
                handle.disable()
            del dit, handle
            release_memory()
            self.save()
        self.results["targets"] = targets(self.results)
        self.save()
        table = markdown(self.results)
        (self.out / "offload_families.md").write_text(table)
        print(table, flush=True)

    def time_cells(self, method: str, dit: torch.nn.Module) -> None:
        """Every workload's cell; its step closures (which hold ``dit``) die with this frame,
        so ``release_memory`` can free the model before the next method is built (an
        instance-level block forward makes a block a reference cycle, freed only by gc)."""
        a = self.args
        for label, step in workloads(a.model, a.size, tuple(a.batches), dit, self.device):
            self.time_cell(method, label, step)

    def time_cell(self, method: str, label: str, step: Callable[[], Any]) -> None:
        cuda = self.device.type == "cuda"
        if cuda:
            sync()
            torch.cuda.reset_peak_memory_stats(self.device)
        times = time_steps(step, self.args.warmup, self.args.iters)
        cell = {"method": method, "cell": label, "ms": statistics.median(times),
                "ms_all": [round(t, 1) for t in times],
                "peak_hbm_bytes": torch.cuda.max_memory_allocated(self.device) if cuda else 0}
        self.results["cells"].append(cell)
        log(f"{method:16s} {label:14s} {cell['ms']:9.1f} ms/step, peak "
            f"{cell['peak_hbm_bytes'] / GIB:6.2f} GiB")


def find(r: dict[str, Any], method: str, label: str) -> dict[str, Any] | None:
    return next((c for c in r["cells"] if (c["method"], c["cell"]) == (method, label)), None)


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets for this model, each with value, bound and verdict."""
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, bound: float | None, unit: str) -> None:
        ok = None if value is None or bound is None else value <= bound
        out.append({"target": name, "value": value, "bound": bound, "unit": unit, "ok": ok})

    dlo = r["methods"].get("dlo", {}).get("report")
    if not dlo:
        return out
    gbps, weights = r.get("h2d_gbps"), r["weights_bytes"]
    labels = sorted({c["cell"] for c in r["cells"]})
    for label in labels:
        d, res = find(r, "dlo", label), find(r, "resident", label)
        if d and res and res["peak_hbm_bytes"]:
            activations = res["peak_hbm_bytes"] - weights
            bound = 2 * dlo["slot_bytes"] + activations + dlo["resident_module_bytes"]
            add(f"peak HBM {label} <= 2 x largest block + activations + resident modules",
                d["peak_hbm_bytes"] / GIB, bound / GIB, "GiB")
    if r["model"] == "qwen-image":
        d1 = find(r, "dlo", "b1")
        if d1 and gbps:
            add("DLO b1 <= 1.02 x PCIe floor (streamed bytes / H2D rate)", d1["ms"],
                1.02 * dlo["streamed_bytes"] / (gbps * 1e9) * 1e3, "ms")
        best = [c["ms"] for m in ("diffusers-block", "diffusers-leaf")
                if (c := find(r, m, "b1")) is not None]
        if d1 and best:
            add("DLO b1 at least 1.13x faster than diffusers' best", 1.13 * d1["ms"],
                min(best), "ms")
        d4, r4 = find(r, "dlo", "b4"), find(r, "resident", "b4")
        if d4 and r4:
            add("DLO b4 <= 1.02 x resident", d4["ms"], 1.02 * r4["ms"], "ms")
    if r["model"] == "wan":
        d1, r1 = find(r, "dlo", "b1"), find(r, "resident", "b1")
        if d1 and r1:
            add("DLO b1 <= 1.02 x resident", d1["ms"], 1.02 * r1["ms"], "ms")
            add("DLO peak HBM <= 15% of resident's", d1["peak_hbm_bytes"] / GIB,
                0.15 * r1["peak_hbm_bytes"] / GIB, "GiB")
    add("DLO pinned host <= 1.02 x streamed bytes", dlo["pinned_host_bytes"] / GIB,
        1.02 * dlo["streamed_bytes"] / GIB, "GiB")
    return out


def markdown(r: dict[str, Any]) -> str:
    methods = [m for m in METHODS if any(c["method"] == m for c in r["cells"])]
    labels = list(dict.fromkeys(c["cell"] for c in r["cells"]))
    gbps = r.get("h2d_gbps")
    lines = [f"{r['model']} {r['size']}: {r['weights_bytes'] / GIB:.1f} GiB bf16 DiT weights; "
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
        lines.append(f"| {t['target']} | {v} | {b} | {'yes' if t['ok'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("qwen-image", "wan", "wan2.2"), required=True)
    p.add_argument("--size", default=None, help="WIDTHxHEIGHT (images) or WxHxFRAMES (video)")
    p.add_argument("--batches", type=int, nargs="+", default=None)
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=None, help="timed steps per cell")
    p.add_argument("--out", default="out/offload-families")
    p.add_argument("--tiny", action="store_true", help="tiny DiTs: a smoke run on a CPU")
    p.add_argument("--stock-blocks", action="store_true",
                   help="Wan: diffusers' own block forward (whole-sequence float32 math) "
                        "instead of the engine's sliced one")
    args = p.parse_args(argv)
    args.size = args.size or (TINY_SIZES if args.tiny else DEFAULT_SIZES)[args.model]
    args.batches = args.batches or list(DEFAULT_BATCHES[args.model])
    args.iters = args.iters or DEFAULT_ITERS[args.model]
    if not args.tiny and not torch.cuda.is_available():
        print("bench/offload_families.py needs a CUDA device (or --tiny on a CPU)",
              file=sys.stderr)
        return 2
    bench = Bench(args)
    try:
        bench.run()
    finally:
        bench.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
