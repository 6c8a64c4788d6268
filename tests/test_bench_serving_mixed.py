"""bench/serving.py --mixed: the workload it sends, the targets it judges, and a CPU smoke run
(one real `ditserve serve` on the tiny model, mixed sizes, true CFG and n=2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from test_bench_tools import BENCH, load  # type: ignore[import-not-found]


def test_the_mixed_workload_is_seeded_and_has_the_asked_shape() -> None:
    serving = load("serving")
    sizes = [(1024, 1024), (768, 768), (512, 512), (1344, 768)]
    plan = serving.mixed_workload(400, 4.0, sizes, (8, 20), cfg_share=0.2, n2_share=0.1, seed=3)
    assert plan == serving.mixed_workload(400, 4.0, sizes, (8, 20), cfg_share=0.2,
                                          n2_share=0.1, seed=3)
    assert {(r.width, r.height) for r in plan} == set(sizes)
    assert {r.steps for r in plan} == set(range(8, 21))
    assert 0.14 < sum(r.cfg for r in plan) / 400 < 0.26
    assert 0.05 < sum(r.n == 2 for r in plan) / 400 < 0.15
    arrivals = [r.arrival_s for r in plan]
    assert arrivals == sorted(arrivals) and 70 < arrivals[-1] < 130  # ~400 / 4 per s
    body = serving.mixed_body(next(r for r in plan if r.cfg))
    assert body["true_cfg_scale"] > 1 and body["negative_prompt"]


def test_targets_are_judged_from_the_configurations_that_ran() -> None:
    serving = load("serving")
    rows = serving.mixed_targets({"dlo:1": {"throughput_rps": 0.1},
                                  "dlo:4": {"throughput_rps": 0.25},
                                  "dlo-auto:4": {"throughput_rps": 0.268},
                                  "resident:4": {"throughput_rps": 0.27}})
    assert [(None if r is None else round(r, 3), met) for _, r, met in rows] == [
        (2.5, True), (0.926, False), (0.993, True), (None, None), (None, None), (None, None)]
    assert [met for _, _, met in serving.mixed_targets({"dlo:4": {"throughput_rps": 1}})] == [
        None] * 6
    # Issue 47: max_num_seqs 8 against 1, resident.
    judged = serving.mixed_targets({"resident:1": {"throughput_rps": 0.1},
                                    "resident:8": {"throughput_rps": 0.24}})
    (_, ratio, met) = next(row for row in judged if row[1] is not None)
    assert round(ratio, 3) == 2.4 and met is False
    # Issue 45: adapters against none, on the same placement.
    judged = serving.mixed_targets({"dlo:4": {"throughput_rps": 0.40},
                                    "dlo+lora:4": {"throughput_rps": 0.39}})
    assert [(what, round(r, 3), met) for what, r, met in judged if r is not None] == [
        ("DLO+lora@4 req/s >= 0.95x DLO@4", 0.975, True)]
    assert serving.mixed_configs("dlo-auto:4,resident:4,dlo-dit:4,dlo+lora:4") == [
        ("dlo-auto:4", "--offload dlo --dlo-hbm-budget-gib auto", 4, False),
        ("resident:4", "", 4, False),
        ("dlo-dit:4", "--offload dlo --dlo-components dit", 4, False),
        ("dlo+lora:4", "--offload dlo", 4, True)]
    shapes = serving.step_shapes(
        {"ditserve:step_shape_groups_count": 2.0, "ditserve:step_shape_groups_sum": 3.0},
        {"ditserve:step_shape_groups_count": 6.0, "ditserve:step_shape_groups_sum": 13.0,
         "ditserve:step_batch_rows_sum": 20.0, "ditserve:step_batch_tokens_sum": 40000.0})
    assert shapes == {"mean_groups": 2.5, "mean_rows": 5.0, "mean_tokens": 10000.0,
                      "encoder_passes": 0.0, "prompts_ahead": 0.0}


def test_cpu_smoke_run_of_the_mixed_mode(tmp_path: Path) -> None:
    out = tmp_path / "mixed.json"
    cmd = [sys.executable, str(BENCH / "serving.py"), "--mixed", "--tiny",
           "--mixed-configs", "dlo:3", "--requests", "6", "--rate", "0", "--cfg-share", "0.5",
           "--n2-share", "0.3", "--seed", "1", "--startup-timeout", "300",
           "--server-cmd", f"{sys.executable} -m ditserve.engine.cli", "--out", str(out)]
    env_home = {"DITSERVE_HOME": str(tmp_path / "home")}
    import os

    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env_home})
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    [result] = report["results"]
    summary = result["summary"]
    assert result["label"] == "dlo:3" and summary["ok"] == summary["requests"] == 6
    # Requests of three sizes arrived at once: steps held several shape groups.
    assert summary["mean_groups"] > 1 and summary["mean_rows"] >= summary["mean_batch_size"]
    assert summary["mean_tokens"] > 0
    assert "DLO@4 req/s >= 2.3x DLO@1" in done.stdout
    sizes = {(r["width"], r["height"]) for r in report["workload"]}
    assert len(sizes) > 1


def test_cpu_smoke_run_with_adapters(tmp_path: Path) -> None:
    """Issue 45's adapter workload: random adapters made for the served model, each request
    naming one in turn; the server serves them all (an unknown name would be a 404)."""
    import os

    out = tmp_path / "lora.json"
    cmd = [sys.executable, str(BENCH / "serving.py"), "--mixed", "--tiny",
           "--mixed-configs", "dlo+lora:2", "--requests", "6", "--rate", "0", "--seed", "2",
           "--adapter-ranks", "4,8,16", "--startup-timeout", "300",
           "--server-cmd", f"{sys.executable} -m ditserve.engine.cli", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DITSERVE_HOME": str(tmp_path / "home")})
    assert done.returncode == 0, done.stdout + done.stderr
    [result] = json.loads(out.read_text())["results"]
    assert result["label"] == "dlo+lora:2" and result["summary"]["ok"] == 6
    assert result["adapters"] == [f"bench-lora{i % 3}" for i in range(6)]
    assert result["summary"]["encoder_passes"] >= 1  # unique prompts: the encoders ran
    log = next(tmp_path.glob("lora-dlo-lora-2*.log")).read_text()
    assert "3 LoRA adapters resident at start" in log
    assert "DLO+lora@4 req/s >= 0.95x DLO@4" in done.stdout
