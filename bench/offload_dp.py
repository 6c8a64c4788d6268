#!/usr/bin/env python3
"""DLO over two data-parallel ranks: AllGather shards vs rank-local replicas vs resident.

One process per GPU (torch.multiprocessing spawn, NCCL), each building the same random
Flux-sized transformer on its GPU (``bench/offload.py``'s builder: 11.9B parameters, bf16,
from a fixed seed), 1024x1024 latents (4096 image + 512 text tokens). Both ranks run their
own batch at the same time, as DP ranks serving their own requests do. Methods:

- ``resident``: the whole transformer in each GPU's HBM (two replicas; the compute floor);
- ``local``: two rank-local DLO replicas (``enable_offload`` without a group): each rank keeps a
  full pinned host copy and streams every block over its own PCIe link;
- ``allgather``: ``enable_offload(group=WORLD)``: each rank pins 1/2 of every block, copies
  its half H2D and rebuilds the block with ``all_gather_into_tensor`` over NVLink;
- ``allgather-idle``: the same, but only rank 0 has a batch; rank 1 runs idle passes (joins
  each block's gather without computing), as a DP rank with no requests does.

AllGather runs once per *variant* (``--variants``): a device slot count (``sN``,
``offload.slots``), optionally with an NCCL CTA cap for the gathers (``-cM``; NCCL chooses
without it) or with copy-engine gathers instead of NCCL (``-ce``, ``offload.gather``), e.g.
``s4``, ``s8-c4`` or ``s8-ce``.
More slots let shard copies run ahead through blocks whose compute outlasts their copy; fewer
CTAs leave more SMs to the blocks' compute while a gather runs.

Also measured: pinned H2D bandwidth with one GPU and with both copying at once, and the
gather time of the largest block. Reports ms/step per rank (median of CUDA-event timings),
per-rank pinned host bytes, images/s derived from the step times for 2 and 4 concurrent
requests (one or two per rank), and the issue's target. Prints a table; writes JSON and a
markdown table to --out.

The target's transfer floor depends on the H2D rate, which drifts on the shared machines
(47-55 GB/s per GPU with both copying, between instances and within minutes), so each cell
is bracketed by the rate as it stood: a 1 GiB probe, and under AllGather a pass over each
rank's own pinned shards (every rank copying at once, nothing else running); the report
gives the bound from each next to the one from the start of the run. Each cell also reports
the rate its copies reached inside the loop (the offload copy clock). ``--bisect`` adds, after
each AllGather cell, the shards copied alone on the engine's own copy stream and into its own
shard slot, to find which one makes a slow enable's copies slow; ``--empty-cache`` releases
the allocator cache before each enable. Each enable records where its device buffers landed and how much of its pinned shards
sit in huge pages. ``--process-per-method`` runs each method and each variant in a fresh pair of
processes, as a server runs (one enable per process, on a model that has not run); within one
process, later enables and enables after resident forwards have measured 3-7% slower copies
(docs/benchmarks.md, sixth session). The profiler traces it keeps (both ranks, every variant)
are read by ``bench/trace_copies.py``.

    NCCL_NVLS_ENABLE=0 python3 bench/offload_dp.py --out $OUT
    NCCL_NVLS_ENABLE=0 python3 bench/offload_dp.py --methods resident allgather \
        --variants s8 s8 --batches 1 --no-profile --process-per-method --out $OUT
    python3 bench/offload_dp.py --tiny            # CPU smoke run (gloo, 2 processes)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ditserve.engine.config import OffloadConfig
from ditserve.engine.offload import OffloadHandle, OffloadProbe, enable_offload
from ditserve.engine.offload.host.memory import PinnedMemory, host_memory
from ditserve.engine.offload.movement.gather import all_gather_into

GIB = 1024**3
RES = 1024
STEPS_PER_IMAGE = 28  # for the derived images/s
# NVLink multicast must stay off on the shared hosts (see the device notes); NCCL reads these.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


def log(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Rank:
    def __init__(self, rank: int, world: int, args: argparse.Namespace) -> None:
        self.rank, self.world, self.args = rank, world, args
        self.cuda = torch.cuda.is_available() and not args.tiny
        self.device = torch.device("cuda", rank) if self.cuda else torch.device("cpu")
        self.ctl = dist.new_group(backend="gloo")  # barriers and results, off the GPU
        self.out: dict[str, Any] = {"rank": rank, "cells": [], "methods": {}}
        self._probe: tuple[torch.Tensor, torch.Tensor, Any] | None = None

    def barrier(self) -> None:
        dist.barrier(group=self.ctl)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def weight_group(self, max_ctas: int = 0) -> Any:
        """The group the shards are gathered over: WORLD, or a new NCCL group whose internal
        streams have high priority (the default; ``--normal-priority`` turns it off), so a
        gather's kernel gets SMs as soon as the running GEMM's thread blocks retire instead of
        queueing behind them. ``max_ctas`` > 0 caps the CTAs (SMs) NCCL's kernels use."""
        if not self.cuda:
            return dist.group.WORLD
        if not self.args.high_priority and not max_ctas:
            return dist.group.WORLD
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = self.args.high_priority
        if max_ctas:
            opts.config.max_ctas = max_ctas
        return dist.new_group(backend="nccl", pg_options=opts)

    # -- link measurements ----------------------------------------------------------------------
    def probe(self) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """One registered 1 GiB host source, a 1 GiB device buffer and a stream for the run."""
        if self._probe is None:
            self._probe = (host_memory(self.device).allocate(GIB).fill_(1),
                           torch.empty(GIB, dtype=torch.uint8, device=self.device),
                           torch.cuda.Stream(device=self.device))
        return self._probe

    def h2d(self, *, alone: bool = False) -> float | None:
        """Pinned H2D GB/s on this rank over the probe, every rank copying at once (``alone``:
        rank 0 only; None on the others), nothing else running. Taken at the start and right
        before and after each cell, because this machine's rate drifts (47-55 GB/s per GPU
        between instances and within one) and the target's transfer floor depends on it."""
        if not self.cuda:
            return None
        host, dev, stream = self.probe()
        self.sync()
        self.barrier()
        gbps = harness.copy_gbps(dev, host, stream, 5) if not alone or self.rank == 0 else None
        self.barrier()
        return None if gbps is None else round(gbps, 2)

    def shard_pass_h2d(self, handle: OffloadHandle | None, *, engine_stream: bool = False,
                       engine_slot: bool = False, waits: bool = False,
                       beside: Any = None) -> float | None:
        """GB/s of one pass over this rank's own pinned shards (the bytes a step streams),
        every rank copying at once and nothing else running: the floor's H2D bandwidth for
        exactly these pages, which a 1 GiB probe can overstate (on one instance 54.5 GB/s
        from 1 GiB against 47.5 over an 11 GiB set, both GPUs copying)."""
        engine = handle.probe() if handle is not None else None
        regions = engine.shard_regions if engine is not None else ()
        if not self.cuda or engine is None or not regions:
            return None
        _, dev, stream = self.probe()
        if engine_stream:  # the copy stream the engine's loads run on
            stream = engine.copy_stream
        nbytes = sum(r.nbytes for r in regions)
        self.sync()
        self.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            for i, region in enumerate(regions):
                if waits:  # as a load waits for the gather that last read its shard slot
                    gathered = torch.cuda.Event()
                    gathered.record(engine.comm_stream)
                    stream.wait_event(gathered)
                # The engine's shard slots in turn (free between steps) or the probe's buffer.
                target = (engine.shard_slots[i % len(engine.shard_slots)][region.dtype]
                          if engine_slot else dev.view(region.dtype))
                target[: region.numel()].copy_(region, non_blocking=True)
            end.record(stream)
        if beside is not None:  # compute on the current stream, queued after the copies
            beside(nbytes)
        end.synchronize()
        self.sync()
        self.barrier()
        return round(nbytes / (start.elapsed_time(end) / 1e3) / 1e9, 2)

    def bisect(self, handle: OffloadHandle) -> dict[str, float | None]:
        """Diagnosis of a slow cell (``--bisect``): the rank's own shards copied alone, all
        ranks at once, on the probe's or the engine's copy stream, into the probe's buffer or
        the engine's shard slots, and last with the loop's cross-stream wait before each copy;
        which of them makes the loop's copies slower than a plain pass."""
        out = {}
        for stream in (False, True):
            for slot in (False, True):
                key = f"{'engine' if stream else 'probe'} stream, {'engine' if slot else 'probe'} slot"
                out[key] = self.shard_pass_h2d(handle, engine_stream=stream, engine_slot=slot)
        out["engine stream and slots, waits on the comm stream"] = self.shard_pass_h2d(
            handle, engine_stream=True, engine_slot=True, waits=True)
        # Compute beside the copies: in a slow enable every kind of kernel slows the copies
        # it overlaps (bench/trace_copies.py). GEMMs over fresh tensors, or with one operand
        # in the engine's block slots: does the memory the compute touches decide it?
        n = 8192
        fresh = torch.randn(n, n, device=self.device, dtype=torch.bfloat16)
        slots = [t for slot in handle.probe().block_slots for t in slot.values()
                 if t.dtype == torch.bfloat16 and t.numel() >= n * n]

        def gemms(operands: list[torch.Tensor]) -> Any:
            def queue(nbytes: int) -> None:
                # 8192^3 bf16 GEMMs take ~1.4 ms: cover the pass at 45 GB/s with room.
                for i in range(int(nbytes / 45e9 / 1.4e-3 * 1.3) + 1):
                    torch.mm(operands[i % len(operands)], fresh)
            return queue

        out["engine stream and slots, GEMMs on fresh tensors"] = self.shard_pass_h2d(
            handle, engine_stream=True, engine_slot=True, beside=gemms([fresh]))
        if slots:
            out["engine stream and slots, GEMMs reading the block slots"] = self.shard_pass_h2d(
                handle, engine_stream=True, engine_slot=True,
                beside=gemms([t[: n * n].view(n, n) for t in slots]))
        return out

    def gather_ms(self, nbytes: int) -> float:
        """all_gather_into_tensor of an ``nbytes`` block from halves (median ms)."""
        n = nbytes // 2 // self.world * 2  # bf16 elements per shard, even
        shard = torch.ones(n, dtype=torch.bfloat16, device=self.device)
        full = torch.empty(n * self.world, dtype=torch.bfloat16, device=self.device)
        times = []
        for i in range(12):
            self.sync()
            self.barrier()
            t0 = time.perf_counter()
            if self.cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                all_gather_into(full, shard)
                e.record()
                e.synchronize()
                ms = s.elapsed_time(e)
            else:
                all_gather_into(full, shard)
                ms = (time.perf_counter() - t0) * 1e3
            if i >= 2:
                times.append(ms)
        return statistics.median(times)

    # -- step timing ----------------------------------------------------------------------------
    def cells(self, method: str, model: torch.nn.Module, *,
              idle_handle: OffloadHandle | None = None,
              handle: OffloadHandle | None = None) -> None:
        """Time each batch size; with an offload ``handle`` also the H2D rate this rank's
        copies reached during the cell (its copy clock, bytes / copy time)."""
        a = self.args
        handle = handle or idle_handle
        for batch in a.batches:
            inputs = harness.flux_inputs(model, RES if not a.tiny else 64, batch, self.device)
            self.sync()
            self.barrier()
            if self.cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
            h2d_before = self.h2d()
            shards_before = self.shard_pass_h2d(handle) if handle is not None else None
            before = copy_clock(handle)
            if idle_handle is not None and self.rank != 0:
                for _ in range(a.warmup + a.iters):  # as many passes as rank 0's forwards
                    idle_handle.idle_pass()
                self.sync()
                times = []
            else:
                times = harness.time_steps(model, inputs, a.warmup, a.iters).ms
            cell = {"method": method, "batch": batch,
                    "ms": statistics.median(times) if times else None,
                    "ms_all": [round(t, 2) for t in times],
                    "peak_hbm_bytes": torch.cuda.max_memory_allocated(self.device) if self.cuda else 0,
                    "h2d_gbps": cell_rate(before, copy_clock(handle)),
                    "h2d_adjacent_gbps": (h2d_before, self.h2d()),
                    "h2d_shard_pass_gbps": (shards_before, self.shard_pass_h2d(handle)
                                            if handle is not None else None)}
            self.out["cells"].append(cell)
            rate = f", H2D {cell['h2d_gbps']:.1f} GB/s" if cell["h2d_gbps"] else ""
            if h2d_before is not None:
                rate += (" (alone, all ranks copying: "
                         + "/".join(f"{v:.1f}" for v in cell["h2d_adjacent_gbps"]) + " before/after)")
            if shards_before is not None:
                rate += (" (own shards alone, all ranks copying: "
                         + "/".join(f"{v:.1f}" for v in cell["h2d_shard_pass_gbps"]) + ")")
            if cell["ms"] is not None or rate:
                ms = f"{cell['ms']:8.1f} ms/step" if cell["ms"] is not None else "idle (gathers only)"
                print(f"[{time.strftime('%H:%M:%S')}] rank{self.rank} {method:15s} b{batch}: "
                      f"{ms}, peak {cell['peak_hbm_bytes'] / GIB:6.2f} GiB{rate}", flush=True)
            del inputs

    def offloaded(self, method: str, model: torch.nn.Module, group: Any, slots: int = 2,
                  gather: str = "nccl") -> OffloadHandle:
        if self.cuda and self.args.empty_cache:
            # Diagnosis: every cached device segment back to the driver first, so the enable's
            # slots and the next forwards' activations come from fresh allocations.
            self.sync()
            torch.cuda.empty_cache()
        t0 = time.monotonic()
        handle = enable_offload(model, OffloadConfig(enabled=True, slots=slots, gather=gather),
                                device=self.device, group=group)
        harness.release_host_cache() if self.cuda else None
        probe = handle.probe()
        info = {"enable_s": time.monotonic() - t0, "report_at_start": handle.snapshot().to_json(),
                "rss_gib": harness.rss_gib(), "shards_huge": shards_in_huge_pages(probe),
                "free_huge_blocks": free_huge_blocks(), "device_layout": device_layout(probe),
                "shard_frames": shard_frames(probe)}
        self.out["methods"][method] = info
        r = info["report_at_start"]
        print(f"[{time.strftime('%H:%M:%S')}] rank{self.rank} {method} enabled in "
              f"{info['enable_s']:.1f}s: pinned {r['pinned_host_bytes'] / GIB:.2f} GiB, host "
              f"{r['host_bytes'] / GIB:.2f} GiB, transfer {r['transfer']}", flush=True)
        if info["shards_huge"] is not None:
            print(f"[{time.strftime('%H:%M:%S')}] rank{self.rank} {method} shards: "
                  f"{info['shards_huge']:.3f} of their resident bytes in huge pages; free "
                  f"2 MiB+ blocks in the kernel: {info['free_huge_blocks']}", flush=True)
        return handle

    def run(self) -> dict[str, Any]:
        a = self.args
        nan = float("nan")  # (on the CPU)
        self.out["h2d_one_gbps"] = self.h2d(alone=True) or nan
        self.out["h2d_both_gbps"] = self.h2d() or nan
        log(self.rank, f"H2D GB/s: one GPU {self.out['h2d_one_gbps']:.1f}, "
                       f"both at once {self.out['h2d_both_gbps']:.1f} (rank 0)")
        model = harness.build_flux(self.device, tiny=a.tiny)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        self.out["model"] = {"params": sum(p.numel() for p in model.parameters()), "bytes": weights}
        log(self.rank, f"model {self.out['model']['params'] / 1e9:.2f}B params, {weights / GIB:.2f} GiB")
        if "resident" in a.methods:
            self.cells("resident", model)
        if "local" in a.methods:
            handle = self.offloaded("local", model, None)
            self.cells("local", model, handle=handle)
            self.out["methods"]["local"]["report_at_end"] = handle.snapshot().to_json()
            handle.disable()  # blocks back on the host (pageable), ready to be sharded
        self.barrier()
        self.prime(a.prime)
        if "allgather" in a.methods:
            names = a.variant_names or variant_names(a.variants)
            self.out["variants"] = list(names)
            for i, name in enumerate(names):
                last = i == len(names) - 1
                self.allgather(model, name, first=i == 0, last=last)
        return self.out

    def prime(self, what: list[str]) -> None:
        """Diagnosis of the slow first enable: before it, touch what the later enables find
        already used. ``pages``: pin, copy and unpin as many host bytes as a shard set (fresh
        pages for this process); ``nccl``: a high-priority NCCL group gathers shard-sized
        buffers (2000 times, ~5 s on NVLink)."""
        if not self.cuda:
            return
        if "pages" in what:
            t0 = time.monotonic()
            memory = PinnedMemory()  # as the engine pins its shards
            chunk = 340 * 2**20
            slot = torch.empty(chunk, dtype=torch.uint8, device=self.device)
            held = []
            for _ in range(34):  # 11.3 GiB, about one rank's shards, all held at once
                buf = memory.allocate(chunk)
                buf.fill_(1)
                slot.copy_(buf)
                held.append(buf)
            for buf in held:
                memory.free(buf)
            del held, buf, slot
            log(self.rank, f"primed pages: 11.3 GiB pinned, copied, unpinned in "
                           f"{time.monotonic() - t0:.1f} s")
        if "nccl" in what:
            group = self.weight_group()
            n = 170 * 2**20
            shard = torch.ones(n, dtype=torch.bfloat16, device=self.device)
            full = torch.empty(n * self.world, dtype=torch.bfloat16, device=self.device)
            t0 = time.monotonic()
            for _ in range(2000):  # the same count on every rank (a collective)
                dist.all_gather_into_tensor(full, shard, group=group)
            self.sync()
            del shard, full
            log(self.rank, f"primed NCCL: 2000 gathers of 680 MiB on a high-priority group in "
                           f"{time.monotonic() - t0:.1f} s")
        self.barrier()

    def allgather(self, model: torch.nn.Module, name: str, *, first: bool, last: bool) -> None:
        a = self.args
        slots, ctas, gather = parse_variant(name.split("#")[0])
        method = f"allgather {name}"
        try:
            group = self.weight_group(ctas)
        except AttributeError as e:  # torch without ProcessGroupNCCL.Options().config
            log(self.rank, f"{method}: skipped, cannot cap NCCL CTAs here ({e})")
            self.out["variants"].remove(name)
            return
        handle = self.offloaded(method, model, group, slots, gather)
        slot = handle.snapshot().slot_bytes
        if first:
            self.out["largest_block_bytes"] = slot
            self.out["gather_ms_largest_block"] = self.gather_ms(slot)
            log(self.rank, f"all_gather of the largest block ({slot / 2**20:.0f} MiB): "
                           f"{self.out['gather_ms_largest_block']:.2f} ms")
        self.cells(method, model, handle=handle)
        if a.bisect and self.cuda:
            found = self.bisect(handle)
            self.out["methods"][method]["bisect_gbps"] = found
            print(f"[{time.strftime('%H:%M:%S')}] rank{self.rank} {method} own shards alone: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in found.items() if v) + " GB/s", flush=True)
        if first or a.idle_every_variant:
            self.cells(f"allgather-idle {name}", model, idle_handle=handle)
        if self.cuda and a.profile:
            # Host-blocking CUDA calls inside steady-state steps (both ranks profile, in
            # lockstep: every forward is a pass of collectives); copy-engine busy fraction.
            # Every rank's trace of every variant is kept (which rank is slow varies by
            # enable); bench/trace_copies.py reads them.
            where = Path(a.out)
            where.mkdir(parents=True, exist_ok=True)
            prof = harness.profile_steps(model, harness.flux_inputs(model, RES, 1, self.device), 3,
                                        where / f"allgather_{name.replace('#', '_')}_trace_rank{self.rank}.json.gz")
            self.out["methods"][method]["profile"] = prof
            log(self.rank, f"{method} profile: {prof}")
        self.out["methods"][method]["report_at_end"] = handle.snapshot().to_json()
        # Rebuild the full blocks on the host for the next variant (a collective); the last
        # variant ends the run and skips it.
        handle.disable(gather=not last)


def copy_clock(handle: OffloadHandle | None) -> tuple[int, float] | None:
    """(timed bytes, copy seconds) of an offload handle's copy clock; None without one."""
    rate = handle.snapshot().transfer.copy_rate if handle is not None else None
    if rate is None:
        return None
    return rate.timed_bytes, rate.copy_seconds


def shards_in_huge_pages(probe: OffloadProbe) -> float | None:
    """Share of the resident bytes of the mappings that hold this rank's pinned shards that
    sit in transparent huge pages (/proc/self/smaps); None without shards or smaps."""
    regions = probe.shard_regions
    if not regions:
        return None
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in regions)
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    rss = huge = 0
    overlaps = False
    for line in text.splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and not head.endswith(":"):  # a mapping's header: start-end perms ...
            lo, hi = (int(x, 16) for x in head.split("-"))
            overlaps = any(a < hi and lo < b for a, b in spans)
        elif overlaps and head == "Rss:":
            rss += int(line.split()[1])
        elif overlaps and head == "AnonHugePages:":
            huge += int(line.split()[1])
    return huge / rss if rss else None


