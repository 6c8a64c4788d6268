"""ditserve's output matches diffusers' own FluxPipeline for the same model, inputs and seed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]
from PIL import Image

from ditserve.engine.cli.main import main as ditserve_main
from ditserve.engine.request import SamplingParams

TOLERANCE = 1e-3  # fp32, pixels in [0, 1]


@pytest.fixture(scope="module")
def diffusers_pipe(tiny_model_dir):  # type: ignore[no-untyped-def]
    from diffusers import FluxPipeline

    return FluxPipeline.from_pretrained(tiny_model_dir)


def reference(pipe, params: SamplingParams) -> torch.Tensor:  # type: ignore[no-untyped-def]
    kwargs = {}
    if params.negative_prompt:
        kwargs = {"negative_prompt": params.negative_prompt, "true_cfg_scale": params.true_cfg_scale}
    out = pipe(
        params.prompt, height=params.height, width=params.width,
        num_inference_steps=params.num_inference_steps, guidance_scale=params.guidance_scale,
        num_images_per_prompt=params.num_images,
        generator=torch.Generator("cpu").manual_seed(params.seed),
        output_type="pt", **kwargs,
    )
    return out.images.float()


CASES = {
    "plain": SamplingParams(prompt="a red cat", num_inference_steps=4, seed=7, guidance_scale=3.5),
    "true-cfg": SamplingParams(prompt="a red cat", negative_prompt="a blue dog",
                               true_cfg_scale=4.0, num_inference_steps=3, seed=8),
    "two-images-wide": SamplingParams(prompt="mountains", height=32, width=64, num_images=2,
                                      num_inference_steps=2, seed=9, guidance_scale=1.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_diffusers(tiny_runner, diffusers_pipe, case: str) -> None:  # type: ignore[no-untyped-def]
    params = CASES[case]
    ours, _ = drive(tiny_runner, {0: [(f"ref-{case}", params)]}, max_num_seqs=1)
    expected = reference(diffusers_pipe, params)
    got = ours[f"ref-{case}"]
    assert got.shape == expected.shape
    diff = (got - expected).abs().max().item()
    assert diff <= TOLERANCE, f"max abs diff {diff}"


def test_generate_cli_png_matches_diffusers(tiny_model_dir, diffusers_pipe, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "cat.png"
    code = ditserve_main([
        "generate", "--model", str(tiny_model_dir), "--device", "cpu", "--prompt", "a red cat",
        "--steps", "4", "--seed", "7", "--guidance-scale", "3.5", "--out", str(out),
    ])
    assert code == 0
    ours = np.asarray(Image.open(out).convert("RGB")).astype(np.int16)
    expected = reference(diffusers_pipe, CASES["plain"])[0]
    theirs = (expected.permute(1, 2, 0).numpy() * 255).round().astype(np.int16)
    # Both sides round the same float image to uint8; allow one level where floats straddle .5.
    assert ours.shape == theirs.shape == (64, 64, 3)
    assert int(np.abs(ours - theirs).max()) <= 1
