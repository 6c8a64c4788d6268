#!/usr/bin/env python3
"""Sequence parallelism on two GPUs: SP 1 vs SP 2, SP 2 vs DP 2, and DLO over the SP group.

One process per GPU (torch.multiprocessing spawn, NCCL), each building the same random
full-size DiT on its GPU from a fixed seed (bf16): Flux.1 (11.9B) at 1024x1024 (4096 image +
512 text tokens) and Wan2.1-T2V-14B at 832x480 x 81 frames (32760 tokens, 512 text tokens),
batch 1. Methods, each on a freshly built model:

- ``sp1``: rank 0 alone runs the plain forward (the single-GPU latency; rank 1 waits);
- ``dp2``: both ranks run their own plain forward at once (two requests: DP's throughput);
- ``sp2``: both ranks run one forward sharded over the SP group (``engine.parallel``:
  Ulysses all-to-alls, each rank half the tokens), the whole DiT resident on each;
- ``sp2-dlo``: SP 2 with DLO AllGather over the SP group: each rank pins half of every
  block and rebuilds it with all_gather (the engine's layout for dp 1, sp 2);
- ``sp2-dlo-local``: SP 2 with rank-local DLO (``--dlo-no-use-allgather``): full blocks pinned
  on each rank.

Per rank: ms/step (median of CUDA-event timings), peak HBM during the steps, pinned host
bytes and DLO host bytes; per SP method the largest difference of rank 0's output to SP 1's.
Tables: every method per model, DP 2 vs SP 2 (latency of one request vs throughput of two),
and the targets of issue #27 (Wan SP 2 <= 0.55 x SP 1; Wan SP 2 + DLO AllGather <= 1.05 x SP
2 resident; per-rank DLO host bytes about half the DiT). Writes JSON and markdown to --out.

    NCCL_NVLS_ENABLE=0 python3 bench/sp.py --process-per-cell --out $OUT
    python3 bench/sp.py --cpu-smoke --out out/sp-smoke      # tiny, fp32, gloo, 2 processes

``--process-per-cell`` runs every (model, method) cell in a fresh pair of processes (one
offload enable per process, as a server runs: a second enable in one process copies slower,
docs/distributed.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

import harness
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ditserve.engine.config import OffloadConfig
from ditserve.engine.makers.builders import make_dit
from ditserve.engine.offload import enable_offload
from ditserve.engine.parallel.sharding import shard_dit
from ditserve.engine.parallel.ulysses import SequenceGroup

GIB = 1024**3
MODELS = ("flux", "wan")
METHODS = ("sp1", "dp2", "sp2", "sp2-dlo", "sp2-dlo-local")
SIZES = {"flux": "1024x1024", "wan": "832x480x81"}
# Smoke sizes need padding over 2 ranks: 5 x 5 Flux tokens, 3 x 5 x 3 Wan tokens.
SMOKE_SIZES = {"flux": "80x80", "wan": "48x80x9"}
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0"}  # NVLink multicast off (the device notes say why)
WAN_TEXT_TOKENS = 512


def build(model: str, smoke: bool, dtype: torch.dtype, device: torch.device) -> Any:
    if model == "flux":
        return harness.build_flux(device, tiny=smoke, dtype=dtype)
    return make_dit("wan", "tiny" if smoke else "full", dtype=dtype, device=device, seed=0)


def inputs(model: str, dit: Any, size: str, dtype: torch.dtype, device: torch.device
           ) -> dict[str, Any]:
    dims = [int(x) for x in size.split("x")]
    if model == "flux":
        return harness.flux_inputs(dit, dims[0], 1, device, dtype=dtype)
    width, height, frames = dims
    g = torch.Generator(device=device).manual_seed(1)
    latent = (dit.config.in_channels, (frames - 1) // 4 + 1, height // 8, width // 8)
    return dict(hidden_states=torch.randn(1, *latent, generator=g, device=device, dtype=dtype),
                encoder_hidden_states=torch.randn(1, WAN_TEXT_TOKENS, dit.config.text_dim,
                                                  generator=g, device=device, dtype=dtype),
                timestep=torch.full((1,), 500.0, device=device), return_dict=False)


def weight_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


class Rank:
    """One process: builds, shards/offloads and times each cell it is given."""

    def __init__(self, rank: int, args: argparse.Namespace) -> None:
        self.rank, self.args = rank, args
        self.cuda = torch.cuda.is_available() and not args.cpu_smoke
        self.device = torch.device("cuda", rank) if self.cuda else torch.device("cpu")
        self.dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
        backend = "nccl" if self.cuda else "gloo"
        # Two groups over the same ranks, as the engine makes them: the Ulysses all-to-alls
        # never queue behind DLO's weight gathers on one communicator.
        self.sequence = SequenceGroup.of(dist.new_group([0, 1], backend=backend))
        self.weights = dist.new_group([0, 1], backend=backend)

    def run_cell(self, model: str, method: str) -> dict[str, Any]:
        a, out = self.args, Path(self.args.out)
        size = (SMOKE_SIZES if a.cpu_smoke else SIZES)[model]
        dit = build(model, a.cpu_smoke, self.dtype, self.device)
        weights = weight_bytes(dit)
        if method.startswith("sp2"):
            shard_dit(dit, self.sequence)
        report: dict[str, Any] = {}
        handle = None
        if "dlo" in method:
            dit.to("cpu")  # host weights: DLO pins them (or this rank's shards) and streams
            harness.release_device_cache()
            group = self.weights if method == "sp2-dlo" else None
            handle = enable_offload(dit, OffloadConfig(enabled=True), device=self.device,
                                    group=group)
            report = {k: v for k, v in handle.report().items()
                      if isinstance(v, (int, float, str, bool, type(None)))}
        step = inputs(model, dit, size, self.dtype, self.device)
        active = method != "sp1" or self.rank == 0
        cell: dict[str, Any] = {"model": model, "method": method, "rank": self.rank,
                                "size": size, "weights_bytes": weights, "active": active}
        if active:
            if self.cuda:
                harness.sync()
                torch.cuda.reset_peak_memory_stats(self.device)
            times = harness.time_steps(dit, step, a.warmup, a.iters)
            with torch.no_grad():
                result = dit(**step)[0].float().cpu()
            cell.update(ms=times.median, ms_all=[round(t, 2) for t in times.ms],
                        peak_hbm_bytes=(torch.cuda.max_memory_allocated(self.device)
                                        if self.cuda else 0))
            reference = out / f"sp1-{model}.pt"
            if method == "sp1":
                torch.save(result, reference)
            elif method.startswith("sp2") and self.rank == 0 and reference.exists():
                cell["max_diff_vs_sp1"] = float((result - torch.load(reference)).abs().max())
        dist.barrier()  # sp1: rank 1 waits for rank 0; every cell ends together
        for key in ("pinned_host_bytes", "host_bytes", "shard_bytes", "group_size", "transfer",
                    "streamed_bytes", "slot_bytes"):
            if key in report:
                cell[key] = report[key]
        if handle is not None:
            handle.disable()
        del dit, handle, step
        harness.release_device_cache()
        return cell


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace,
              cells: list[tuple[str, str]]) -> None:
    os.environ.update(SAFE_ENV)
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    try:
        bench = Rank(rank, args)
        results = []
        for model, method in cells:
            harness.log(f"rank {rank}: {model} {method}")
            results.append(bench.run_cell(model, method))
        with open(Path(args.out) / f"cells-rank{rank}.jsonl", "a") as f:
            for result in results:
                f.write(json.dumps(result) + "\n")
    finally:
        dist.destroy_process_group()


# -- report ---------------------------------------------------------------------------------------
def find(cells: list[dict[str, Any]], model: str, method: str, rank: int = 0
         ) -> dict[str, Any] | None:
    return next((c for c in cells if (c["model"], c["method"], c["rank"]) == (model, method, rank)),
                None)


def targets(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue #27's targets, each with value, bound and verdict (None: not measured)."""
    out = []

    def add(name: str, value: float | None, bound: float | None) -> None:
        ok = None if value is None or bound is None else value <= bound
        out.append({"target": name, "value": value, "bound": bound, "ok": ok})

    sp1, sp2, dlo = (find(cells, "wan", m) for m in ("sp1", "sp2", "sp2-dlo"))
    add("Wan SP 2 step <= 0.55 x SP 1 step (ms)", sp2 and sp2["ms"],
        sp1 and 0.55 * sp1["ms"])
    add("Wan SP 2 + DLO AllGather <= 1.05 x SP 2 resident (ms)", dlo and dlo["ms"],
        sp2 and 1.05 * sp2["ms"])
    for model in MODELS:
        for rank in (0, 1):
            c = find(cells, model, "sp2-dlo", rank)
            if c and "host_bytes" in c:
                add(f"{model} rank {rank} DLO host bytes <= 0.55 x the DiT (GiB)",
                    c["host_bytes"] / GIB, 0.55 * c["weights_bytes"] / GIB)
    return out


