"""The work rule counts the tokens a request's conditioning adds to the DiT's sequence (an
edit's source image, FLUX.2's references, MiniMax-H3's keyframes), as each pipeline builds
them: admission, the per-request bound and the HBM planner all see them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from PIL import Image

from ditserve.engine.config import (
    EngineConfig,
    PipelineConfig,
    ResolvedOffload,
    SchedulerConfig,
)
from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.loop.engine import DiffusionEngine
from ditserve.engine.placement.memory_estimates import budget_inputs, planned_step_tokens
from ditserve.engine.request import ConditionImage, SamplingParams
from ditserve.engine.runner.group_forwards import GroupForwards
from ditserve.engine.sched.scheduler import StepScheduler
from ditserve.engine.sched.work import ResolvedScheduling
from ditserve.engine.step.denoise_state import DenoiseState


def picture(width: int, height: int, seed: int = 0) -> ConditionImage:
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (max(2, height // 8), max(2, width // 8), 3), dtype=np.uint8)
    image = Image.fromarray(coarse).resize((width, height), Image.BILINEAR)
    return ConditionImage(width, height, image.tobytes())


def test_a_kontext_edit_counts_its_source_beside_its_target(family_runner: Any) -> None:
    rule = family_runner("flux-kontext").work_rule
    text_to_image = SamplingParams(prompt="p", height=1024, width=1024)
    edit = SamplingParams(prompt="p", height=1024, width=1024, images=(picture(1024, 1024),))
    # 1024x1024 is a preferred Kontext resolution: the source is as many tokens again.
    assert rule.of(edit).tokens == 2 * rule.of(text_to_image).tokens > 0
    assert rule.generated_tokens_per_row(edit) == rule.of(text_to_image).tokens


def test_flux2_counts_every_reference(family_runner: Any) -> None:
    pipeline = family_runner("flux2").pipeline
    side = pipeline.pixel_multiple  # the tiny VAE's: 32 px tokens (16 released)
    two = SamplingParams(prompt="p", height=512, width=512,
                         images=(picture(2048, 1024, 1), picture(200, 120, 2)))
    # A reference above 1 MP is scaled down to it (2048x1024 -> 1448x724), one below it
    # only cropped to whole tokens.
    want = (512 // side) ** 2 + (1448 // side) * (724 // side) + (200 // side) * (120 // side)
    assert family_runner("flux2").work_rule.of(two).tokens == want
    assert pipeline.most_condition_tokens == 10 * (1024 // side) ** 2


def test_qwen_image_edit_counts_its_sources_at_one_megapixel(family_runner: Any) -> None:
    runner = family_runner("qwen-image-edit")
    side = runner.pipeline.pixel_multiple
    edit = SamplingParams(prompt="p", height=512, width=512, images=(picture(300, 200),))
    # 300x200 -> about 1 MP at 3:2 on a 32-pixel grid: 1248x832.
    assert runner.work_rule.of(edit).tokens == (512 // side) ** 2 + (1248 // side) * (832 // side)


@pytest.mark.parametrize("variant", ["flux-kontext", "flux2", "qwen-image-edit"])
def test_the_counted_tokens_are_the_tokens_the_dit_receives(family_runner: Any,
                                                           variant: str) -> None:
    runner = family_runner(variant)
    pipeline = runner.pipeline
    first = pipeline.transformer.get_submodule(pipeline.block_lists[0])[0]
    seen: list[tuple[int, int]] = []

    def capture(module, args, kwargs):  # type: ignore[no-untyped-def]
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        seen.append((hidden.shape[0], hidden.shape[1]))

    images = {"flux-kontext": (picture(90, 50),),
              "flux2": (picture(96, 64, 1), picture(80, 112, 2)),
              "qwen-image-edit": (picture(40, 70),)}[variant]
    params = SamplingParams(prompt="p", height=32, width=64, images=images)
    handle = first.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        state = DenoiseState("r", params, seed=0)
        pipeline.prepare_encode(state)
        GroupForwards(pipeline).run([[state]])
    finally:
        handle.remove()
    work = runner.work_rule.of(params)
    assert work.tokens_per_row > runner.work_rule.generated_tokens_per_row(params)
    assert seen[-1] == (work.rows, work.tokens_per_row)


def test_a_step_of_edits_keeps_to_the_token_budget(family_runner: Any) -> None:
    rule = family_runner("flux-kontext").work_rule
    edit = SamplingParams(prompt="p", height=1024, width=1024, images=(picture(1024, 1024),))
    text_to_image = rule.of(SamplingParams(prompt="p", height=1024, width=1024)).tokens
    # Four text-to-image requests' budget holds two edits, not four.
    scheduler = StepScheduler(ResolvedScheduling.for_family(
        SchedulerConfig(max_num_seqs=4, max_batch_tokens=4 * text_to_image)))
    for rid in "abcd":
        scheduler.add(rid, edit, rule.of(edit))
    plan = scheduler.schedule()
    assert len(plan.encode) == 2


def test_the_request_bound_refuses_an_edit_by_its_total_tokens(family_dir: Any) -> None:
    config = EngineConfig(model=str(family_dir("flux2")), device="cpu",
                          scheduler=SchedulerConfig(max_batch_tokens=256))
    engine = DiffusionEngine(config).start()
    try:
        assert engine.max_request_tokens == 4 * 256
        size = 16 * engine.runner.pipeline.pixel_multiple  # 256 tokens
        four = tuple(picture(size, size, i) for i in range(4))
        three = SamplingParams(prompt="p", height=size, width=size, images=four[:3])
        assert engine.runner.work_rule.of(three).tokens == 4 * 256
        engine.validate_params(three)  # 1024 tokens: within the bound, runs alone
        with pytest.raises(InvalidRequestError, match="input images") as refused:
            engine.validate_params(SamplingParams(prompt="p", height=size, width=size,
                                                  images=four))
        # The four references are 1024 of its 1280 tokens: the images are what to shrink.
        assert refused.value.field == "image"
    finally:
        engine.shutdown()


def test_the_planner_budgets_one_conditioned_request_alone(family_runner: Any,
                                                           monkeypatch: Any) -> None:
    """A request above the step budget runs alone, up to max_request_tokens: the planner's
    denoise estimate covers the family's usual request with its most conditioning (CFG
    rows), where it did the text-to-image budget only; a text-only family's is unchanged."""
    settings = dict(scheduler=SchedulerConfig(max_num_seqs=1), pipeline_config=PipelineConfig(),
                    offload=ResolvedOffload())
    flux = family_runner("flux").pipeline
    sched = ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=1), flux.family)
    assert planned_step_tokens(flux, sched) == sched.max_batch_tokens

    kontext = family_runner("flux-kontext").pipeline
    sched = ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=1), kontext.family)
    most = kontext.most_condition_tokens
    assert most >= kontext.condition_tokens(SamplingParams(
        prompt="p", images=(picture(1024, 1024),))) > 0
    assert planned_step_tokens(kontext, sched) == sched.max_batch_tokens + 2 * most
    # FLUX.2: ten references at 1 MP go past four budgets: capped at what one request may be.
    flux2 = family_runner("flux2").pipeline
    sched = ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=1), flux2.family)
    assert planned_step_tokens(flux2, sched) == sched.max_request_tokens > sched.max_batch_tokens
    conditioned = budget_inputs(flux2, **settings).denoise_activations
    monkeypatch.setattr(type(flux2), "most_condition_tokens", property(lambda self: 0))
    assert conditioned > budget_inputs(flux2, **settings).denoise_activations
