"""bench/whole_pipeline.py, bench/z_image_latency.py and bench/host_rss.py in their CPU modes: each configuration's
engine flags go through the engine's own parser and one end-to-end request per timed step
count runs through the public engine; host_rss samples a child that loads the engine."""

from __future__ import annotations

import json
from pathlib import Path

from test_bench_tools import load  # type: ignore[import-not-found]


def test_whole_pipeline_tiny_runs_each_configuration(tmp_path: Path) -> None:
    bench = load("whole_pipeline")
    assert bench.main(["--model", "flux", "--size", "tiny", "--out", str(tmp_path),
                       "--configs", "dlo-resident-encoders", "dlo-whole",
                       "--config", "dlo-whole=--offload dlo --vae-tiling on"]) == 0
    result = json.loads((tmp_path / "whole_pipeline_flux_tiny.json").read_text())
    runs = result["configs"]
    assert set(runs) == {"dlo-resident-encoders", "dlo-whole"}
    assert runs["dlo-whole"]["flags"] == "--offload dlo --vae-tiling on"
    for run in runs.values():
        assert set(run["latency_s"]) == {"1", "2"} and run["request_s"] > 0
        assert run["offload"]["active"] is True  # DLO was on, as the flags said
        assert {row["name"] for row in run["pipeline"]["plan"]} >= {"transformer", "vae"}
    (target,) = result["targets"]  # no peak HBM on a CPU: the latency ratio only
    assert target["bound"] == 1.03 and isinstance(target["met"], bool)
    assert "dlo-whole" in (tmp_path / "whole_pipeline_flux_tiny.md").read_text()


def test_whole_pipeline_tiny_wan_keeps_earlier_configurations(tmp_path: Path) -> None:
    bench = load("whole_pipeline")
    args = ["--model", "wan", "--size", "tiny", "--out", str(tmp_path)]
    assert bench.main([*args, "--configs", "resident"]) == 0
    assert bench.main([*args, "--configs", "dlo-whole", "auto-budget", "--config",
                       "auto-budget=--offload dlo --dlo-hbm-budget-gib auto"]) == 0
    result = json.loads((tmp_path / "whole_pipeline_wan_tiny.json").read_text())
    assert set(result["configs"]) == {"resident", "dlo-whole", "auto-budget"}
    # A configuration the engine refuses at start (auto needs CUDA) is recorded, not fatal.
    assert "CUDA" in result["configs"]["auto-budget"]["refused"]
    assert result["request"] == "64x64x9, CFG on"
    assert result["configs"]["resident"]["offload"] is None


