"""Multi-shape steps on the tiny Flux: requests of three sizes (one non-square), CFG and plain,
n=2, different step counts and staggered arrivals share steps, each request's output equals
its output alone, resident and under DLO; under DLO a step moves one pass of weights whatever
its number of shape groups; a group that fails mid-forward fails alone."""

from __future__ import annotations

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig
from ditserve.engine.request import SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner
from ditserve.engine.step.plan import RunnerOutput

TOLERANCE = 1e-4  # as tests/engine/test_equivalence.py: fp32 on CPU, pixels in [0, 1]

REQUESTS = {
    "square": SamplingParams(prompt="a red fox", height=64, width=64, num_inference_steps=5,
                             seed=11),
    "wide": SamplingParams(prompt="a castle", negative_prompt="blurry", true_cfg_scale=3.0,
                           height=32, width=64, num_inference_steps=3, seed=12),
    "small": SamplingParams(prompt="sea", height=48, width=48, num_inference_steps=4, seed=13),
    "pair": SamplingParams(prompt="two cats", height=64, width=64, num_inference_steps=2,
                           seed=14, num_images=2),
    "wide2": SamplingParams(prompt="a forest", height=32, width=64, num_inference_steps=3,
                            seed=15, guidance_scale=5.0),
}
ARRIVALS = {0: [("square", REQUESTS["square"]), ("wide", REQUESTS["wide"])],
            1: [("small", REQUESTS["small"])], 2: [("pair", REQUESTS["pair"])],
            3: [("wide2", REQUESTS["wide2"])]}


@pytest.fixture(scope="module")
def alone(tiny_runner) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    out = {}
    for rid, params in REQUESTS.items():
        pixels, _ = drive(tiny_runner, {0: [(rid, params)]}, max_num_seqs=1)
        out[rid] = pixels[rid]
    return out


@pytest.fixture(scope="module")
def dlo_runner(tiny_model_dir):  # type: ignore[no-untyped-def]
    runner = ModelRunner(RunnerConfig.of(EngineConfig(model=str(tiny_model_dir), device="cpu",
                                                      offload=OffloadConfig(enabled=True))),
                         model_dir=tiny_model_dir)
    yield runner
    runner.close()


def check_equal(batched: dict[str, torch.Tensor], alone: dict[str, torch.Tensor]) -> None:
    assert set(batched) == set(REQUESTS)
    for rid, pixels in batched.items():
        assert pixels.shape == alone[rid].shape
        diff = (pixels - alone[rid]).abs().max().item()
        assert diff <= TOLERANCE, f"request {rid}: max abs diff {diff}"


def test_resident_multishape_steps_equal_alone(tiny_runner, alone) -> None:  # type: ignore[no-untyped-def]
    outputs: list[RunnerOutput] = []
    batched, sizes = drive(tiny_runner, ARRIVALS, max_num_seqs=4, outputs=outputs)
    assert max(o.forward_groups for o in outputs) == 3, "the scenario must mix three shapes"
    assert max(sizes) == 4
    check_equal(batched, alone)


def test_dlo_multishape_steps_equal_alone_and_move_one_pass_per_step(dlo_runner, alone) -> None:  # type: ignore[no-untyped-def]
    drive(dlo_runner, {0: [("warm", REQUESTS["small"])]}, max_num_seqs=1)  # past the cold load
    before = dlo_runner.offload_report()
    outputs: list[RunnerOutput] = []
    batched, _ = drive(dlo_runner, ARRIVALS, max_num_seqs=4, outputs=outputs)
    check_equal(batched, alone)
    after = dlo_runner.offload_report()
    steps = [o for o in outputs if o.forward_rows]
    assert max(o.forward_groups for o in steps) == 3
    # One pass per step, however many shape groups ran each block, and one pass's bytes.
    passes = after["passes"] - before["passes"]
    moved = after["bytes_transferred"] - before["bytes_transferred"]
    assert passes == len(steps)
    assert moved == passes * after["streamed_bytes"]


def test_step_reports_groups_rows_and_tokens(dlo_runner) -> None:  # type: ignore[no-untyped-def]
    outputs: list[RunnerOutput] = []
    arrivals = {0: [("square", REQUESTS["square"]), ("wide", REQUESTS["wide"]),
                    ("small", REQUESTS["small"])]}
    drive(dlo_runner, arrivals, max_num_seqs=4, outputs=outputs)
    first = outputs[0]
    # Tiny Flux: 4-pixel tokens. 64x64 = 256 tokens x 1 row, 32x64 = 128 x 2 (true CFG),
    # 48x48 = 144 x 1.
    assert (first.forward_requests, first.forward_rows, first.forward_groups) == (3, 4, 3)
    assert first.forward_tokens == 256 + 2 * 128 + 144


