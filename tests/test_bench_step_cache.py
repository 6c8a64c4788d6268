"""The step-cache bench programs in their CPU modes: bench/quality.py --step-cache reports the
skipped fraction and the difference to no cache per setting; bench/step_cache.py --tiny runs
every mode and reports its targets without judging them."""

from __future__ import annotations

import json
from pathlib import Path

from test_bench_tools import load  # type: ignore[import-not-found]


def test_quality_step_cache_tiny_reports_skips_and_differences(tmp_path: Path) -> None:
    out = tmp_path / "quality.json"
    quality = load("quality")
    assert quality.main(["--step-cache", "--tiny", "--out", str(out), "--policies",
                         "first-block:0", "every:2,4", "teacache:0.6"]) == 0
    result = json.loads(out.read_text())
    assert result["family"] == "flux" and result["weights"] == "random"
    rows = {(r["policy"], r["value"]): r for r in result["settings"]}
    exact = rows[("first-block", 0.0)]
    assert exact["skipped_fraction"] == 0 and exact["mean_abs_pixel_diff"] == 0
    assert exact["psnr_db"] is None  # identical: infinite PSNR
    # 8 steps, first and last 2 computed: every 2 reuses steps 3 and 5, every 4 steps 3-5.
    assert rows[("every", 2.0)]["skipped_fraction"] == 2 / 8
    assert rows[("every", 4.0)]["skipped_fraction"] == 3 / 8
    for key in (("every", 2.0), ("every", 4.0), ("teacache", 0.6)):
        assert rows[key]["mean_abs_pixel_diff"] > 0 and rows[key]["psnr_db"] > 20, key


def test_step_cache_speed_bench_tiny_runs_every_mode(tmp_path: Path) -> None:
    bench = load("step_cache")
    assert bench.main(["--tiny", "--settings", "every:2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "step_cache.json").read_text())
    dlo, resident = result["modes"]["dlo"], result["modes"]["resident"]
    assert (dlo["batch"], resident["batch"]) == (1, 4)
    assert dlo["settings"]["every:2"]["skipped_fraction"] == 2 / 8
    assert dlo["settings"]["every:2"]["skipped_bytes"] > 0  # DLO copied fewer bytes
    assert resident["settings"]["every:2"]["skipped_bytes"] == 0
    assert dlo["threshold0_identical"] and resident["threshold0_identical"]
    assert "mixed" in resident
    assert {t["target"] for t in result["targets"]} >= {
        "dlo b1 latency at >= 40% skipped", "resident b4: mixed step costs <= uncached"}
