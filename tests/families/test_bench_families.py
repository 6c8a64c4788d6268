"""bench/offload_families.py's CPU smoke mode: every method and cell runs on tiny DiTs, and
the report (cells, DLO facts, targets, table) is complete. Timings are not asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_bench_tools import load  # type: ignore[import-not-found]


def load_bench():  # type: ignore[no-untyped-def]
    return load("offload_families")


@pytest.mark.parametrize(("model", "cells"), [
    ("qwen-image", {"b1", "b4"}),
    ("wan2.2", {"expert1 b1", "straddle b1+1"}),
    ("z-image", {"b1", "b4"}),
    ("flux2", {"b1", "b4"}),
    ("minimax-h3", {"b1"}),
])
def test_tiny_run_reports_every_cell(model: str, cells: set[str], tmp_path: Path) -> None:
    bench = load_bench()
    assert bench.main(["--tiny", "--model", model, "--out", str(tmp_path),
                       "--warmup", "0", "--iters", "1"]) == 0
    result = json.loads((tmp_path / "offload_families.json").read_text())
    methods = {"resident", "dlo"} | ({"diffusers-block", "diffusers-leaf"}
                                     if model != "wan2.2" else set())
    assert {(c["method"], c["cell"]) for c in result["cells"]} == {
        (m, c) for m in methods for c in cells}
    report = result["methods"]["dlo"]["report"]
    # Wan 2.2: both experts through one set of slots; Z-Image: 1 + 1 refiners and 3
    # layers; FLUX.2: 1 double + 2 single blocks; MiniMax-H3: 1 refiner + 2 blocks.
    blocks = {"wan2.2": 4, "z-image": 5, "flux2": 3, "minimax-h3": 3}.get(model, 2)
    assert report["streamed_blocks"] == blocks and report["slots"] == 2
    assert any(t["target"].startswith("DLO pinned host") for t in result["targets"])
    if model == "flux2":  # issue 46's step targets (the floor needs a measured H2D rate)
        named = {t["target"] for t in result["targets"]}
        assert "DLO b4 <= 1.05 x resident b4" in named
        floor = "DLO b1 <= 1.02 x its streamed-bytes floor"
        assert (floor in named) == bool(result.get("h2d_gbps"))
    if model == "minimax-h3":  # issue 48's step target (the floor needs a measured H2D rate)
        named = {t["target"] for t in result["targets"]}
        floor = "DLO b1 <= 1.02 x max(resident, streamed-bytes floor)"
        assert (floor in named) == bool(result.get("h2d_gbps"))
    assert "| target | value | bound | ok |" in (tmp_path / "offload_families.md").read_text()


def test_tiny_cosmos3_runs_and_compares_with_a_baseline(tmp_path: Path) -> None:
    # One request with CFG is one forward over two packed sequences; the Super-sized run
    # (FP8, as its bf16 would not fit the host) reads the Nano run as its baseline.
    bench = load_bench()
    nano, super_ = tmp_path / "nano", tmp_path / "super"
    assert bench.main(["--tiny", "--model", "cosmos3", "--methods", "resident", "dlo",
                       "--out", str(nano), "--warmup", "0", "--iters", "1"]) == 0
    assert bench.main(["--tiny", "--model", "cosmos3-super", "--methods", "dlo",
                       "--quantization", "fp8", "--baseline",
                       str(nano / "offload_families.json"), "--out", str(super_),
                       "--warmup", "0", "--iters", "1"]) == 0
    first = json.loads((nano / "offload_families.json").read_text())
    assert {(c["method"], c["cell"]) for c in first["cells"]} == {
        ("resident", "b1 cfg"), ("dlo", "b1 cfg")}
    assert first["methods"]["dlo"]["report"]["streamed_blocks"] == 2
    second = json.loads((super_ / "offload_families.json").read_text())
    assert second["quantization"] == "fp8"
    assert any(t["target"].startswith("DLO peak HBM growth") for t in second["targets"])


def test_tiny_cosmos3_super_runs_its_baseline_in_the_same_process(tmp_path: Path) -> None:
    # --baseline-model: the Nano DiT under DLO first (same quantization), then the
    # Super-sized one, judged against it: the growth target from one command.
    bench = load_bench()
    assert bench.main(["--tiny", "--model", "cosmos3-super", "--methods", "dlo",
                       "--quantization", "fp8", "--baseline-model", "cosmos3",
                       "--out", str(tmp_path), "--warmup", "0", "--iters", "1"]) == 0
    base = json.loads((tmp_path / "baseline-cosmos3" / "offload_families.json").read_text())
    assert (base["model"], base["quantization"]) == ("cosmos3", "fp8")
    assert {(c["method"], c["cell"]) for c in base["cells"]} == {("dlo", "b1 cfg")}
    result = json.loads((tmp_path / "offload_families.json").read_text())
    assert result["model"] == "cosmos3-super"
    assert result["baseline"] == str(tmp_path / "baseline-cosmos3" / "offload_families.json")
    growth = [t for t in result["targets"] if t["target"].startswith("DLO peak HBM growth")]
    assert len(growth) == 1
    # The peak split into the offload's own share and the activations', shown, not judged.
    split = [t for t in result["targets"] if t["target"].startswith("(split")]
    assert len(split) == 2 and all(t["bound"] is None and t["ok"] is None for t in split)
    own = result["methods"]["dlo"]["report"]
    assert split[0]["value"] * 2**30 == own["slots"] * own["slot_bytes"] + own[
        "resident_module_bytes"]
    with pytest.raises(SystemExit):  # an earlier run's file and a run now: one or the other
        bench.main(["--tiny", "--model", "cosmos3-super", "--baseline", "x.json",
                    "--baseline-model", "cosmos3", "--out", str(tmp_path / "both")])


def test_super_is_built_fp8_one_layer_at_a_time() -> None:
    # build_fp8_by_layer: every decoder layer from a one-layer DiT of its own, quantized as
    # made (an 80 GiB GPU never holds the Super DiT's bf16), then one stack of the config's
    # layer count whose layers' linears are FP8 - what the whole build then quantized gives.
    import torch

    from ditserve.engine.formats.fp8_linear import FP8Linear

    bench = load_bench()
    dit = bench.build_fp8_by_layer("cosmos3-super", "tiny", torch.device("cpu"), 0)
    # The released Nano config names no layer count (the class's default); Super's does.
    assert bench.layer_count("cosmos3", "full") == 36
    assert bench.layer_count("cosmos3-super", "full") == 64
    assert len(dit.layers) == dit.config.num_hidden_layers == 2
    kinds = [{type(m) for m in layer.modules()} for layer in dit.layers]
    assert all(FP8Linear in k for k in kinds)
    first, second = (layer.state_dict() for layer in dit.layers)
    assert first.keys() == second.keys()
    assert any(not torch.equal(first[k].float(), second[k].float()) for k in first)  # own seeds


def test_cosmos3_layer_memory_counts_both_dits_at_720p(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    # On the meta device: full-size layers, no weights; the wider DiT holds more.
    tool = load("cosmos3_layer_memory")
    assert tool.main([]) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| cosmos3")]
    peaks = {r[1].strip(): float(r[3]) for r in rows}
    assert set(peaks) == {"cosmos3", "cosmos3-super"}
    assert 0 < peaks["cosmos3"] < peaks["cosmos3-super"]
