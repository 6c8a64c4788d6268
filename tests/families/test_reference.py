"""ditserve's output equals diffusers' own QwenImagePipeline / WanPipeline for the same model,
prompt, size, frames, steps, guidance, negative prompt and seed (images and every frame)."""

from __future__ import annotations

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.request import SamplingParams

TOLERANCE = 1e-3  # fp32, pixels in [0, 1] (as the Flux reference test)

CASES: dict[str, tuple[str, SamplingParams]] = {
    "qwen-plain": ("qwen-image", SamplingParams(
        prompt="a red cat", num_inference_steps=4, seed=7, height=32, width=64)),
    "qwen-true-cfg-two": ("qwen-image", SamplingParams(
        prompt="a red cat on a mat", negative_prompt="blurry", true_cfg_scale=4.0,
        num_inference_steps=3, seed=8, height=64, width=32, num_images=2)),
    "wan-plain": ("wan", SamplingParams(
        prompt="a red cat", num_inference_steps=4, seed=7, guidance_scale=1.0,
        height=32, width=64, num_frames=5)),
    "wan-cfg-empty-negative": ("wan", SamplingParams(
        prompt="waves", num_inference_steps=3, seed=9, guidance_scale=5.0, height=32,
        width=32, num_frames=9)),
    "wan2.2-cfg-both-experts": ("wan2.2", SamplingParams(
        prompt="a red cat", negative_prompt="a blue dog", num_inference_steps=4, seed=8,
        guidance_scale=4.0, height=32, width=32, num_frames=5, num_images=2)),
    "wan2.2-ti2v": ("wan2.2-ti2v", SamplingParams(
        prompt="a red cat", negative_prompt="fog", num_inference_steps=3, seed=5,
        guidance_scale=3.0, height=64, width=64, num_frames=5)),
}


def reference(model_dir, p: SamplingParams) -> torch.Tensor:  # type: ignore[no-untyped-def]
    import diffusers

    index = (model_dir / "model_index.json").read_text()
    cls = diffusers.QwenImagePipeline if "QwenImagePipeline" in index else diffusers.WanPipeline
    pipe = cls.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator("cpu").manual_seed(p.seed)
    if cls is diffusers.WanPipeline:
        return pipe(p.prompt, negative_prompt=p.negative_prompt, height=p.height,
                    width=p.width, num_frames=p.num_frames,
                    num_inference_steps=p.num_inference_steps, guidance_scale=p.guidance_scale,
                    num_videos_per_prompt=p.num_images, generator=generator,
                    output_type="pt").frames.float()
    kwargs = {"negative_prompt": p.negative_prompt, "true_cfg_scale": p.true_cfg_scale} \
        if p.negative_prompt else {}
    return pipe(p.prompt, height=p.height, width=p.width,
                num_inference_steps=p.num_inference_steps, num_images_per_prompt=p.num_images,
                generator=generator, output_type="pt", **kwargs).images.float()


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_diffusers(family_dir, family_runner, case: str) -> None:  # type: ignore[no-untyped-def]
    variant, params = CASES[case]
    ours, _ = drive(family_runner(variant), {0: [(case, params)]}, max_num_seqs=1)
    expected = reference(family_dir(variant), params)
    got = ours[case]
    assert got.shape == expected.shape
    if params.num_frames > 1:  # videos: (n, frames, 3, H, W), every frame compared
        assert got.shape[:2] == (params.num_images, params.num_frames)
    diff = (got - expected).abs().max().item()
    assert diff <= TOLERANCE, f"max abs diff {diff}"
    assert got.std().item() > 1e-3  # not a constant image: the comparison means something


def test_wan22_case_runs_both_experts(family_runner) -> None:  # type: ignore[no-untyped-def]
    # The scenario above must cross the boundary: its 4 steps start above 875 and end below.
    from ditserve.engine.step.sampler import SchedulerTrajectory

    pipeline = family_runner("wan2.2").pipeline
    steps = CASES["wan2.2-cfg-both-experts"][1].num_inference_steps
    timesteps = SchedulerTrajectory(type(pipeline.scheduler), pipeline.scheduler.config,
                                    steps).timesteps
    assert pipeline.boundary == 875.0
    assert timesteps[0] >= pipeline.boundary > timesteps[-1]
