"""Image-conditioned families (edits, image-to-video): ditserve's output equals diffusers' own
pipeline on the same image, prompt, size, frames, steps, guidance and seed (every pixel of
every frame, within 1e-3), resident and with DLO; requests with different images admitted
together (one batched conditioning encode, shared forwards) each equal their solo runs; and
a model judges how many input images it takes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]
from PIL import Image

from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig
from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.request import ConditionImage, SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner

TOLERANCE = 1e-3  # fp32, pixels in [0, 1]


def picture(width: int, height: int, seed: int) -> ConditionImage:
    """A smooth random picture (what a VAE sees in practice, unlike white noise)."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (max(2, height // 8), max(2, width // 8), 3), dtype=np.uint8)
    image = Image.fromarray(coarse).resize((width, height), Image.BILINEAR)
    return ConditionImage(width, height, image.tobytes())


def as_pil(image: ConditionImage) -> Any:
    return Image.frombytes("RGB", (image.width, image.height), image.rgb)


def kontext_reference(model_dir: Path, p: SamplingParams) -> torch.Tensor:
    import diffusers

    pipe = diffusers.FluxKontextPipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    kwargs: dict[str, Any] = {}
    if p.negative_prompt:
        kwargs = {"negative_prompt": p.negative_prompt, "true_cfg_scale": p.true_cfg_scale}
    # max_area = the asked size: diffusers would otherwise rescale the output to 1 MP.
    return pipe(image=as_pil(p.images[0]) if p.images else None, prompt=p.prompt,
                height=p.height, width=p.width, max_area=p.height * p.width,
                num_inference_steps=p.num_inference_steps, guidance_scale=p.guidance_scale,
                num_images_per_prompt=p.num_images,
                generator=torch.Generator("cpu").manual_seed(p.seed or 0), output_type="pt",
                **kwargs).images.float()


def wan_i2v_reference(model_dir: Path, p: SamplingParams) -> torch.Tensor:
    import diffusers
    from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v

    pipe = diffusers.WanImageToVideoPipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    # diffusers' I2V prompt cleaning calls ftfy unconditionally (its T2V one only when
    # installed, as ditserve does); without ftfy the two clean prompts identically.
    clean = pipeline_wan_i2v.prompt_clean
    pipeline_wan_i2v.prompt_clean = pipeline_wan.prompt_clean
    try:
        return pipe(image=as_pil(p.images[0]), prompt=p.prompt,
                    negative_prompt=p.negative_prompt, height=p.height, width=p.width,
                    num_frames=p.num_frames, num_inference_steps=p.num_inference_steps,
                    guidance_scale=p.guidance_scale, num_videos_per_prompt=p.num_images,
                    generator=torch.Generator("cpu").manual_seed(p.seed or 0),
                    output_type="pt").frames.float()
    finally:
        pipeline_wan_i2v.prompt_clean = clean


