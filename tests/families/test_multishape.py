"""Multi-shape steps for the other families: Qwen-Image with two sizes, Wan with two frame
counts and sizes, Wan 2.2 with groups on both sides of the expert boundary - each request
equals its output alone, resident and under DLO (where a step is one pass of weights). And
the pure work rule (rows x tokens) agrees with what every pipeline feeds its DiT."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig
from ditserve.engine.request import SamplingParams
from ditserve.engine.runner.group_forwards import GroupForwards
from ditserve.engine.runner.model_runner import ModelRunner
from ditserve.engine.step.denoise_state import DenoiseState
from ditserve.engine.step.plan import RunnerOutput

TOLERANCE = 1e-4  # fp32 on CPU, decoded pixels in [0, 1]


def scenario(variant: str) -> dict[int, list[tuple[str, SamplingParams]]]:
    """Three shape groups (images: 32x32, 48x48, 32x48; videos: 5 and 9 frames, 32x48);
    for Wan 2.2, at step 2 "long" (6 steps, at its step 2) is on the
    low-noise expert and the requests arriving then on the high-noise one, so the 5-frame
    group straddles the boundary and the 9-frame group does not."""
    video = variant.startswith("wan")
    short, long = ({"num_frames": 5}, {"num_frames": 9}) if video else ({}, {})
    cfg = ({"guidance_scale": 4.0, "height": 32} if video
           else {"negative_prompt": "blurry", "true_cfg_scale": 3.0, "height": 48})
    plain = {"guidance_scale": 1.0} if video else {}
    return {
        0: [("long", SamplingParams(prompt="a red fox in the snow", seed=11, height=32,
                                    width=32, num_inference_steps=6, **plain, **short))],
        2: [("cfg", SamplingParams(prompt="a castle", seed=13, width=32,
                                   num_inference_steps=3, **cfg, **long)),
            ("wide", SamplingParams(prompt="sea", seed=12, height=32, width=48,
                                    num_inference_steps=2, **plain, **short)),
            ("join", SamplingParams(prompt="two cats", seed=14, height=32, width=32,
                                    num_inference_steps=3, **plain, **short))],
    }


VARIANTS = ["qwen-image", "wan", "wan2.2", "z-image", "flux2", "flux2-klein"]


@pytest.fixture(scope="module")
def alone(family_runner):  # type: ignore[no-untyped-def]
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def get(variant: str) -> dict[str, torch.Tensor]:
        if variant not in cache:
            cache[variant] = {}
            for requests in scenario(variant).values():
                for rid, params in requests:
                    out, _ = drive(family_runner(variant), {0: [(rid, params)]},
                                   max_num_seqs=1)
                    cache[variant][rid] = out[rid]
        return cache[variant]

    return get


def check(variant: str, batched: dict[str, torch.Tensor], alone: dict[str, torch.Tensor],
          outputs: list[RunnerOutput]) -> None:
    assert max(o.forward_groups for o in outputs) == 3, "the scenario must mix three shapes"
    assert set(batched) == set(alone)
    for rid, pixels in batched.items():
        assert pixels.shape == alone[rid].shape
        diff = (pixels - alone[rid]).abs().max().item()
        assert diff <= TOLERANCE, f"{variant} request {rid}: max abs diff {diff}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_resident_multishape_steps_equal_alone(family_runner, alone, variant: str) -> None:  # type: ignore[no-untyped-def]
    outputs: list[RunnerOutput] = []
    batched, _ = drive(family_runner(variant), scenario(variant), max_num_seqs=4,
                       outputs=outputs)
    check(variant, batched, alone(variant), outputs)


@pytest.mark.parametrize("variant", VARIANTS)
def test_dlo_multishape_steps_equal_alone(family_dir, alone, variant: str) -> None:  # type: ignore[no-untyped-def]
    model: Path = family_dir(variant)
    runner = ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cpu",
                                                      offload=OffloadConfig(enabled=True))),
                         model_dir=model)
    try:
        drive(runner, {0: [("warm", scenario(variant)[0][0][1])]}, max_num_seqs=1)
        before = runner.offload_report()
        outputs: list[RunnerOutput] = []
        batched, _ = drive(runner, scenario(variant), max_num_seqs=4, outputs=outputs)
        after = runner.offload_report()
    finally:
        runner.close()
    check(variant, batched, alone(variant), outputs)
    steps = sum(1 for o in outputs if o.forward_rows)
    assert after["passes"] - before["passes"] == steps
    moved = after["bytes_transferred"] - before["bytes_transferred"]
    if variant == "wan2.2":
        # At most one pass per step: a step that needs one expert only loads that expert's
        # blocks and prefetches the other's first (docs/families.md), never a pass per group.
        assert 0 < moved <= steps * after["streamed_bytes"]
    else:
        # One pass of weights per step (none once every block fits the slots).
        per_step = after["streamed_bytes"] if after["streamed_blocks"] > after["slots"] else 0
        assert moved == steps * per_step


def test_wan22_scenario_straddles_within_and_across_groups(family_runner) -> None:  # type: ignore[no-untyped-def]
    runner = family_runner("wan2.2")
    pipeline = runner.pipeline
    states = {}
    for rid, params in [*scenario("wan2.2")[0], *scenario("wan2.2")[2]]:
        state = DenoiseState(rid, params, seed=0)
        pipeline.prepare_encode(state)
        states[rid] = state
    states["long"].step_index = 2  # where "long" is when the others arrive
    experts = {rid: pipeline.expert_of(s) for rid, s in states.items()}
    assert experts == {"long": 1, "cfg": 0, "wide": 0, "join": 0}
    # And the step runs: "long" and "join" (5 frames, 32x32) are one group on two experts.
    results = GroupForwards(pipeline).run([[states["long"], states["join"]], [states["cfg"]]])
    assert all(r.error is None for r in results)


@pytest.mark.parametrize("variant", ["flux", "qwen-image", "wan", "wan2.2-ti2v"])
def test_work_rule_matches_the_rows_and_tokens_each_dit_receives(family_runner, variant: str) -> None:  # type: ignore[no-untyped-def]
    runner = family_runner(variant)
    pipeline = runner.pipeline
    first = pipeline.transformer.get_submodule(pipeline.block_lists[0])[0]
    seen: list[tuple[int, int]] = []

    def capture(module, args, kwargs):  # type: ignore[no-untyped-def]
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        seen.append((hidden.shape[0], hidden.shape[1]))  # (rows, image tokens)

    video = variant.startswith("wan")
    frames = {"num_frames": 9} if video else {}
    cases = [SamplingParams(prompt="p", height=32, width=64, **frames),
             SamplingParams(prompt="p", height=64, width=32, num_images=2, **frames),
             SamplingParams(prompt="p", height=32, width=32, negative_prompt="n",
                            true_cfg_scale=2.0, guidance_scale=4.0 if video else 3.5, **frames)]
    handle = first.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        for params in cases:
            state = DenoiseState("r", params, seed=0)
            pipeline.prepare_encode(state)
            GroupForwards(pipeline).run([[state]])
            work = runner.work_rule.of(params)
            assert state.rows == work.rows
            assert seen[-1] == (work.rows, work.tokens_per_row), (variant, params)
    finally:
        handle.remove()
