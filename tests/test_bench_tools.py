"""The benchmark programs: their own bookkeeping, their CPU smoke modes, and how they use the engine.

The benchmarks themselves need GPUs; what they compute from their measurements does not, and
a wrong overlap share or a lost cell would silently change a recorded conclusion. Their
``--tiny`` modes run the same code paths on a CPU. And they read engine state only through the
offload handle's public report and probe: no private attributes, no patched engine modules,
no programs importing each other (``bench/harness.py`` and ``bench/offload_methods.py`` are
the shared modules).
"""

from __future__ import annotations

import argparse
import ast
import gzip
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"
# Modules the programs share (not programs themselves: no main).
SHARED = ("harness", "offload_methods", "cosmos3_inputs", "minimax_h3_inputs", "adapter_files",
          "job_processes", "live_bytes", "delivery_fixture", "sync_sites", "trace_events")  # in import order
PROGRAMS = sorted(p.stem for p in BENCH.glob("*.py") if p.stem not in SHARED)


def load(name: str) -> ModuleType:
    """A bench program as a module. Programs import the shared modules by name (their folder
    is on sys.path when they run): bind them while the program loads, then put sys.modules
    back. A program that changes sys.path as it loads gets it put back too: a test worker's
    sys.path is what the processes it spawns import from (bench/offload.py would stand in
    for tests/offload)."""
    saved = {shared: sys.modules.get(shared) for shared in SHARED}
    path = list(sys.path)
    try:
        for shared in SHARED:
            sys.modules[shared] = _exec(BENCH / f"{shared}.py", f"bench_{shared}")
        return _exec(BENCH / f"{name}.py", f"bench_{name}")
    finally:
        sys.path[:] = path
        for shared, module in saved.items():
            if module is not None:
                sys.modules[shared] = module
            else:
                sys.modules.pop(shared, None)


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
    from dataclasses import replace

    from ditserve.engine.offload import OffloadProbe

    dp = load("offload_dp")
    slabs = (torch.ones(5 * 2**20, dtype=torch.uint8), torch.ones(2**20, dtype=torch.uint8))
    probe = OffloadProbe(device=torch.device("cpu"), transfer="h2d+allgather", copy_stream=None,
                         comm_stream=None, block_slots=(), shard_slots=(), shard_regions=slabs)
    frames = dp.shard_frames(probe)
    if frames is None:
        pytest.skip("no /proc/self/pagemap here")
    assert frames["sampled"] == 3 + 1  # 5 MiB: samples at 0, 2, 4 MiB; 1 MiB: one
    assert frames["with_frame"] == sum(frames["per_physical_gib"].values())
    assert dp.shard_frames(replace(probe, shard_regions=())) is None  # rank-local: no shards


# -- the CPU smoke modes ---------------------------------------------------------------------------
def test_trace_gaps_splits_idle_compute_by_what_it_waited_for(tmp_path: Path) -> None:
    tg = load("trace_gaps")
    step = {"ph": "X", "cat": "user_annotation", "name": "bench_step", "ts": 0, "dur": 10}
    resident = [step, kernel("nvjet_gemm", 0, 600), kernel("flash_fwd", 600, 400)]
    dlo = [
        step, {**step, "ts": 2000},  # two profiled steps
        h2d(0, 300, 15_000_000),  # the first block's copy: compute waits for it
        kernel("nvjet_gemm", 300, 700), h2d(300, 800, 40_000_000),  # 500 us of it beside
        # 100 us idle while the copy runs on, then a host gap of 200 us with no copy
        kernel("flash_fwd", 1100, 400), kernel("elementwise", 1700, 300),
    ]
    paths = []
    for name, events in (("resident", resident), ("dlo", dlo)):
        paths.append(tmp_path / f"{name}_trace.json.gz")
        with gzip.open(paths[-1], "wt") as f:
            json.dump({"traceEvents": events}, f)

    times = tg.step_times(tg.load_events(paths[1]))
    assert times.steps == 2
    assert times.window == pytest.approx(2.0 / 2)  # 2000 us over two steps, in ms
    assert times.compute == pytest.approx(1.4 / 2)
    assert times.by_kind == pytest.approx({"gemm": 0.35, "attention": 0.2, "other kernels": 0.15})
    assert times.copies == pytest.approx(1.1 / 2)
    assert times.copy_gb == pytest.approx(0.055 / 2)
    assert times.overlap == pytest.approx(0.7 / 2)  # the GEMM beside the second copy
    assert times.idle_copying == pytest.approx(0.4 / 2)  # before the GEMM, before attention
    assert times.idle_host == pytest.approx(0.2 / 2)
    assert times.gaps == pytest.approx(3 / 2)

    table = tg.table(["resident", "dlo"], [tg.step_times(tg.load_events(p)) for p in paths])
    assert "| GPU window ms | 1.0 | 1.0 | 1.000 |" in table
    assert "| compute busy ms | 1.0 | 0.7 | 0.700 |" in table
    assert "| compute idle, no copy ms | 0.0 | 0.1 | - |" in table
    with pytest.raises(ValueError, match="no profiled steps"):
        tg.step_times([step])


