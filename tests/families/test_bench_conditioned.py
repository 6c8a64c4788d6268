"""bench/offload_conditioned.py's CPU smoke mode: the image-conditioned DiTs (Qwen-Image-Edit's
doubled image tokens, Wan I2V's 36 channels and CLIP context) run resident and under DLO on
tiny DiTs, and the report carries the issue's step-time target. Timings are not asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_bench_tools import load  # type: ignore[import-not-found]


@pytest.mark.parametrize("model", ["qwen-image-edit", "wan-i2v"])
def test_tiny_run_reports_the_step_time_target(model: str, tmp_path: Path) -> None:
    bench = load("offload_conditioned")
    assert bench.main(["--tiny", "--model", model, "--out", str(tmp_path), "--warmup", "0",
                       "--iters", "1", "--methods", "resident", "dlo"]) == 0
    result = json.loads((tmp_path / "offload_families.json").read_text())
    assert {(c["method"], c["cell"]) for c in result["cells"]} == {
        (m, c) for m in ("resident", "dlo") for c in ("b1",) + (("b4",) if "qwen" in model
                                                               else ())}
    report = result["methods"]["dlo"]["report"]
    assert report["streamed_blocks"] == 2 and report["slots"] == 2
    step_targets = [t for t in result["targets"] if "PCIe floor" in t["target"]]
    assert len(step_targets) == (2 if "qwen" in model else 1)
    assert all(t["bound"] > 0 for t in step_targets)
