#!/usr/bin/env python3
"""Pinned H2D rate over a shard-sized working set: fresh host pages vs reused ones.

Diagnosis for issue 4's slow first enable (docs/benchmarks.md): on the 2x H200 machine the
first set of pinned shards a process makes copies at ~52 GB/s while the peer computes, later
sets at ~55. This program takes NCCL, the model and the hooks out of the picture: one process
per GPU pins ``--gib`` GiB in ``--slab-mib`` slabs through the engine's own allocator
(``host.memory.PinnedMemory``, as the shard backing does), fills them, and times full
passes over the set, every GPU copying at once. Each *round* makes a new set:

- ``new``: allocated while the earlier sets are still held (pages this process never had);
- ``reuse``: allocated after freeing (unregistering) every earlier set.

In every round, GB/s per rank (median over ``--passes``) for:

- ``1 stream``: each slab in one copy on one copy stream (what DLO does);
- ``2 streams``: each slab split in two halves on two copy streams (two copy engines, twice
  the reads in flight: hides translation or fetch latency if that is what limits the rate);
- ``1 stream + GEMM``: as ``1 stream`` while the GPU runs back-to-back bf16 GEMMs (the peer
  rank computing, as in a served step);
- ``1 stream + gathers``: as ``1 stream`` while a high-priority NCCL group runs as many
  ``all_gather_into_tensor`` of a two-slab block from one slab per rank as DLO runs per step
  (``--gathers``; 57 for Flux), on its own stream, as the AllGather path does; ``... + GEMM``
  adds the GEMMs (a served step: copies, gathers and compute at once);
- ``... + HBM``: beside back-to-back elementwise kernels over 1 GiB tensors (memory-bound,
  as a DiT's norms, activations and attention are; GEMMs are not);
- ``1 stream + Flux``: beside forwards of a shallow full-width Flux transformer, resident
  (``--flux-layers`` double and twice as many single blocks, 1024^2, batch 1): the real mix
  of a step's kernels (GEMMs, attention, norms, RoPE) that an idle rank does not run;
  ``+ Flux + gathers`` adds the gathers (a busy rank of the AllGather loop, minus the hooks),
  on one copy stream or split over two;
- ``1 stream + attention``: beside scaled-dot-product attention at Flux's shape alone;
- ``rank 0 alone``: only rank 0 copies, the others wait (an idle peer);
- ``dst +N``: as ``1 stream`` into a device slot that starts ``N`` bytes past a 2 MiB
  boundary (``--dst-offsets``; the caching allocator hands DLO's slots out at any 512-byte
  offset).

Rank 0 reads every GPU's SM clock, power and active clock-event reasons from nvidia-smi in
the middle of each mode's first pass (a power cap that lowers clocks under compute would show
there).

    python3 bench/h2d_pages.py --gpus 2 --out $OUT
    python3 bench/h2d_pages.py --gpus 2 --rounds new --modes "1 stream" "1 stream + Flux"
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import harness
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ditserve.engine.distributed.ports import free_port
from ditserve.engine.offload.host.memory import PinnedMemory

MIB, GIB = 2**20, 2**30
BASE_MODES = ("1 stream", "2 streams", "1 stream + GEMM", "1 stream + gathers",
              "1 stream + gathers + GEMM", "1 stream + HBM", "2 streams + HBM",
              "1 stream + Flux", "1 stream + Flux + gathers", "2 streams + Flux + gathers",
              "1 stream + attention",
              "rank 0 alone")
COPY_GBPS_GUESS = 50e9  # to size the compute queued beside a pass: cover it with some margin


def anon_huge_gib() -> float:
    """This process's anonymous memory in transparent huge pages (GiB)."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) / 2**20
    return 0.0