def markdown(summary: dict[str, Any]) -> str:
    cells, lines = summary["cells"], [f"{summary['gpu']}, torch {summary['torch']}, "
                                      f"{summary['date']}; `{summary['command']}`", ""]
    rows = []
    for model in MODELS:
        for method in METHODS:
            r0, r1 = find(cells, model, method, 0), find(cells, model, method, 1)
            if r0 is None:
                continue
            ms = [f"{c['ms']:.1f}" if c and c.get("active") else "-" for c in (r0, r1)]
            peak = max((c or {}).get("peak_hbm_bytes", 0) for c in (r0, r1)) / GIB
            pinned = [(c or {}).get("pinned_host_bytes") for c in (r0, r1)]
            diff = r0.get("max_diff_vs_sp1")
            rows.append([f"{model} {r0['size']}", method, *ms, f"{peak:.1f}",
                         "/".join("-" if p is None else f"{p / GIB:.1f}" for p in pinned),
                         "-" if diff is None else f"{diff:.2e}"])
    lines += harness.md_table(["model", "method", "rank 0 ms/step", "rank 1 ms/step",
                               "peak HBM GiB", "pinned host GiB (r0/r1)", "max diff vs SP 1"], rows)
    rows = []
    for model in MODELS:
        sp1, sp2, dp0, dp1 = (find(cells, model, "sp1"), find(cells, model, "sp2"),
                              find(cells, model, "dp2", 0), find(cells, model, "dp2", 1))
        if not (sp1 and sp2 and dp0 and dp1):
            continue
        dp_step = max(dp0["ms"], dp1["ms"])
        rows.append([model, f"{sp1['ms']:.1f}", f"{sp2['ms']:.1f} ({sp1['ms'] / sp2['ms']:.2f}x)",
                     f"{dp_step:.1f}", f"{1e3 / sp2['ms']:.2f}", f"{2e3 / dp_step:.2f}"])
    if rows:
        lines += ["", *harness.md_table(
            ["model", "SP 1 ms/step", "SP 2 ms/step (speed-up)", "DP 2 ms/step",
             "SP 2 request-steps/s", "DP 2 request-steps/s"], rows)]
    lines += ["", *harness.md_table(["target", "value", "bound", "ok"], [
        [t["target"], "-" if t["value"] is None else f"{t['value']:.2f}",
         "-" if t["bound"] is None else f"{t['bound']:.2f}",
         "-" if t["ok"] is None else ("yes" if t["ok"] else "NO")]
        for t in summary["targets"]])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out/sp"))
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--process-per-cell", action="store_true",
                   help="every (model, method) cell in a fresh pair of processes")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny DiTs in fp32 on the CPU (gloo, 2 processes): a smoke run")
    args = p.parse_args(argv)
    world = 2
    if not args.cpu_smoke and torch.cuda.device_count() < world:
        print("bench/sp.py needs 2 CUDA devices (or --cpu-smoke)", file=sys.stderr)
        return 2
    from ditserve.engine.distributed.ports import free_port

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("cells-rank*.jsonl"):
        stale.unlink()
    # SP 1 first: the SP cells compare their output to its.
    cells = [(m, method) for m in args.models for method in METHODS if method in args.methods]
    for part in ([[c] for c in cells] if args.process_per_cell else [cells]):
        mp.spawn(rank_main, args=(world, free_port(), args, part), nprocs=world, join=True)
    results = [json.loads(line) for r in range(world)
               for line in (out / f"cells-rank{r}.jsonl").read_text().splitlines()]
    device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.cpu_smoke \
        else torch.device("cpu")
    summary = {**harness.environment(device), "command": " ".join(["bench/sp.py", *sys.argv[1:]]),
               "cells": results, "targets": targets(results)}
    harness.write_json(out / "sp.json", summary)
    table = markdown(summary)
    (out / "sp.md").write_text(table)
    print(table, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
