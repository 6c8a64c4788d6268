"""The format benchmarks' CPU smoke modes and the image metrics they report."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_codec_smoke_reports_exact_round_trips(tmp_path: Path) -> None:
    codec = load("codec")
    out = tmp_path / "codec.json"
    assert codec.main(["--smoke", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert {r["block"] for r in rows} == {"random-init/double", "random-init/single",
                                          "synthetic-trained/double", "synthetic-trained/single"}
    for row in rows:
        assert row["exact"] is True
        assert 0.75 <= row["ratio"] < 0.85  # small blocks: stripe padding shows
        assert row["encode_mb_s"] > 0 and row["escapes_per_value"] < 0.01


def test_quality_tiny_compares_fp8_with_bf16(tiny_model_dir: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    quality = load("quality")
    out = tmp_path / "quality.json"
    assert quality.main(["--tiny", "--model", str(tiny_model_dir), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Random weights are not trained weights" in printed
    result = json.loads(out.read_text())
    assert result["family"] == "flux" and result["weights"] == "random"
    assert result["quantized"]["layers"] == 46
    (case,) = result["cases"]
    assert len(case["step_rel_l2"]) == 2  # one transformer call per step
    assert all(0 < e < 0.05 for e in case["step_rel_l2"])
    assert case["psnr_db"] > 20 and 0.9 < case["ssim"] <= 1


def test_image_metrics() -> None:
    quality = load("quality")
    a = torch.rand(1, 3, 24, 24, generator=torch.Generator().manual_seed(0))
    assert quality.psnr(a, a) == math.inf and quality.ssim(a, a) == pytest.approx(1.0)
    # Constant images: SSIM reduces to its luminance term (2xy + C1) / (x^2 + y^2 + C1).
    x, y, c1 = 0.3, 0.6, 0.01**2
    got = quality.ssim(torch.full((1, 1, 16, 16), x), torch.full((1, 1, 16, 16), y))
    assert got == pytest.approx((2 * x * y + c1) / (x * x + y * y + c1))
    assert quality.psnr(torch.zeros(1, 1, 4, 4), torch.full((1, 1, 4, 4), 0.1)) == (
        pytest.approx(20.0))
    noisy = (a + 0.1 * torch.randn(a.shape, generator=torch.Generator().manual_seed(1))).clamp(0, 1)
    assert quality.ssim(noisy, a) < quality.ssim((a + noisy) / 2, a) < 1