CASES: dict[str, tuple[str, SamplingParams]] = {
    "kontext-edit": ("flux-kontext", SamplingParams(
        prompt="make it red", height=64, width=96, num_inference_steps=3, seed=5,
        guidance_scale=2.5, images=(picture(140, 100, 1),))),
    "kontext-true-cfg-two": ("flux-kontext", SamplingParams(
        prompt="a cat in the picture", negative_prompt="blurry", true_cfg_scale=3.0,
        height=64, width=64, num_inference_steps=2, seed=6, num_images=2,
        images=(picture(90, 160, 2),))),
    "kontext-text-only": ("flux-kontext", SamplingParams(
        prompt="a lighthouse", height=64, width=64, num_inference_steps=2, seed=7)),
    "wan-i2v-cfg": ("wan-i2v", SamplingParams(
        prompt="a cat walks", negative_prompt="fog", height=32, width=64, num_frames=5,
        num_inference_steps=3, seed=5, guidance_scale=3.0, images=(picture(70, 50, 3),))),
    # One video: diffusers' I2V repeats the CLIP context per prompt, not per video, and
    # fails for num_videos_per_prompt > 1 with an image encoder (ditserve does not).
    "wan-i2v-no-cfg": ("wan-i2v", SamplingParams(
        prompt="waves", height=32, width=32, num_frames=9, num_inference_steps=2, seed=6,
        guidance_scale=1.0, images=(picture(40, 60, 4),))),
    "wan2.2-ti2v-i2v-two": ("wan2.2-ti2v-i2v", SamplingParams(
        prompt="a red cat", negative_prompt="fog", height=64, width=64, num_frames=5,
        num_inference_steps=3, seed=5, guidance_scale=3.0, num_images=2,
        images=(picture(64, 48, 5),))),
}
REFERENCES: dict[str, Callable[[Path, SamplingParams], torch.Tensor]] = {
    "flux-kontext": kontext_reference,
    "wan-i2v": wan_i2v_reference,
    "wan2.2-ti2v-i2v": wan_i2v_reference,
}


@pytest.fixture(scope="module")
def expected(family_dir) -> Callable[[str], torch.Tensor]:  # type: ignore[no-untyped-def]
    cache: dict[str, torch.Tensor] = {}

    def get(case: str) -> torch.Tensor:
        if case not in cache:
            variant, params = CASES[case]
            cache[case] = REFERENCES[variant](family_dir(variant), params)
        return cache[case]

    return get


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    diff = (got - want).abs().max().item()
    assert diff <= TOLERANCE, f"max abs diff {diff}"
    assert got.std().item() > 1e-3  # not a constant image: the comparison means something


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_diffusers(family_runner, expected, case: str) -> None:  # type: ignore[no-untyped-def]
    variant, params = CASES[case]
    ours, _ = drive(family_runner(variant), {0: [(case, params)]}, max_num_seqs=1)
    assert_close(ours[case], expected(case))


@pytest.mark.parametrize("variant", ["flux-kontext", "wan-i2v", "wan2.2-ti2v-i2v"])
def test_dlo_matches_diffusers(family_dir, expected, variant: str) -> None:  # type: ignore[no-untyped-def]
    model = family_dir(variant)
    runner = ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cpu",
                                                      offload=OffloadConfig(enabled=True))),
                         model_dir=model)
    try:
        assert runner.offload_report() is not None
        cases = {c: p for c, (v, p) in CASES.items() if v == variant}
        ours, _ = drive(runner, {0: list(cases.items())}, max_num_seqs=len(cases))
    finally:
        runner.close()
    for case in cases:
        assert_close(ours[case], expected(case))


SHAPES = {"flux-kontext": {}, "wan-i2v": {"num_frames": 5, "guidance_scale": 2.0},
          "wan2.2-ti2v-i2v": {"num_frames": 5, "guidance_scale": 1.0}}


@pytest.mark.parametrize("variant", sorted(SHAPES))
def test_requests_with_different_images_equal_their_solo_runs(family_runner, variant) -> None:  # type: ignore[no-untyped-def]
    runner = family_runner(variant)
    # Same source size (one shape group, one batched encode), different pictures and prompts.
    shape: dict[str, Any] = SHAPES[variant]
    a = SamplingParams(prompt="make it red", height=64, width=64, num_inference_steps=3,
                       seed=3, images=(picture(120, 120, 10),), **shape)
    b = SamplingParams(prompt="make it blue", height=64, width=64, num_inference_steps=2,
                       seed=4, images=(picture(120, 120, 11),), **shape)
    together, sizes = drive(runner, {0: [("a", a), ("b", b)]}, max_num_seqs=2)
    assert max(sizes) == 2  # they shared forwards
    for rid, params in (("a", a), ("b", b)):
        alone, _ = drive(runner, {0: [(rid, params)]}, max_num_seqs=1)
        assert torch.allclose(together[rid], alone[rid], atol=1e-5), rid
    assert (together["a"] - together["b"]).abs().max().item() > 1e-2  # the images mattered