def shard_frames(probe: OffloadProbe) -> dict[str, Any] | None:
    """Where this rank's pinned shards sit in (guest-)physical memory: one pagemap reading
    per 2 MiB of every shard region, counted per physical GiB (frames are hidden without
    CAP_SYS_ADMIN: then none is counted); None without shards."""
    regions = probe.shard_regions
    if not regions:
        return None
    where = [harness.guest_physical_gib(address) for r in regions
             for address in range(r.data_ptr(), r.data_ptr() + r.nbytes, 2 * 2**20)]
    buckets: dict[int, int] = {}
    for gib in where:
        if gib is not None:
            buckets[int(gib)] = buckets.get(int(gib), 0) + 1
    return {"sampled": len(where), "with_frame": sum(buckets.values()),
            "per_physical_gib": {str(k): buckets[k] for k in sorted(buckets)}}


def device_layout(probe: OffloadProbe) -> dict[str, Any]:
    """Where an enable's device buffers landed (to compare a fast and a slow enable): the
    block and shard slots' addresses, and the caching allocator's segment count and bytes."""
    out: dict[str, Any] = {
        "block_slots": [hex(t.data_ptr()) for slot in probe.block_slots for t in slot.values()],
        "shard_slots": [hex(t.data_ptr()) for slot in probe.shard_slots for t in slot.values()]}
    if torch.cuda.is_available() and probe.device.type == "cuda":
        stats = torch.cuda.memory_stats(probe.device)
        out["segments"] = stats.get("segment.all.current")
        out["reserved_bytes"] = stats.get("reserved_bytes.all.current")
    return out