def test_host_rss_tiny_samples_a_loading_child(tmp_path: Path) -> None:
    bench = load("host_rss")
    assert bench.main(["--tiny", "--flags", "--offload dlo", "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "host_rss.json").read_text())
    assert row["samples"] > 0 and row["peak_rss_bytes"] >= row["sampled_peaks"]["VmRSS"] > 0
    assert row["baseline"]["VmRSS"] > 0 and row["load_rss_bytes"] >= 0
    acct = row["accounting"]
    assert acct["problems"] == [] and acct["private_bytes"] == 0  # streamed from the mapping
    assert 0 < acct["mapped_bytes"] <= acct["streamed_bytes"]
    assert acct["pinned_bytes"] <= 1.02 * acct["streamed_bytes"]
    assert "peak RSS" in (tmp_path / "host_rss.md").read_text()


def test_a_budgeted_configuration_is_judged_on_allocated_and_reserved_hbm() -> None:
    bench = load("whole_pipeline")
    gib = 1 << 30
    runs = {"budget": {"memory": {"peak_allocated": 8.5 * gib, "peak_reserved": 11.9 * gib},
                       "pipeline": {"memory": {"budget_bytes": 10 * gib, "auto": False}}},
            "auto": {"memory": {"peak_allocated": 50 * gib, "peak_reserved": 60 * gib},
                     "pipeline": {"memory": {"budget_bytes": 40 * gib, "auto": True}}},
            "refused": {"refused": "cannot hold the pipeline"}}
    found = {t["target"]: t["met"] for t in bench.targets({"configs": runs},
                                                          bench.WORKLOADS["wan"])}
    # The reserved bytes (what other tenants of the device see) are held to the budget too;
    # auto (the device's free HBM) and refused runs are not judged.
    assert found == {"budget peak allocated <= its budget 10.00 GiB": True,
                     "budget peak reserved <= its budget 10.00 GiB": False}


def test_a_run_that_fails_is_recorded_with_its_hbm_and_the_gap_at_rest() -> None:
    """Issue 45 item 12: a budget's run that runs out of HBM is a result (the table goes on),
    judged on what it had allocated and reserved; each plan's HBM at rest is set against its
    held terms without the prompt cache, so a held term the planner misses shows."""
    bench = load("whole_pipeline")
    gib = 1 << 30
    plan = {"budget_bytes": 4 * gib, "auto": False, "predicted_peak_bytes": int(3.7 * gib),
            "held_bytes": {"dit": gib, "prompt cache": gib // 4}}
    failed = {"flags": "--dlo-hbm-budget-gib 4", "failed": "2 x 28 steps: out of memory",
              "weights_on_device": int(1.5 * gib), "pipeline": {"memory": plan},
              "left_allocated": 0,
              "memory": {"allocated": int(3.85 * gib), "peak_allocated": int(3.9 * gib),
                         "peak_reserved": 4 * gib}}
    results = {"configs": {"budget4": failed}, "steps": 28, "size": "full"}
    results["targets"] = bench.targets(results, bench.WORKLOADS["flux"])
    # The budget is judged on the failure's HBM; the plan's accuracy needs a full run.
    assert {t["target"] for t in results["targets"]} == {
        "budget4 peak allocated <= its budget 4.00 GiB",
        "budget4 peak reserved <= its budget 4.00 GiB"}
    text = bench.table(results)
    assert "failed: 2 x 28 steps: out of memory" in text
    assert ("- budget4 at rest: 1.500 GiB allocated, planned held 1.000 GiB without the "
            "prompt cache (+0.500); when it failed 3.850 GiB allocated, peak 3.900 allocated, "
            "4.000 reserved; left allocated after shutdown 0.000 GiB") in text


def test_host_rss_names_the_phase_a_peak_fell_in() -> None:
    bench = load("host_rss")
    phases = [(10.0, "start"), (12.0, "loader: DLO host backing"), (20.0, "plan")]
    assert bench.phase_at(phases, 13.5) == "1.5 s after: loader: DLO host backing"
    assert bench.phase_at(phases, 9.0) == "before the first log line"


def test_the_plans_prediction_is_judged_against_the_measured_peak(tmp_path: Path) -> None:
    """Issue 45: the lead verifies the planner's +-15% on the H200 with this target; the
    prompt cache counts at what the run filled, not at its bound."""
    bench = load("whole_pipeline")
    gib = 1 << 30
    plan = {"predicted_peak_bytes": int(4.0 * gib), "held_bytes": {"prompt cache": gib}}
    runs = {"close": {"memory": {"peak_allocated": 3 * gib, "peak_reserved": 4 * gib},
                      "pipeline": {"memory": plan}, "prompt_cache": {"bytes": 0},
                      "concurrent": 4},
            "far": {"memory": {"peak_allocated": 2 * gib, "peak_reserved": 3 * gib},
                    "pipeline": {"memory": plan}, "prompt_cache": {"bytes": gib}}}
    found = {t["target"].split()[0]: (round(t["value"], 3), t["met"])
             for t in bench.targets({"configs": runs}, bench.WORKLOADS["flux"])
             if "predicted" in t["target"]}
    assert found == {"close": (1.0, True), "far": (2.0, False)}
    assert bench.main(["--model", "flux", "--size", "tiny", "--out", str(tmp_path),
                       "--configs", "dlo-whole", "--concurrent", "plan"]) == 0
    result = json.loads((tmp_path / "whole_pipeline_flux_tiny.json").read_text())
    assert result["configs"]["dlo-whole"]["concurrent"] == 4
def test_z_image_latency_tiny_runs_bare_and_engine(tmp_path: Path) -> None:
    bench = load("z_image_latency")
    assert bench.main(["--tiny", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "z_image_latency_tiny.json").read_text())
    bare = result["bare"]
    assert bare["bare_s"] == bare["encode_s"] + 2 * bare["step_s"] + bare["decode_s"] > 0
    (run,) = result["configs"].values()
    assert len(run["latencies_s"]) == 2 and run["median_s"] > 0
    assert result["targets"] == []  # a CPU smoke run judges nothing
    # Judged from full-size numbers as the GPU run gives them.
    rows = bench.targets({"bare": {"bare_s": 1.0}, "configs": {
        "resident": {"median_s": 1.05}, "dlo-auto": {"median_s": 1.06, "streamed_blocks": 0}}})
    assert [(round(r["ratio"], 3), r["met"]) for r in rows] == [(1.05, True), (1.01, True)]


def test_host_rss_builds_a_random_model_once_in_a_child(tmp_path: Path) -> None:
    # --init-random: the model the loads read is built by a process of its own (its memory
    # gone before the measured child starts), and only when the directory holds none.
    bench = load("host_rss")
    model = tmp_path / "cosmos3"
    bench.init_random(model, "cosmos3", size="tiny", device="cpu")
    index = model / "model_index.json"
    assert json.loads(index.read_text())["_class_name"] == "Cosmos3OmniPipeline"
    built = index.stat().st_mtime_ns
    bench.init_random(model, "cosmos3", size="tiny", device="cpu")
    assert index.stat().st_mtime_ns == built


def test_whole_pipeline_spills_encoders_and_records_each_host_plan(tmp_path: Path) -> None:
    bench = load("whole_pipeline")
    spill = tmp_path / "disk"
    assert bench.main(["--model", "flux", "--size", "tiny", "--out", str(tmp_path / "out"),
                       "--spill-dir", str(spill), "--configs", "dlo-resident-encoders",
                       "dlo-whole"]) == 0
    result = json.loads((tmp_path / "out" / "whole_pipeline_flux_tiny.json").read_text())
    for name, offloaded in (("dlo-resident-encoders", False), ("dlo-whole", True)):
        plan = result["configs"][name]["host_plan"]
        rows = {row["name"]: row for row in plan["components"]}
        assert set(rows) >= {"transformer", "text_encoder", "text_encoder_2", "vae"}
        assert plan["fits"] and plan["dit_backing"] == "mapped"  # a CPU reads the mapping
        assert ("pinned" in rows["text_encoder"]["held_in"]) == offloaded
        assert (rows["text_encoder"]["committed"] > 0) == offloaded
    text = (tmp_path / "out" / "whole_pipeline_flux_tiny.md").read_text()
    assert "host plan of dlo-whole: DiT mapped" in text


def test_spill_components_moves_built_files_and_links_them(tmp_path: Path) -> None:
    bench = load("whole_pipeline")
    model, spill = tmp_path / "shm" / "model", tmp_path / "disk"
    (model / "text_encoder").mkdir(parents=True)
    (model / "text_encoder" / "model.safetensors").write_bytes(b"x")
    assert bench.spill_components(model, spill, ["text_encoder", "text_encoder_2"]) == [
        "text_encoder", "text_encoder_2"]
    assert (model / "text_encoder").is_symlink()
    assert (spill / "text_encoder" / "model.safetensors").read_bytes() == b"x"
    assert (model / "text_encoder_2").resolve() == (spill / "text_encoder_2").resolve()
    assert bench.spill_components(model, spill, ["text_encoder"]) == []  # already spilled
    assert bench.encoder_components("flux2") == ["text_encoder"]
