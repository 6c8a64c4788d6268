"""Batched equals solo for every family: different step counts, CFG and plain requests, and
prompts of different lengths in one forward; Wan 2.2 batches whose requests sit on both
sides of the expert boundary."""

from __future__ import annotations

import pytest
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.request import SamplingParams
from ditserve.engine.step.sampler import SchedulerTrajectory

TOLERANCE = 1e-4  # fp32 on CPU, decoded pixels in [0, 1]


def scenario(variant: str) -> dict[int, list[tuple[str, SamplingParams]]]:
    video = variant.startswith("wan")
    frames = {"num_frames": 5} if video else {}
    size = {"height": 32, "width": 32}
    cfg = ({"guidance_scale": 4.0} if video else {"true_cfg_scale": 3.0})
    plain = {"guidance_scale": 1.0} if video else {}
    return {
        0: [("long", SamplingParams(prompt="a red fox in the snow at dusk", seed=11,
                                    num_inference_steps=6, **plain, **size, **frames))],
        2: [("cfg", SamplingParams(prompt="a castle", negative_prompt="blurry", seed=13,
                                   num_inference_steps=3, **cfg, **size, **frames)),
            ("short", SamplingParams(prompt="sea", seed=12, num_inference_steps=2, **plain,
                                     **size, **frames))],
        3: [("two", SamplingParams(prompt="two cats", seed=14, num_inference_steps=2,
                                   num_images=2, **plain, **size, **frames))],
    }


@pytest.mark.parametrize("variant", ["qwen-image", "wan", "wan2.2"])
def test_batched_equals_alone(family_runner, variant: str) -> None:  # type: ignore[no-untyped-def]
    runner = family_runner(variant)
    arrivals = scenario(variant)
    batched, sizes = drive(runner, arrivals, max_num_seqs=4)
    assert max(sizes) >= 3, "the scenario must actually batch"
    for requests in arrivals.values():
        for rid, params in requests:
            alone, _ = drive(runner, {0: [(f"alone-{rid}", params)]}, max_num_seqs=1)
            expected = alone[f"alone-{rid}"]
            assert batched[rid].shape == expected.shape
            diff = (batched[rid] - expected).abs().max().item()
            assert diff <= TOLERANCE, f"{variant} request {rid}: max abs diff {diff}"
    assert (batched["long"] - batched["short"]).abs().max().item() > 1e-3


def test_wan22_scenario_straddles_the_boundary(family_runner) -> None:  # type: ignore[no-untyped-def]
    # At engine step 2 "long" (6 steps) is at its step 2 and the new requests at their step
    # 0: the batch must hold both experts' requests for the test above to mean anything.
    pipeline = family_runner("wan2.2").pipeline

    def timestep(steps: int, index: int) -> float:
        trajectory = SchedulerTrajectory(type(pipeline.scheduler), pipeline.scheduler.config,
                                         steps)
        return float(trajectory.timesteps[index])

    assert timestep(6, 2) < pipeline.boundary <= timestep(3, 0)