class Rank:
    def __init__(self, rank: int, args: argparse.Namespace) -> None:
        self.rank, self.args = rank, args
        self.device = torch.device("cuda", rank)
        # --small-pages: the slabs' pages stay 4 KiB (MADV_NOHUGEPAGE instead of the engine's
        # huge-page advice).
        self.memory = PinnedMemory(huge_pages=not args.small_pages)
        self.streams = [torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)]
        slab = args.slab_mib * MIB
        # One 2 MiB-aligned arena per slot, with room to start the slot at any tested offset.
        room = max(args.dst_offsets, default=0) + 2 * MIB
        self.arenas = [torch.empty(slab + room, dtype=torch.uint8, device=self.device)
                       for _ in range(2)]
        n = 8192
        self.a = torch.randn(n, n, device=self.device, dtype=torch.bfloat16)
        # Eight 512 MiB buffers: a footprint like DLO's block slots, not one cached tensor.
        self.hbm = [torch.ones(GIB // 4, dtype=torch.float16, device=self.device) for _ in range(8)]
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = True  # as DLO's weight group
        self.weights = dist.new_group(backend="nccl", pg_options=opts)
        world = dist.get_world_size()
        self.shard = torch.ones(slab // 2, dtype=torch.bfloat16, device=self.device)
        self.block = torch.empty(slab // 2 * world, dtype=torch.bfloat16, device=self.device)
        dist.all_gather_into_tensor(self.block, self.shard, group=self.weights)  # connect
        self.sets: list[list[torch.Tensor]] = []
        # The compute of the Flux and attention modes, set up only when one of them runs.
        chosen = " ".join(modes(args))
        self.flux, self.flux_ms = self.shallow_flux() if "Flux" in chosen else (None, 0.0)
        self.qkv, self.attention_ms = self.attention() if "attention" in chosen else ([], 0.0)
        self.telemetry: list[str] = []

    def shallow_flux(self) -> tuple[Any, float]:
        """A full-width Flux with few blocks, resident, its inputs and its forward's time alone
        (ms)."""
        n = self.args.flux_layers
        model = harness.build_flux(self.device, num_layers=n, num_single_layers=2 * n)
        inputs = harness.flux_inputs(model, 1024, 1, self.device)
        return (model, inputs), harness.time_steps(model, inputs, 2, 5).median

    def attention(self) -> tuple[list[torch.Tensor], float]:
        """Flux-shaped (1024^2) query, key and value, and one attention call's time (ms)."""
        heads, tokens = 24, 4096 + harness.TEXT_TOKENS
        qkv = [torch.randn(1, heads, tokens, 128, device=self.device, dtype=torch.bfloat16)
               for _ in range(3)]
        sdpa = torch.nn.functional.scaled_dot_product_attention
        return qkv, harness.time_steps(lambda **_: sdpa(*qkv), {}, 3, 10).median

    def queue_compute(self, mode: str, pass_bytes: int) -> None:
        """Queue the compute a mode puts beside the copies, enough to outlast the pass. The
        copies are queued first: a deep compute queue blocks the host at the launch queue's
        limit, which must not hold the copies back until the compute is nearly done."""
        cover_ms = 1.5 * pass_bytes / COPY_GBPS_GUESS * 1e3
        if "gathers" in mode:
            for _ in range(self.args.gathers):  # first: NCCL's stream waits on the current one
                dist.all_gather_into_tensor(self.block, self.shard, group=self.weights,
                                            async_op=True)
        if mode.endswith("GEMM"):
            for _ in range(self.args.gemms):  # queued ahead; runs beside the copies
                torch.mm(self.a, self.a)
        if mode.endswith("HBM"):
            for i in range(self.args.hbm_kernels):
                torch.add(self.hbm[i % 8], 1, out=self.hbm[(i + 1) % 8])
        if "Flux" in mode:
            model, inputs = self.flux
            with torch.no_grad():
                for _ in range(math.ceil(cover_ms / self.flux_ms)):
                    model(**inputs)
        if mode.endswith("attention"):
            for _ in range(math.ceil(cover_ms / self.attention_ms)):
                torch.nn.functional.scaled_dot_product_attention(*self.qkv)

    def make_set(self, kind: str) -> float:
        if kind == "reuse":
            for held in self.sets:
                for slab in held:
                    self.memory.free(slab)
            self.sets.clear()
        t0 = time.monotonic()
        count = max(1, self.args.gib * GIB // (self.args.slab_mib * MIB))
        slabs = []
        for i in range(count):
            slab = self.memory.allocate(self.args.slab_mib * MIB)
            slab.fill_(i % 251)  # every page touched, as the shard storage's copies do
            slabs.append(slab)
        self.sets.append(slabs)
        return time.monotonic() - t0

    def one_pass(self, mode: str, telemetry: bool = False) -> float | None:
        """GB/s of one pass over the newest set, timed by events on the copy stream(s)."""
        if mode == "rank 0 alone" and self.rank != 0:
            return None
        slabs = self.sets[-1]
        first, second = self.streams
        start, end, joined = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record(first)
        second.wait_event(start)
        for i, slab in enumerate(slabs):
            slot = self.slot(i % 2, int(mode[5:]) if mode.startswith("dst +") else 0, slab.numel())
            if mode.startswith("2 streams"):
                half = slab.numel() // 2
                with torch.cuda.stream(first):
                    slot[:half].copy_(slab[:half], non_blocking=True)
                with torch.cuda.stream(second):
                    slot[half:].copy_(slab[half:], non_blocking=True)
            else:
                with torch.cuda.stream(first):
                    slot.copy_(slab, non_blocking=True)
        joined.record(second)
        first.wait_event(joined)
        end.record(first)
        if telemetry:  # well inside the pass (>= 100 ms for a few GiB), whatever the host does
            sampler = threading.Timer(0.08, lambda: setattr(self, "telemetry", gpu_telemetry()))
            sampler.start()
        self.queue_compute(mode, sum(s.numel() for s in slabs))
        torch.cuda.synchronize(self.device)
        if telemetry:
            sampler.join()
        return sum(s.numel() for s in slabs) / (start.elapsed_time(end) / 1e3) / 1e9

    def slot(self, index: int, offset: int, nbytes: int) -> torch.Tensor:
        arena = self.arenas[index]
        base = -arena.data_ptr() % (2 * MIB)  # the arena's first 2 MiB boundary
        return arena[base + offset : base + offset + nbytes]


def gpu_telemetry() -> list[str]:
    """Per GPU: SM clock, power draw and active clock-event reasons (as nvidia-smi words)."""
    query = "index,clocks.sm,power.draw,clocks_event_reasons.active"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return [f"nvidia-smi failed: {e}"]
    return [line.strip() for line in out.splitlines() if line.strip()]


def per_slab(r: Rank, world: int) -> list[dict[str, Any]]:
    """Each rank alone in turn copies every slab of the newest set on its own (median of 3):
    GB/s per slab next to where the slab sits in guest-physical memory."""
    slabs = r.sets[-1]
    rows = [{"slab": i, "guest_gib": [harness.guest_physical_gib(slab.data_ptr() + k * slab.numel() // 4)
                                      for k in range(4)], "gbps": {}} for i, slab in enumerate(slabs)]
    for turn in range(world):
        dist.barrier()
        if r.rank != turn:
            continue
        for row, slab in zip(rows, slabs, strict=True):
            gbps = harness.copy_gbps(r.arenas[0][: slab.numel()], slab, r.streams[0], 3)
            row["gbps"][turn] = round(gbps, 2)
    dist.barrier()
    return rows


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, box: Any) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    r = Rank(rank, args)
    rows = []
    for index, kind in enumerate(args.rounds):
        dist.barrier()
        alloc_s = r.make_set(kind)
        if rank == 0:
            print(f"round {index}: {anon_huge_gib():.1f} GiB of rank 0's memory in huge pages",
                  flush=True)
        for mode in modes(args):
            rates = []
            r.telemetry = []
            for i in range(args.passes):
                dist.barrier()  # every rank starts the pass together
                rates.append(r.one_pass(mode, telemetry=rank == 0 and i == 0))
            gbps = statistics.median(rates) if rates[0] is not None else None
            rows.append({"round": index, "kind": kind, "mode": mode, "rank": rank,
                         "gbps": gbps, "passes": rates, "alloc_s": alloc_s,
                         "telemetry": r.telemetry})
            if rank == 0:
                print(f"[{time.strftime('%H:%M:%S')}] round {index} ({kind}) {mode}: rank0 "
                      f"{gbps:.1f} GB/s (passes {', '.join(f'{x:.1f}' for x in rates)}); "
                      f"GPUs: {' | '.join(r.telemetry)}", flush=True)
    if args.per_slab:
        slabs = per_slab(r, world)
        for turn in range(world):  # one rank's lines at a time
            dist.barrier()
            if rank == turn:
                for row in slabs:
                    where = " ".join("?" if g is None else f"{g:.1f}" for g in row["guest_gib"])
                    print(f"rank{rank} slab {row['slab']:3d} at {where} GiB: "
                          f"{row['gbps'][rank]} GB/s alone", flush=True)
    box[rank] = rows
    if args.out and args.per_slab:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"h2d_pages_slabs_rank{rank}.json").write_text(json.dumps(slabs))
    dist.barrier()
    dist.destroy_process_group()


def modes(args: argparse.Namespace) -> list[str]:
    return args.modes or [*BASE_MODES, *(f"dst +{n}" for n in args.dst_offsets)]


def table(rows: list[dict[str, Any]], world: int, args: argparse.Namespace) -> str:
    lines = [f"Pinned H2D GB/s per rank (median of {args.passes} passes over {args.gib} GiB in "
             f"{args.slab_mib} MiB slabs; {world} GPU processes)", "",
             "| round | set | pin s (rank 0) | " + " | ".join(modes(args)) + " |",
             "|---|---|---|" + "---|" * len(modes(args))]
    for index, kind in enumerate(args.rounds):
        cells = []
        for mode in modes(args):
            got = [x for x in rows if x["round"] == index and x["mode"] == mode]
            got.sort(key=lambda x: x["rank"])
            cells.append(" / ".join("-" if x["gbps"] is None else f"{x['gbps']:.1f}" for x in got))
        alloc = next(x["alloc_s"] for x in rows if x["round"] == index and x["rank"] == 0)
        lines.append(f"| {index} | {kind} | {alloc:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--gib", type=int, default=11, help="pinned bytes per rank per set (11: one "
                   "rank's Flux shards)")
    p.add_argument("--slab-mib", type=int, default=324, help="slab size (324: a double block's half)")
    p.add_argument("--rounds", nargs="+", default=["new", "new", "reuse", "reuse"],
                   choices=["new", "reuse"])
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--dst-offsets", type=int, nargs="*", default=[512, 4096, 65536 + 512],
                   help="device slot start offsets past a 2 MiB boundary, bytes")
    p.add_argument("--gemms", type=int, default=150, help="GEMMs queued beside a GEMM-mode pass")
    p.add_argument("--gathers", type=int, default=57, help="gathers queued beside a pass")
    p.add_argument("--hbm-kernels", type=int, default=400,
                   help="elementwise kernels queued beside an HBM-mode pass")
    p.add_argument("--flux-layers", type=int, default=2, help="double blocks of the Flux "
                   "run beside the copies (and twice as many single blocks)")
    p.add_argument("--modes", nargs="+", default=None,
                   choices=[*BASE_MODES, *(f"dst +{n}" for n in (512, 4096, 65536 + 512))],
                   help="run only these modes (default: all, with a mode per --dst-offsets)")
    p.add_argument("--small-pages", action="store_true", help="slabs in 4 KiB pages "
                   "(MADV_NOHUGEPAGE) instead of the engine's huge-page advice")
    p.add_argument("--per-slab", action="store_true", help="also time each slab of the last "
                   "set alone, per rank in turn, with its guest-physical address")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.gpus:
        print(f"needs {args.gpus} CUDA GPUs", file=sys.stderr)
        return 2
    port = free_port()
    box = mp.Manager().dict()
    mp.spawn(rank_main, args=(args.gpus, port, args, box), nprocs=args.gpus)
    rows = [row for rank in range(args.gpus) for row in box[rank]]
    text = table(rows, args.gpus, args)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "h2d_pages.json").write_text(json.dumps(rows, indent=1))
        (Path(args.out) / "h2d_pages.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