def free_huge_blocks() -> int | None:
    """Free blocks of order >= 9 (2 MiB and up) in every zone (/proc/buddyinfo): how much
    unfragmented memory the kernel has left for huge pages."""
    try:
        lines = Path("/proc/buddyinfo").read_text().splitlines()
    except OSError:
        return None
    return sum(int(n) for line in lines for n in line.split()[4 + 9:])


def cell_rate(before: tuple[int, float] | None, after: tuple[int, float] | None) -> float | None:
    """GB/s of the copies timed between two ``copy_clock`` readings."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return round((after[0] - before[0]) / (after[1] - before[1]) / 1e9, 2)


def variant_names(variants: list[str]) -> list[str]:
    """A variant named twice runs twice (fresh shards each time): "s8", "s8#2", ..."""
    return [v if variants[:i].count(v) == 0 else f"{v}#{variants[:i].count(v) + 1}"
            for i, v in enumerate(variants)]


def parse_variant(text: str) -> tuple[int, int, str]:
    """``s8`` -> (8, 0, "nccl"); ``s8-c4`` -> (8, 4, "nccl"); ``s8-ce`` -> (8, 0, "copy-engine")."""
    head, *mods = text.split("-")
    ctas, gather = 0, "nccl"
    ok = head.startswith("s") and head[1:].isdigit()
    for mod in mods:
        if mod == "ce":
            gather = "copy-engine"
        elif mod.startswith("c") and mod[1:].isdigit():
            ctas = int(mod[1:])
        else:
            ok = False
    if not ok:
        raise argparse.ArgumentTypeError(
            f"variant {text!r}: expected sN, sN-cM or sN-ce (e.g. s8-c4, s8-ce)")
    return int(head[1:]), ctas, gather


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(SAFE_ENV)
    cuda = torch.cuda.is_available() and not args.tiny
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        bench = Rank(rank, world, args)
        result = bench.run()
        box: list[Any] = [None] * world if rank == 0 else []
        dist.gather_object(result, box if rank == 0 else None, dst=0, group=bench.ctl)
        if rank == 0 and args.part_file:
            Path(args.part_file).write_text(json.dumps(box))
        elif rank == 0:
            finish(box, args)
    finally:
        dist.destroy_process_group()


# -- report ---------------------------------------------------------------------------------------
def cell(r: dict[str, Any], method: str, batch: int, key: str = "ms") -> float | None:
    for c in r["cells"]:
        if c["method"] == method and c["batch"] == batch:
            return c.get(key)
    return None


def finish(ranks: list[dict[str, Any]], args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    r0 = ranks[0]
    summary: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.tiny else "cpu",
        "torch": torch.__version__, "world": len(ranks), "ranks": ranks,
    }
    # The target's bound, from each measurement of the H2D rate: the start of the run, and
    # (the slowest rank's mean of before and after the cell) the 1 GiB probe and the pass over
    # the ranks' own shards. Without a resident cell the bound is 1.05 x the transfer floor
    # alone (never above the bound: a stricter test).
    resident_b1 = cell(r0, "resident", 1)
    summary["resident_b1_ms"] = resident_b1
    summary["targets"] = {}
    for name in r0.get("variants", []):
        ag = r0["methods"][f"allgather {name}"]["report_at_start"]
        half = ag["streamed_bytes"] / len(ranks)
        worst = max(cell(r, f"allgather {name}", 1) or 0.0 for r in ranks)
        rates = {"start": r0["h2d_both_gbps"]}
        for prefix, key in (("adjacent", "h2d_adjacent_gbps"), ("shard_pass", "h2d_shard_pass_gbps")):
            around = [cell(r, f"allgather {name}", 1, key) for r in ranks]
            if all(a and None not in a for a in around):
                rates[prefix] = min(sum(a) / 2 for a in around)
        bounds = {}
        for prefix, rate in rates.items():
            if not rate or math.isnan(rate):  # not measured (on the CPU)
                continue
            floor = half / (rate * 1e9) * 1e3 + r0["gather_ms_largest_block"]
            bound = 1.05 * max(resident_b1 or 0.0, floor)
            bounds[prefix] = {"h2d_gbps": rate, "floor_ms": floor, "bound_ms": bound,
                              "ok": worst <= bound}
        summary["targets"][name] = {"allgather_b1_ms_worst_rank": worst, "bounds": bounds}
    (out / "offload_dp.json").write_text(json.dumps(summary, indent=1))
    table = markdown(summary, args)
    (out / "offload_dp.md").write_text(table)
    print(table, flush=True)


def markdown(s: dict[str, Any], args: argparse.Namespace) -> str:
    ranks = s["ranks"]
    r0 = ranks[0]
    lines = [f"GPU: {len(ranks)} x {s['gpu']}, torch {s['torch']}, {s['date']}; model "
             f"{r0['model']['params'] / 1e9:.2f}B params ({r0['model']['bytes'] / GIB:.2f} GiB "
             f"bf16); pinned H2D {r0['h2d_one_gbps']:.1f} GB/s one GPU, "
             f"{r0['h2d_both_gbps']:.1f} GB/s per GPU with both copying; all_gather of the "
             f"largest block ({r0.get('largest_block_bytes', 0) / 2**20:.0f} MiB): "
             f"{r0.get('gather_ms_largest_block', float('nan')):.2f} ms", ""]
    variants = r0.get("variants", [])
    methods = ["resident", "local"] + [f"{m} {v}" for v in variants
                                       for m in ("allgather", "allgather-idle")]
    lines.append("| method | batch | " + " | ".join(f"rank {r['rank']} ms/step" for r in ranks)
                 + " | images/s (busy ranks, 28 steps) | H2D GB/s per rank (copy clock) "
                 "| H2D GB/s per rank, 1 GiB alone, before-after "
                 "| H2D GB/s per rank, own shards alone, before-after |")
    lines.append("|---|---|" + "---|" * len(ranks) + "---|---|---|---|")
    for m in methods:
        for b in args.batches:
            ms = [cell(r, m, b) for r in ranks]
            if all(v is None for v in ms):
                continue
            busy = [v for v in ms if v is not None]
            ips = (sum(b * 1e3 / (STEPS_PER_IMAGE * v) for v in busy))
            rates = [cell(r, m, b, "h2d_gbps") for r in ranks]
            rate = " / ".join("-" if v is None else f"{v:.1f}" for v in rates)
            around = [" / ".join("-" if not a or None in a else f"{a[0]:.1f}-{a[1]:.1f}"
                                 for a in (cell(r, m, b, key) for r in ranks))
                      for key in ("h2d_adjacent_gbps", "h2d_shard_pass_gbps")]
            lines.append(f"| {m} | {b} | " + " | ".join("idle" if v is None else f"{v:.0f}"
                                                         for v in ms)
                         + f" | {ips:.3f} | {rate} | {around[0]} | {around[1]} |")
    lines += ["", "| method | per-rank pinned host GiB | per-rank host GiB | streamed GiB/step/rank over PCIe | enable s |",
              "|---|---|---|---|---|"]
    for m in ["local"] + [f"allgather {v}" for v in variants]:
        infos = [r["methods"].get(m) for r in ranks]
        if not infos[0]:
            continue
        rep = infos[0]["report_at_start"]
        pcie = rep["streamed_bytes"] / rep.get("group_size", 1)
        lines.append(f"| {m} | " + " / ".join(f"{i['report_at_start']['pinned_host_bytes'] / GIB:.2f}" for i in infos)
                     + " | " + " / ".join(f"{i['report_at_start']['host_bytes'] / GIB:.2f}" for i in infos)
                     + f" | {pcie / GIB:.2f} | " + " / ".join(f"{i['enable_s']:.1f}" for i in infos) + " |")
    profiled = [(v, r0["methods"][f"allgather {v}"].get("profile")) for v in variants]
    if any(p for _, p in profiled):
        lines += ["", "AllGather steady state (rank 0, 3 profiled steps at b1):", "",
                  "| variant | host-blocking CUDA calls/step | cudaMemcpyAsync/step | "
                  "cudaStreamWaitEvent/step | H2D busy fraction | H2D GB/s while busy |",
                  "|---|---|---|---|---|---|"]
        for v, prof in profiled:
            if prof:
                lines.append(
                    f"| {v} | {sum(prof['sync_calls_per_step'].values()):.0f} | "
                    f"{prof['memcpy_async_per_step']:.0f} | "
                    f"{prof['stream_wait_event_per_step']:.0f} | "
                    f"{prof.get('h2d_busy_fraction') or float('nan'):.3f} | "
                    f"{prof.get('h2d_gbps_while_busy') or float('nan'):.1f} |")
    resident = s.get("resident_b1_ms")
    rate_from = {"start": "both GPUs copying, at the start of the run",
                 "adjacent": "the 1 GiB probe around the cell",
                 "shard_pass": "a pass over the ranks' own shards around the cell"}
    for v, t in s.get("targets", {}).items():
        lines += ["", f"Target ({v}): AllGather b1 per-rank step <= 1.05 x max(resident b1, half "
                      f"the streamed bytes / H2D + one largest-block gather); worst rank "
                      f"{t['allgather_b1_ms_worst_rank']:.1f} ms"
                      + ("" if resident else " (resident not measured: 1.05 x the floor alone)")]
        for prefix, b in t["bounds"].items():
            lines.append(f"  H2D from {rate_from[prefix]} ({b['h2d_gbps']:.1f} GB/s, slowest "
                         f"rank): 1.05 x max({resident or 0.0:.1f}, {b['floor_ms']:.1f}) = "
                         f"{b['bound_ms']:.1f} ms: {'met' if b['ok'] else 'NOT met'}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out/offload_dp"))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2])
    p.add_argument("--methods", nargs="+", default=["resident", "local", "allgather"])
    p.add_argument("--variants", nargs="+", default=["s2", "s4", "s8"],
                   help="AllGather variants: sN = N device slots, -cM = NCCL kernels capped "
                        "at M CTAs, -ce = copy-engine gathers (e.g. s2 s4 s8 s8-c4 s8-ce)")
    p.add_argument("--bisect", action="store_true",
                   help="diagnosis: after each AllGather cell, copy each rank's shards alone on "
                        "the probe's or the engine's copy stream into the probe's or the "
                        "engine's shard slot (all ranks at once)")
    p.add_argument("--idle-every-variant", action="store_true",
                   help="run the idle-rank cells for every variant, not just the first")
    p.add_argument("--normal-priority", dest="high_priority", action="store_false",
                   help="gather over WORLD (normal-priority NCCL streams) instead of a "
                        "high-priority NCCL group, as the engine's weight group uses")
    p.add_argument("--no-profile", dest="profile", action="store_false",
                   help="skip the torch-profiler pass (sync calls per step)")
    p.add_argument("--prime", nargs="*", default=[], choices=["pages", "nccl"],
                   help="diagnosis: before the first AllGather enable, pin and copy fresh host "
                        "pages (pages) and/or run gathers on a spare NCCL group (nccl)")
    p.add_argument("--empty-cache", action="store_true",
                   help="diagnosis: release the caching allocator's free device memory before "
                        "each enable")
    p.add_argument("--process-per-method", action="store_true",
                   help="run each method and each AllGather variant in a fresh pair of "
                        "processes (one enable per process, as a server does)")
    p.add_argument("--tiny", action="store_true", help="small model on CPU (gloo): smoke test")
    args = p.parse_args(argv)
    args.variant_names, args.part_file = None, None  # set per part by --process-per-method
    for v in args.variants:
        try:
            parse_variant(v)
        except argparse.ArgumentTypeError as e:
            p.error(str(e))
    os.environ.update(SAFE_ENV)
    world = 2
    if not args.tiny and torch.cuda.device_count() < world:
        print("bench/offload_dp.py needs 2 CUDA devices (or --tiny for a CPU smoke run)",
              file=sys.stderr)
        return 2
    from ditserve.engine.distributed.ports import free_port

    if not args.process_per_method:
        mp.spawn(rank_main, args=(world, free_port(), args), nprocs=world, join=True)
        return 0
    merged: list[dict[str, Any]] | None = None
    with tempfile.TemporaryDirectory() as tmp:
        for i, part in enumerate(parts_of(args)):
            part.part_file = str(Path(tmp) / f"part{i}.json")
            mp.spawn(rank_main, args=(world, free_port(), part), nprocs=world, join=True)
            ranks = json.loads(Path(part.part_file).read_text())
            merged = ranks if merged is None else [merge_ranks(m, r) for m, r in zip(merged, ranks, strict=True)]
    if merged:
        finish(merged, args)
    return 0


def parts_of(args: argparse.Namespace) -> list[argparse.Namespace]:
    """``--process-per-method``: one fresh pair of processes per method and AllGather variant,
    as a server runs: each process enables offload once, on a model that has not run yet.
    (Enabling again in one process, or after resident forwards, left the copies 3-7% slower
    next to compute on 2x H200; docs/benchmarks.md.)"""
    parts = []
    for method in ("resident", "local"):
        if method in args.methods:
            parts.append(argparse.Namespace(**{**vars(args), "methods": [method], "variants": []}))
    if "allgather" in args.methods:
        for name, variant in zip(variant_names(args.variants), args.variants, strict=True):
            parts.append(argparse.Namespace(**{**vars(args), "methods": ["allgather"],
                                               "variants": [variant], "variant_names": [name]}))
    return parts


def merge_ranks(into: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """One rank's results from two runs: cells and methods add up; run-wide measurements
    (H2D probes, model, largest-block gather) are kept from the first run that took them."""
    into["cells"] += more["cells"]
    into["methods"].update(more["methods"])
    into["variants"] = into.get("variants", []) + more.get("variants", [])
    for key, value in more.items():
        into.setdefault(key, value)
    return into


if __name__ == "__main__":
    sys.exit(main())