def test_slot_model_pipelines_copies_and_compute_through_the_ring() -> None:
    sm = load("slot_model")
    blocks = sm.parse_blocks(["2x1/3", "2x3/1"])  # two copy-bound blocks, two compute-bound
    assert blocks == [(1.0, 3.0)] * 2 + [(3.0, 1.0)] * 2
    # Two slots: a copy waits for the slot the block before last used, so the step is the sum
    # of the larger of each block's compute and the next block's copy (the ring wraps).
    assert sm.step_ms(blocks, 2) == pytest.approx(max(1, 3) + max(1, 1) + max(3, 1) + max(3, 3))
    # With a slot per block every copy runs ahead: the copies alone bound the step.
    assert sm.step_ms(blocks, 4) == pytest.approx(max(1 + 1 + 3 + 3, 3 + 3 + 1 + 1))
    uniform = sm.parse_blocks(["5x2/1"])
    assert sm.step_ms(uniform, 2) == pytest.approx(10)  # compute-bound: copies hidden
    assert "| 2 | 10.0 | 1.250 |" in sm.table(blocks, [2, 4])
    with pytest.raises(argparse.ArgumentTypeError):
        sm.parse_blocks(["19 x 7"])


def test_offload_bench_times_extra_slot_counts(tmp_path: Path) -> None:
    bench = load("offload")
    assert bench.main(["--tiny", "--out", str(tmp_path), "--resolutions", "64", "--batches", "1",
                       "--warmup", "0", "--iters", "1", "--no-profile", "--methods", "resident",
                       "dlo", "--dlo-slots", "3"]) == 0
    results = json.loads((tmp_path / "offload_bench.json").read_text())
    assert {c["method"] for c in results["cells"]} == {"resident", "dlo", "dlo-s3"}
    assert results["methods"]["dlo-s3"]["report_at_start"]["slots"] == 3
    assert "dlo-s3 ms/step" in (tmp_path / "offload_bench.md").read_text()


def test_offload_bench_tiny_run_reports_dlo_against_resident(tmp_path: Path) -> None:
    bench = load("offload")
    assert bench.main(["--tiny", "--out", str(tmp_path), "--resolutions", "64", "--batches",
                       "1", "2", "--warmup", "1", "--iters", "2", "--profile-res", "64",
                       "--methods", "resident", "dlo"]) == 0
    results = json.loads((tmp_path / "offload_bench.json").read_text())
    cells = {(c["method"], c["batch"]) for c in results["cells"]}
    assert cells == {(m, b) for m in ("resident", "dlo") for b in (1, 2)}
    dlo = results["methods"]["dlo"]
    assert dlo["report_at_start"]["streamed_blocks"] == 5
    assert dlo["report_at_start"]["transfer"] == "sync-copy"
    # One profiled warm-up step and three timed ones, each streaming every block once.
    assert dlo["bytes_per_profiled_step"] == dlo["report_at_start"]["streamed_bytes"]
    targets = {t["target"]: t for t in results["targets"]}
    assert targets["host pinned <= 1.02 x streamed bytes"]["ok"]
    table = (tmp_path / "offload_bench.md").read_text()
    assert "| 64 | 1 |" in table and "| 64 | 2 |" in table


class _DeviceOutput:
    """A CUDA output as a CPU-only machine can stand one in: it says it lives on the GPU, its
    clone stays there, and only a copy to the host gives a real tensor."""

    device = torch.device("cuda", 0)

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def clone(self) -> _DeviceOutput:
        return _DeviceOutput(self.value.clone())

    def detach(self) -> _DeviceOutput:
        return self

    def to(self, device: str | torch.device, *, copy: bool = False) -> torch.Tensor | _DeviceOutput:
        return self.value.clone() if torch.device(device).type == "cpu" else self

    def cpu(self) -> torch.Tensor:
        return self.value.clone()


