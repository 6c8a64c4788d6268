"""A request's output with continuous batching equals its output alone (same seed)."""

from __future__ import annotations

import pytest
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.request import SamplingParams

TOLERANCE = 1e-4  # fp32 on CPU, decoded pixels in [0, 1]

REQUESTS = {
    "a": SamplingParams(prompt="a red fox", num_inference_steps=5, seed=11),
    "b": SamplingParams(prompt="a blue whale", num_inference_steps=2, seed=12, guidance_scale=1.5),
    "c": SamplingParams(prompt="a castle", negative_prompt="blurry", true_cfg_scale=3.0,
                        num_inference_steps=4, seed=13),
    "d": SamplingParams(prompt="two cats", num_inference_steps=3, seed=14, num_images=2),
    "e": SamplingParams(prompt="a forest", negative_prompt="fog", true_cfg_scale=2.0,
                        num_inference_steps=6, seed=15, guidance_scale=5.0),
    "f": SamplingParams(prompt="late arrival", num_inference_steps=3, seed=16),
}
# Staggered arrivals: requests join a batch that is already several steps in.
ARRIVALS = {0: [("a", REQUESTS["a"]), ("b", REQUESTS["b"])], 1: [("c", REQUESTS["c"])],
            2: [("d", REQUESTS["d"]), ("e", REQUESTS["e"])], 4: [("f", REQUESTS["f"])]}


@pytest.fixture(scope="module")
def alone(tiny_runner):  # type: ignore[no-untyped-def]
    out = {}
    for rid, params in REQUESTS.items():
        pixels, _ = drive(tiny_runner, {0: [(f"alone-{rid}", params)]}, max_num_seqs=1)
        out[rid] = pixels[f"alone-{rid}"]
    return out


def test_batched_equals_alone(tiny_runner, alone) -> None:  # type: ignore[no-untyped-def]
    batched, batch_sizes = drive(tiny_runner, ARRIVALS, max_num_seqs=4)
    assert max(batch_sizes) == 4, "the scenario must actually batch"
    for rid, pixels in batched.items():
        expected = alone[rid]
        assert pixels.shape == expected.shape
        diff = (pixels - expected).abs().max().item()
        assert diff <= TOLERANCE, f"request {rid}: max abs diff {diff}"
    assert set(batched) == set(REQUESTS)


def test_outputs_differ_across_seeds_and_prompts(alone) -> None:  # type: ignore[no-untyped-def]
    # Guards against a pipeline that ignores its inputs (equal outputs would pass the test above).
    assert (alone["a"] - alone["f"]).abs().max().item() > 1e-3
    two = alone["d"]
    assert two.shape[0] == 2 and (two[0] - two[1]).abs().max().item() > 1e-3


def test_bypass_policy_also_preserves_outputs(tiny_runner, alone) -> None:  # type: ignore[no-untyped-def]
    big = SamplingParams(prompt="wide", height=64, width=128, num_inference_steps=2, seed=3)
    arrivals = {0: [("a", REQUESTS["a"])], 1: [("big", big), ("b", REQUESTS["b"])]}
    batched, _ = drive(tiny_runner, arrivals, max_num_seqs=4, max_bypass=8)
    for rid in ("a", "b"):
        assert (batched[rid] - alone[rid]).abs().max().item() <= TOLERANCE
    assert batched["big"].shape[-2:] == (64, 128)