def test_a_group_failing_mid_forward_fails_alone(dlo_runner, alone) -> None:  # type: ignore[no-untyped-def]
    # Block 1 of the double-stream blocks raises for the 48x48 group (144 image tokens),
    # after the group has run block 0 with the others: the lanes of the other groups finish
    # and equal their solo outputs; the group (one request: no retry) fails.
    block = dlo_runner.pipeline.transformer.transformer_blocks[1]

    def refuse(module, args, kwargs):  # type: ignore[no-untyped-def]
        if kwargs["hidden_states"].shape[1] == 144:
            raise RuntimeError("injected failure")

    handle = block.register_forward_pre_hook(refuse, with_kwargs=True)
    try:
        arrivals = {0: [("square", REQUESTS["square"]), ("small", REQUESTS["small"]),
                        ("wide", REQUESTS["wide"])]}
        before = dlo_runner.offload_report()
        outputs: list[RunnerOutput] = []
        batched, _ = drive(dlo_runner, arrivals, max_num_seqs=4, outputs=outputs,
                           allow_failures=True)
    finally:
        handle.remove()
    assert [set(o.failed) for o in outputs if o.failed] == [{"small"}]
    assert "injected failure" in outputs[0].failed["small"]
    for rid in ("square", "wide"):
        assert (batched[rid] - alone[rid]).abs().max().item() <= TOLERANCE
    after = dlo_runner.offload_report()
    # The failing step still ran one pass, for all its groups.
    steps = sum(1 for o in outputs if o.forward_rows)
    passes = after["passes"] - before["passes"]
    assert passes == steps
    assert after["bytes_transferred"] - before["bytes_transferred"] == \
        passes * after["streamed_bytes"]


def test_a_failing_group_is_retried_request_by_request(dlo_runner, tiny_runner, alone) -> None:  # type: ignore[no-untyped-def]
    # The 48x48 group fails only as a batch of two (an error of the batched forward): each of
    # its requests is retried alone and succeeds; the square group never noticed.
    other = SamplingParams(prompt="sky", height=48, width=48, num_inference_steps=2, seed=21)
    other_alone, _ = drive(tiny_runner, {0: [("other", other)]}, max_num_seqs=1)
    block = dlo_runner.pipeline.transformer.single_transformer_blocks[0]

    def refuse(module, args, kwargs):  # type: ignore[no-untyped-def]
        hidden = kwargs["hidden_states"]
        if hidden.shape[0] == 2 and hidden.shape[1] == 144:
            raise RuntimeError("injected batch failure")

    handle = block.register_forward_pre_hook(refuse, with_kwargs=True)
    try:
        before = dlo_runner.offload_report()
        outputs: list[RunnerOutput] = []
        batched, _ = drive(dlo_runner, {0: [("square", REQUESTS["square"]),
                                            ("small", REQUESTS["small"]), ("other", other)]},
                           max_num_seqs=4, outputs=outputs)
    finally:
        handle.remove()
    assert (batched["other"] - other_alone["other"]).abs().max().item() <= TOLERANCE
    for rid in ("square", "small"):
        assert (batched[rid] - alone[rid]).abs().max().item() <= TOLERANCE
    after = dlo_runner.offload_report()
    steps = sum(1 for o in outputs if o.forward_rows)
    retries = 2 * 2  # both 48x48 requests, alone, in each of the 2 steps "other" shares
    assert after["passes"] - before["passes"] == steps + retries


@pytest.mark.slow
def test_compiled_blocks_under_dlo_run_block_major_too(tiny_model_dir, alone) -> None:  # type: ignore[no-untyped-def]
    # The barrier and the offload hooks stay eager around the compiled forward of each block
    # (regional compilation), so lanes suspend outside compiled code.
    torch._dynamo.reset()
    runner = ModelRunner(RunnerConfig.of(EngineConfig(model=str(tiny_model_dir), device="cpu",
                                                      compile="aot_eager",
                                                      offload=OffloadConfig(enabled=True))),
                         model_dir=tiny_model_dir)
    try:
        outputs: list[RunnerOutput] = []
        batched, _ = drive(runner, ARRIVALS, max_num_seqs=4, outputs=outputs)
    finally:
        runner.close()
        torch._dynamo.reset()
    assert max(o.forward_groups for o in outputs) == 3
    check_equal(batched, alone)