def test_offload_bench_keeps_reference_outputs_off_the_device(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every cell's peak HBM is read as max_memory_allocated, so an output the bench keeps for a
    bit-identity check must not stay in HBM: resident's kept 1024^2 b1 output (512 KiB) put
    DLO's peak rows 0.46 MiB over their bound."""
    bench = load("offload")
    monkeypatch.setattr(bench.harness, "image_inputs", lambda *a, **k: {})
    args = argparse.Namespace(out=str(tmp_path), resolutions=[64], model="flux",
                              compiled_batches=[1])
    b = bench.Bench(args)
    b.results["methods"] = {"resident": {}, "dlo": {}}
    for method in ("resident", "dlo"):
        b.record_output(method, lambda **inputs: (_DeviceOutput(torch.arange(4.0)),))
        kept = b.outputs[method]
        assert isinstance(kept, torch.Tensor) and kept.device.type == "cpu", method
    assert b.results["methods"]["dlo"]["identical_to"] == {"resident": True}


def test_offload_bench_formats_smoke_runs_every_format_method_and_judges_the_targets(
        tmp_path: Path) -> None:
    bench = load("offload")
    assert bench.main(["--tiny", "--formats", "--out", str(tmp_path), "--resolutions", "64",
                       "--batches", "1", "--compiled-batches", "1", "--warmup", "0", "--iters",
                       "1", "--compile-backend", "aot_eager"]) == 0
    results = json.loads((tmp_path / "offload_bench.json").read_text())
    cells = {c["method"] for c in results["cells"]}
    assert cells == set(bench.FORMAT_METHODS)
    methods = results["methods"]
    assert methods["dlo-packed"]["identical_to"] == {"dlo": True}
    packed = methods["dlo-packed"]["report_at_start"]
    assert packed["compress"] == "lossless" and packed["transfer"] == "sync-copy+decode"
    assert results["fp8"]["layers"] > 0
    assert methods["fp8-dlo"]["report_at_start"]["streamed_bytes"] < (
        methods["dlo"]["report_at_start"]["streamed_bytes"])
    targets = {t["target"].split(" (")[0]: t for t in results["targets"]}
    for name in ("packed DLO b1 <= 0.78 x bf16 DLO b1, outputs bit-identical",
                 "FP8 DLO b1 <= 0.55 x bf16 DLO b1",
                 "compiled FP8 resident b1 >= 1.3x faster than compiled bf16 resident b1",
                 "compiled FP8 DLO b1 <= 0.6 x eager bf16 resident b1",
                 "dlo-packed: host pinned <= 1.02 x bytes streamed",
                 "fp8-dlo: host pinned <= 1.02 x bytes streamed"):
        assert targets[name]["value"] is not None, name  # timed and judged (CPU: not meaningful)
    assert "| target | value | bound | ok |" in (tmp_path / "offload_bench.md").read_text()


def test_checkpoint_formats_smoke_streams_each_format(tmp_path: Path) -> None:
    formats = load("formats")
    out = tmp_path / "out"
    assert formats.main(["--tiny", "--model-dir", str(tmp_path / "flux"), "--out", str(out),
                         "--formats", "bf16", "gguf:Q8_0", "fp8", "--dequant", "compute",
                         "slot"]) == 0
    result = json.loads((out / "formats.json").read_text())
    rows = {r["format"]: r for r in result["rows"]}
    assert set(rows) == {"bf16", "gguf:Q8_0", "gguf:Q8_0+slot", "fp8"}
    # slot dequantization streams the same bytes through larger slots
    slot, compute = rows["gguf:Q8_0+slot"], rows["gguf:Q8_0"]
    assert slot["streamed_bytes"] == compute["streamed_bytes"]
    assert slot["slot_bytes"] > compute["slot_bytes"]
    # the quantized forms stream fewer bytes than bf16 (the tiny DiT's small tensors stay F32)
    assert rows["gguf:Q8_0"]["streamed_bytes"] < rows["bf16"]["streamed_bytes"]
    assert rows["fp8"]["streamed_bytes"] < rows["bf16"]["streamed_bytes"]
    assert all(r["dlo_ms"] > 0 and r["floor_ms"] > 0 for r in rows.values())
    assert not list((tmp_path / "flux-formats").iterdir())  # converted files removed


def test_checkpoint_formats_smoke_gives_a_row_per_slot_count(tmp_path: Path) -> None:
    formats = load("formats")
    out = tmp_path / "out"
    assert formats.main(["--tiny", "--model-dir", str(tmp_path / "flux"), "--out", str(out),
                         "--formats", "gguf:Q8_0", "--dequant", "compute", "slot",
                         "--slots", "2", "3"]) == 0
    rows = {r["format"]: r for r in json.loads((out / "formats.json").read_text())["rows"]}
    assert set(rows) == {"gguf:Q8_0", "gguf:Q8_0+3slots", "gguf:Q8_0+slot",
                         "gguf:Q8_0+slot+3slots"}
    assert rows["gguf:Q8_0+3slots"]["slots"] == 3 and rows["gguf:Q8_0"]["slots"] == 2
    # a third slot holds one more block of the same size: the same bytes a step
    three, two = rows["gguf:Q8_0+3slots"], rows["gguf:Q8_0"]
    assert three["streamed_bytes"] == two["streamed_bytes"]
    assert three["slot_bytes"] == two["slot_bytes"]  # per slot


def test_checkpoint_formats_smoke_times_a_compiled_row_beside_each_eager_one(
        tmp_path: Path) -> None:
    formats = load("formats")
    out = tmp_path / "out"
    assert formats.main(["--tiny", "--model-dir", str(tmp_path / "flux"), "--out", str(out),
                         "--formats", "fp8", "--compile", "--compile-backend", "aot_eager"]) == 0
    rows = {r["format"]: r for r in json.loads((out / "formats.json").read_text())["rows"]}
    assert set(rows) == {"fp8", "fp8+compiled"}
    eager, compiled = rows["fp8"], rows["fp8+compiled"]
    assert compiled["compiled"] and "compiled" not in eager
    # the same offload, so the same bytes and floor; its own time and ratio
    assert compiled["streamed_bytes"] == eager["streamed_bytes"]
    assert compiled["floor_ms"] == eager["floor_ms"]
    assert compiled["dlo_over_floor"] == compiled["dlo_ms"] / compiled["floor_ms"]
    targets = [t["target"] for t in json.loads((out / "formats.json").read_text())["targets"]]
    assert "fp8+compiled DLO b1 <= 1.05 x its floor" in targets
    assert "fp8+compiled" in (out / "formats.md").read_text()


def test_offload_mmap_bench_tiny_run_equals_resident(tmp_path: Path) -> None:
    bench = load("offload_mmap")
    assert bench.main(["--tiny", "--out", str(tmp_path / "out"), "--res", "64", "--warmup",
                       "1", "--iters", "1", "--procs", "--cache-root",
                       str(tmp_path / "cache")]) == 0
    results = json.loads((tmp_path / "out" / "offload_mmap_bench.json").read_text())
    methods = results["methods"]
    assert all(methods[m]["equal_to_resident"] for m in ("private", "mmap-staging",
                                                          "mmap-registered"))
    assert methods["private"]["report"]["backing"] == "pageable"
    assert methods["mmap-staging"]["report"]["backing"] == "runtime_cache-staging"
    assert "needs a CUDA device" in methods["mmap-registered"]["report"]["fallback_reason"]


def test_compile_bench_tiny_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = load("compile")
    assert bench.main(["--tiny", "--backend", "eager", "--dlo", "--layers", "1",
                       "--single-layers", "1", "--batches", "1", "--warmup", "0", "--iters", "1",
                       "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "compile.json").read_text())
    assert set(results["eager"]) == set(results["compiled"]) == {"1"}
    assert "DLO, 2 slots, 2 blocks" in capsys.readouterr().out


@pytest.mark.slow
def test_offload_dp_bench_tiny_run_in_two_gloo_processes(tmp_path: Path) -> None:
    # A real run of the program (mp.spawn needs it as __main__): local and AllGather DLO.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(BENCH / "offload_dp.py"), "--tiny", "--out", str(tmp_path),
         "--methods", "local", "allgather", "--variants", "s2", "--batches", "1",
         "--warmup", "0", "--iters", "1"],
        capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "offload_dp.json").read_text())
    ranks = summary["ranks"]
    for rank, r in enumerate(ranks):
        report = r["methods"]["allgather s2"]["report_at_start"]
        assert (report["group_size"], report["group_rank"]) == (2, rank)
        assert report["transfer"] == "h2d+allgather"
        layout = r["methods"]["allgather s2"]["device_layout"]
        assert len(layout["block_slots"]) == 2 and len(layout["shard_slots"]) == 3
    assert "s2" in summary["targets"]


