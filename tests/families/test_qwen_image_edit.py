"""Qwen-Image-Edit and Qwen-Image-Edit Plus: ditserve's output equals diffusers' own pipelines
(``QwenImageEditPipeline``, ``QwenImageEditPlusPipeline``) on the same images, prompt, size,
steps, true CFG and seed within 1e-3 on [0, 1] pixels, resident and with DLO; two requests
with different images admitted together each equal their solo runs; the models say how many
images they take.

diffusers' pipelines get the processor the tiny model's ``processor`` folder describes
(transformers cannot build ``Qwen2VLProcessor`` itself without torchvision; the builder's
``vl_processor`` assembles the same class of the folder's tokenizer and image processor)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]
from families.test_image_conditioned import as_pil, assert_close, picture  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig, SchedulerConfig
from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.families import family_named
from ditserve.engine.request import SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner

PLUS = "qwen-image-edit-plus"


def edit_reference(model_dir: Path, variant: str, p: SamplingParams) -> torch.Tensor:
    import diffusers
    from transformers import Qwen2Tokenizer, Qwen2VLImageProcessorPil

    from ditserve.engine.families.qwen_image_edit.builders import vl_processor

    folder = model_dir / "processor"
    processor = vl_processor(Qwen2Tokenizer.from_pretrained(folder),
                             Qwen2VLImageProcessorPil.from_pretrained(folder))
    family = family_named(variant)
    assert family is not None
    pipe = getattr(diffusers, family.pipeline_class).from_pretrained(model_dir,
                                                                     processor=processor)
    pipe.set_progress_bar_config(disable=True)
    images = [as_pil(i) for i in p.images]
    kwargs: dict[str, Any] = {}
    if p.negative_prompt is not None:
        kwargs = {"negative_prompt": p.negative_prompt}
    return pipe(image=images if variant == PLUS else images[0], prompt=p.prompt,
                true_cfg_scale=p.true_cfg_scale, height=p.height, width=p.width,
                num_inference_steps=p.num_inference_steps, num_images_per_prompt=p.num_images,
                generator=torch.Generator("cpu").manual_seed(p.seed or 0), output_type="pt",
                **kwargs).images.float()


CASES: dict[str, tuple[str, SamplingParams]] = {
    # A landscape source for a portrait output: the source keeps its own aspect ratio.
    "edit-true-cfg": ("qwen-image-edit", SamplingParams(
        prompt="make it red", negative_prompt="blurry", true_cfg_scale=4.0, height=96,
        width=64, num_inference_steps=3, seed=5, images=(picture(140, 100, 1),))),
    "edit-two-outputs": ("qwen-image-edit", SamplingParams(
        prompt="add a hat", height=64, width=64, num_inference_steps=2, seed=6,
        num_images=2, images=(picture(90, 160, 2),))),
    "plus-two-images": (PLUS, SamplingParams(
        prompt="the cat of picture 1 on the sofa of picture 2", negative_prompt=" ",
        true_cfg_scale=3.0, height=64, width=96, num_inference_steps=2, seed=7,
        images=(picture(120, 80, 3), picture(64, 96, 4)))),
}


@pytest.fixture(scope="module")
def expected(family_dir) -> Callable[[str], torch.Tensor]:  # type: ignore[no-untyped-def]
    cache: dict[str, torch.Tensor] = {}

    def get(case: str) -> torch.Tensor:
        if case not in cache:
            variant, params = CASES[case]
            cache[case] = edit_reference(family_dir(variant), variant, params)
        return cache[case]

    return get


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_diffusers(family_runner, expected, case: str) -> None:  # type: ignore[no-untyped-def]
    variant, params = CASES[case]
    ours, _ = drive(family_runner(variant), {0: [(case, params)]}, max_num_seqs=1)
    assert_close(ours[case], expected(case))


@pytest.mark.parametrize("variant", ["qwen-image-edit", PLUS])
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


@pytest.mark.parametrize("variant", ["qwen-image-edit", PLUS])
def test_requests_with_different_images_equal_their_solo_runs(family_runner, variant) -> None:  # type: ignore[no-untyped-def]
    runner = family_runner(variant)
    # Same source size (one shape group, one batched VAE encode), different pictures, prompts
    # (so different text lengths: masked rows) and step counts.
    a = SamplingParams(prompt="make it red", negative_prompt="dull", true_cfg_scale=2.0,
                       height=64, width=64, num_inference_steps=3, seed=3,
                       images=(picture(120, 120, 10),))
    b = SamplingParams(prompt="make the sky a deep blue", height=64, width=64,
                       num_inference_steps=2, seed=4, images=(picture(120, 120, 11),))
    # Each row carries its source's ~1 MP of tokens (the work rule counts them, a's CFG
    # rows twice): the step's budget is both requests' work.
    work = sum(runner.work_rule.of(p).tokens for p in (a, b))
    both = SchedulerConfig(max_num_seqs=2, max_batch_tokens=work)
    together, sizes = drive(runner, {0: [("a", a), ("b", b)]}, max_num_seqs=2, config=both)
    assert max(sizes) == 2  # they shared forwards (a with its CFG rows, b without)
    for rid, params in (("a", a), ("b", b)):
        alone, _ = drive(runner, {0: [(rid, params)]}, max_num_seqs=1)
        assert torch.allclose(together[rid], alone[rid], atol=1e-5), rid
    assert (together["a"] - together["b"]).abs().max().item() > 1e-2  # the images mattered


def test_how_many_images_each_model_takes(family_runner) -> None:  # type: ignore[no-untyped-def]
    image = picture(64, 64, 0)
    edit = family_runner("qwen-image-edit").pipeline
    assert edit.condition_images == (1, 1)
    with pytest.raises(InvalidRequestError, match="needs 1 input image"):
        SamplingParams(prompt="x").validate(pixel_multiple=16,
                                            condition_images=edit.condition_images)
    with pytest.raises(InvalidRequestError, match="at most 1 input image"):
        SamplingParams(prompt="x", images=(image, image)).validate(
            pixel_multiple=16, condition_images=edit.condition_images)
    plus = family_runner(PLUS).pipeline
    assert plus.condition_images == (1, 3)
    SamplingParams(prompt="x", images=(image,) * 3).validate(
        pixel_multiple=16, condition_images=plus.condition_images)
    with pytest.raises(InvalidRequestError, match="at most 3 input images"):
        SamplingParams(prompt="x", images=(image,) * 4).validate(
            pixel_multiple=16, condition_images=plus.condition_images)


@pytest.mark.parametrize("variant", ["qwen-image-edit", "flux-kontext"])
def test_the_step_cache_serves_edits(family_runner, variant: str) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.config.step_cache import StepCacheSpec

    runner = family_runner(variant)
    base: dict[str, Any] = dict(prompt="make it red", height=32, width=32, seed=1,
                                num_inference_steps=8, images=(picture(64, 64, 1),))
    plain, _ = drive(runner, {0: [("plain", SamplingParams(**base))]}, max_num_seqs=1)
    off, _ = drive(runner, {0: [("off", SamplingParams(
        **base, step_cache=StepCacheSpec("first-block", threshold=0.0)))]}, max_num_seqs=1)
    assert torch.equal(off["off"], plain["plain"])
    # 8 steps, every 2nd of steps 2..5 reused: a real skip, not another image.
    every, _ = drive(runner, {0: [("every", SamplingParams(
        **base, step_cache=StepCacheSpec("every", every=2)))]}, max_num_seqs=1)
    assert 0 < (every["every"] - plain["plain"]).abs().max().item() < 0.5


@pytest.mark.parametrize("variant", ["qwen-image-edit", PLUS])
def test_sources_beyond_the_vision_readers_aspect_are_a_400(family_runner, variant) -> None:  # type: ignore[no-untyped-def]
    """Issue 45: a 2000x4 source reached Qwen2.5-VL's processor, which raised (a 500)."""
    runner = family_runner(variant)
    wide = SamplingParams(prompt="x", height=32, width=32, images=(picture(2000, 4, 0),))
    with pytest.raises(InvalidRequestError, match="aspect ratio of 500:1") as refused:
        wide.validate_for(runner.limits)
    assert refused.value.field == "image"
    ok = SamplingParams(prompt="x", height=32, width=32, num_inference_steps=1, seed=1,
                        images=(picture(1500, 10, 0),))  # 150:1, the most it reads
    ok.validate_for(runner.limits)
    out, _ = drive(runner, {0: [("a", ok)]}, max_num_seqs=1)
    assert torch.isfinite(out["a"]).all()