def test_text_only_families_refuse_images_and_edit_families_bound_them(family_runner) -> None:  # type: ignore[no-untyped-def]
    image = picture(64, 64, 0)
    flux = family_runner("flux-kontext").pipeline
    assert flux.condition_images == (0, 1)
    with pytest.raises(InvalidRequestError, match="at most 1 input image"):
        SamplingParams(prompt="x", images=(image, image)).validate(
            pixel_multiple=32, condition_images=flux.condition_images)
    with pytest.raises(InvalidRequestError, match="from text only"):
        SamplingParams(prompt="x", images=(image,)).validate()
    wan = family_runner("wan-i2v").pipeline
    assert wan.condition_images == (1, 1)
    with pytest.raises(InvalidRequestError, match="needs 1 input image"):
        SamplingParams(prompt="x", num_frames=5).validate(
            pixel_multiple=16, frame_step=4, condition_images=wan.condition_images)


def test_requests_admitted_together_share_one_clip_and_one_vae_forward(family_runner, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    runner = family_runner("wan-i2v")
    batches: dict[str, list[int]] = {"clip": [], "vae": []}
    vae = runner.pipeline.vae
    encode = vae.encode

    def counted_encode(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        batches["vae"].append(x.shape[0])
        return encode(x, *args, **kwargs)

    def clip_hook(module: Any, inputs: Any, kwargs: Any, output: Any) -> None:
        batches["clip"].append(kwargs["pixel_values"].shape[0])

    monkeypatch.setattr(vae, "encode", counted_encode)
    hook = runner.pipeline.image_encoder.register_forward_hook(clip_hook, with_kwargs=True)
    try:
        arrivals = [(rid, SamplingParams(prompt=f"scene {rid}", height=32, width=32,
                                         num_frames=5, num_inference_steps=1, seed=seed,
                                         guidance_scale=1.0, images=(picture(48, 40, seed),)))
                    for rid, seed in (("a", 1), ("b", 2), ("c", 3))]
        drive(runner, {0: arrivals}, max_num_seqs=3)
    finally:
        hook.remove()
    assert batches == {"clip": [3], "vae": [3]}  # one forward each, three requests' images


@pytest.mark.parametrize("size", [(1, 1), (31, 31), (64, 8), (4000, 8)])
def test_kontext_edits_sources_of_any_size(family_runner, size: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    """Issue 45: sources under 16 pixels on a side divided by zero (500); they take their
    own aspect ratio's preferred resolution."""
    runner = family_runner("flux-kontext")
    width, height = size
    params = SamplingParams(prompt="make it red", height=32, width=32, num_inference_steps=1,
                            seed=1, images=(picture(width, height, 2),))
    params.validate_for(runner.limits)
    out, _ = drive(runner, {0: [("a", params)]}, max_num_seqs=1)
    assert out["a"].shape[-2:] == (32, 32) and torch.isfinite(out["a"]).all()


@pytest.mark.parametrize("variant", ["flux", "flux-kontext"])
def test_the_advertised_max_side_has_a_schedule(family_runner, variant: str) -> None:  # type: ignore[no-untyped-def]
    """Issue 45: 8192x8192 on the tiny Flux (4M tokens) overflowed the schedule's time shift
    (a 500): the advertised side is now the largest whose shift is finite."""
    runner = family_runner(variant)
    pipeline, limits = runner.pipeline, runner.limits
    tokens = (limits.max_side // limits.pixel_multiple) ** 2
    schedule = pipeline.sampler.schedule(2, tokens)
    assert torch.isfinite(schedule.sigmas).all()
    past = limits.max_side + limits.pixel_multiple
    with pytest.raises(InvalidRequestError, match="must be between"):
        SamplingParams(prompt="x", height=past, width=past).validate_for(limits)