# -- how the programs use the engine ---------------------------------------------------------------
MUTATORS = {"update", "append", "extend", "clear", "pop", "insert", "setdefault", "remove"}


def _engine_aliases(tree: ast.Module) -> set[str]:
    """Names bound to the engine's modules (or the harness) by the program's imports."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names
                         if a.name.startswith(("ditserve", *SHARED)))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ditserve"):
            # ``from package import module``: the bound names may be modules too.
            names.update(a.asname or a.name for a in node.names)
    return names


def _changes_module_globals(tree: ast.Module) -> list[str]:
    """Functions that rebind (``global``) or mutate the program's own module-level names."""
    top = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
           for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
           if isinstance(t, ast.Name)}
    found = []
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.Global):
                found.append(f"line {node.lineno}: global {', '.join(node.names)}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in MUTATORS and isinstance(node.func.value, ast.Name) \
                    and node.func.value.id in top:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("name", PROGRAMS)
def test_every_program_loads(name: str) -> None:
    assert callable(load(name).main)


@pytest.mark.parametrize("name", PROGRAMS + list(SHARED))
def test_programs_use_only_public_engine_state_and_share_only_the_harness(name: str) -> None:
    source = (BENCH / f"{name}.py").read_text()
    tree = ast.parse(source)
    assert _changes_module_globals(tree) == [], f"{name}.py changes module-level state"
    # A program runs with its folder on sys.path already; one that adds it as it loads leaves
    # bench/ on the path of whatever imported it (a test worker, and the processes it spawns).
    assert not re.search(r"sys\.path\.(insert|append)", source), f"{name}.py changes sys.path"
    modules = _engine_aliases(tree)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imported = ([a.name for a in node.names] if isinstance(node, ast.Import)
                        else [node.module or ""])
            assert not set(m.split(".")[0] for m in imported) & set(PROGRAMS), (
                f"{name}.py imports another benchmark program; share code through a shared module")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            owner = ast.unparse(node.value)
            # Own attributes, and torch's host-cache hook (no public name for it).
            assert owner == "self" or ast.unparse(node) == "torch._C", (
                f"{name}.py:{node.lineno} reads a private attribute: {ast.unparse(node)}")
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AugAssign) else [])
        for target in targets:
            assert not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id in modules), (
                f"{name}.py:{node.lineno} patches a module: {ast.unparse(target)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in MUTATORS and isinstance(node.func.value, ast.Attribute) \
                and isinstance(node.func.value.value, ast.Name) \
                and node.func.value.value.id in modules:
            pytest.fail(f"{name}.py:{node.lineno} mutates module state: {ast.unparse(node)}")


def test_checkpoint_formats_judges_a_compiled_row_against_its_resident_step_too() -> None:
    # A compute-bound format (Q4_K: its resident step is longer than its copies) can reach
    # the resident step, not the copy floor: the compiled row gets both targets.
    formats = load("formats")
    rows = [{"format": "gguf:Q4_K", "dlo_ms": 197.0, "floor_ms": 124.0, "resident_ms": 193.0,
             "streamed_bytes": 6},
            {"format": "gguf:Q4_K+compiled", "compiled": True, "dlo_ms": 174.0,
             "floor_ms": 124.0, "resident_ms": 168.0, "streamed_bytes": 6}]
    judged = {t["target"]: t for t in formats.targets(rows)}
    floor = judged["gguf:Q4_K+compiled DLO b1 <= 1.05 x its floor"]
    reach = judged["gguf:Q4_K+compiled DLO b1 <= 1.05 x max(floor, resident)"]
    assert not floor["ok"] and floor["bound"] == 1.05 * 124.0
    assert reach["ok"] and reach["bound"] == 1.05 * 168.0
    # the eager row keeps only its floor target (its resident time is the eager one)
    assert "gguf:Q4_K DLO b1 <= 1.05 x max(floor, resident)" not in judged
