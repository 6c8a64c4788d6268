"""Every family serves in bfloat16: the dtype the DiT computes in is its own, not that of
whichever parameter comes first (Wan keeps its norms, time embedder and scale-shift tables in
float32, and a bf16 Wan once fed float32 latents to its bf16 patch embedding)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, RunnerConfig
from ditserve.engine.request import SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner


@pytest.mark.parametrize("variant", ["wan", "wan2.2", "qwen-image", "z-image", "flux2", "flux2-klein"])
def test_a_bf16_runner_generates(family_dir: Callable[[str], Path], variant: str) -> None:
    model = family_dir(variant)
    config = RunnerConfig.of(EngineConfig(model=str(model), device="cpu", dtype="bfloat16"))
    runner = ModelRunner(config, model_dir=model)
    frames = 5 if variant.startswith("wan") else 1
    params = SamplingParams(prompt="a red fox", height=32, width=32, num_frames=frames,
                            num_inference_steps=2, guidance_scale=4.0,
                            negative_prompt="blurry", seed=1)
    results, _ = drive(runner, {0: [("r", params)]}, max_num_seqs=1)
    pixels = results["r"]
    assert torch.isfinite(pixels).all()
    assert pixels.shape[-2:] == (32, 32) and pixels.min() >= 0 and pixels.max() <= 1
