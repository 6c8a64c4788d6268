"""The benchmark programs' own bookkeeping: trace overlap accounting and merged runs.

The benchmarks themselves need GPUs; what they compute from their measurements does not, and
a wrong overlap share or a lost cell would silently change a recorded conclusion.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load(name: str) -> ModuleType:
    """A bench program as a module. The programs import their shared helpers by bare name
    (``import offload``, bench/offload.py), which in a test session is also the name of the
    tests/offload helper package: bind the bench's module while the program loads, then put
    sys.modules and sys.path back so later ``from offload.support import ...`` still works."""
    saved_path, saved = list(sys.path), sys.modules.get("offload")
    try:
        sys.modules["offload"] = _exec(BENCH / "offload.py", "bench_offload")
        return _exec(BENCH / f"{name}.py", f"bench_{name}")
    finally:
        sys.path[:] = saved_path
        if saved is not None:
            sys.modules["offload"] = saved
        else:
            sys.modules.pop("offload", None)


def _exec(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def kernel(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {}}


def h2d(ts: float, dur: float, nbytes: int) -> dict:
    return {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)",
            "ts": ts, "dur": dur, "args": {"bytes": nbytes}}


def test_trace_copies_rates_and_overlap_shares(tmp_path: Path) -> None:
    tc = load("trace_copies")
    events = [
        # Copy 1: 1000 us, 55 MB -> 55 GB/s; a GEMM covers all of it, two overlapping NCCL
        # kernels cover its first half once (the union, not the sum), attention a tenth.
        h2d(0, 1000, 55_000_000),
        kernel("nvjet_sm90_tst_192x192_bias_TNN", -100, 1200),
        kernel("ncclDevKernel_AllGather_RING_LL", 0, 400),
        kernel("ncclDevKernel_AllGather_RING_LL", 300, 200),
        kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 900, 300),
        # Copy 2: 500 us, 25 MB -> 50 GB/s, with nothing beside it.
        h2d(2000, 500, 25_000_000),
        # A device-to-device copy is not an H2D copy and is not counted.
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)",
         "ts": 2100, "dur": 10, "args": {"bytes": 1}},
    ]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)

    first, second = tc.copies_of(path)
    assert first["gbps"] == pytest.approx(55.0)
    assert first["gemm"] == pytest.approx(1.0)
    assert first["nccl"] == pytest.approx(0.5)
    assert first["attention"] == pytest.approx(0.1)
    assert first["compute"] == pytest.approx(1.0)  # GEMM and attention overlap each other
    assert second["gbps"] == pytest.approx(50.0)
    assert all(second[k] == 0.0 for k in (*tc.KINDS, "compute"))

    text = tc.summary(path)
    assert "2 copies, 0.08 GB, 53.3 GB/s" in text  # 80 MB over 1500 us
    assert "| most | most | 1 | 0.06 | 55.0 | 55.0 |" in text  # half counts as most
    assert "| none | none | 1 | 0.03 | 50.0 | 50.0 |" in text


def test_offload_dp_process_per_method_parts_and_merge() -> None:
    dp = load("offload_dp")
    assert dp.variant_names(["s8", "s8", "s4", "s8"]) == ["s8", "s8#2", "s4", "s8#3"]

    args = argparse.Namespace(methods=["resident", "allgather"], variants=["s8", "s8"],
                              variant_names=None, part_file=None, iters=8)
    parts = dp.parts_of(args)
    assert [(p.methods, p.variants, getattr(p, "variant_names", None)) for p in parts] == [
        (["resident"], [], None), (["allgather"], ["s8"], ["s8"]),
        (["allgather"], ["s8"], ["s8#2"])]
    assert all(p.iters == 8 for p in parts) and args.variants == ["s8", "s8"]  # copies

    first = {"rank": 0, "cells": [{"method": "resident"}], "methods": {},
             "h2d_both_gbps": 54.4, "model": {"params": 1}}
    second = {"rank": 0, "cells": [{"method": "allgather s8"}], "methods": {"allgather s8": {}},
              "variants": ["s8"], "h2d_both_gbps": 50.0, "gather_ms_largest_block": 2.6}
    merged = dp.merge_ranks(first, second)
    assert [c["method"] for c in merged["cells"]] == ["resident", "allgather s8"]
    assert merged["variants"] == ["s8"] and "allgather s8" in merged["methods"]
    assert merged["h2d_both_gbps"] == 54.4  # run-wide figures: the first run's
    assert merged["gather_ms_largest_block"] == 2.6  # ...or the first run that took them


def test_offload_dp_bounds_from_each_h2d_rate(tmp_path: Path) -> None:
    """The target is judged against the floor from each rate measurement, and without a
    resident cell against the floor alone."""
    dp = load("offload_dp")

    def rank(r: int, *, resident: bool) -> dict:
        report = {"streamed_bytes": 22e9, "pinned_host_bytes": 11e9, "host_bytes": 11e9,
                  "group_size": 2}
        cells = [{"method": "allgather s8", "batch": 1, "ms": 215.0 + r, "h2d_gbps": 54.0,
                  "h2d_adjacent_gbps": (55.0, 55.0),
                  "h2d_shard_pass_gbps": (50.0, 48.0) if r else (50.0, 50.0)}]
        if resident:
            cells.insert(0, {"method": "resident", "batch": 1, "ms": 230.0})
        return {"rank": r, "cells": cells, "variants": ["s8"],
                "methods": {"allgather s8": {"report_at_start": report, "enable_s": 4.0}},
                "h2d_one_gbps": 55.0, "h2d_both_gbps": 55.0, "gather_ms_largest_block": 2.0,
                "largest_block_bytes": 2**30, "model": {"params": 1, "bytes": 2}}

    args = argparse.Namespace(out=str(tmp_path), batches=[1], tiny=True)
    dp.finish([rank(0, resident=True), rank(1, resident=True)], args)
    summary = json.loads((tmp_path / "offload_dp.json").read_text())
    target = summary["targets"]["s8"]
    assert target["allgather_b1_ms_worst_rank"] == 216.0
    bounds = target["bounds"]
    # 11 GB per rank at 55 GB/s = 200 ms + 2 ms gather; resident 230 ms is the larger.
    assert bounds["start"]["floor_ms"] == pytest.approx(202.0)
    assert bounds["start"]["bound_ms"] == pytest.approx(1.05 * 230.0)
    assert bounds["adjacent"]["h2d_gbps"] == pytest.approx(55.0)
    # The slowest rank's mean of before and after: rank 1's (50 + 48) / 2.
    assert bounds["shard_pass"]["h2d_gbps"] == pytest.approx(49.0)
    assert bounds["shard_pass"]["floor_ms"] == pytest.approx(11e9 / 49e9 * 1e3 + 2.0)
    assert all(b["ok"] for b in bounds.values())

    dp.finish([rank(0, resident=False), rank(1, resident=False)], args)
    bounds = json.loads((tmp_path / "offload_dp.json").read_text())["targets"]["s8"]["bounds"]
    assert bounds["start"]["bound_ms"] == pytest.approx(1.05 * 202.0)
    assert bounds["start"]["ok"] is False  # 216 ms against 212.1
    assert bounds["shard_pass"]["ok"] is True  # against 1.05 x 226.5
    text = (tmp_path / "offload_dp.md").read_text()
    assert "(resident not measured: 1.05 x the floor alone)" in text
    assert "1.05 x max(0.0, 202.0) = 212.1 ms: NOT met" in text


def test_offload_dp_shard_frames_samples_every_2mib(tmp_path: Path) -> None:
    """One pagemap entry per 2 MiB of each shard region, each with a frame counted in exactly
    one physical-GiB bucket (frames read as 0, i.e. uncounted, without CAP_SYS_ADMIN)."""
    torch = pytest.importorskip("torch")
    dp = load("offload_dp")
    slabs = {0: torch.ones(5 * 2**20, dtype=torch.uint8), 1: torch.ones(2**20, dtype=torch.uint8)}

    class Storage:
        def shards(self) -> list:
            return list(slabs)

        def regions(self, index: int) -> dict:
            return {torch.bfloat16: slabs[index]}

    handle = argparse.Namespace(_storage=Storage(), plan=argparse.Namespace(streamed=[0, 1]))
    frames = dp.shard_frames(handle)
    if frames is None:
        pytest.skip("no /proc/self/pagemap here")
    assert frames["sampled"] == 3 + 1  # 5 MiB: samples at 0, 2, 4 MiB; 1 MiB: one
    assert frames["with_frame"] == sum(frames["per_physical_gib"].values())
    assert dp.shard_frames(argparse.Namespace()) is None  # rank-local offload: no shards
