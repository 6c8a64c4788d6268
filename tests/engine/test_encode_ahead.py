"""Issue 45, item 15: under load, streamed text encoders move their weights once per several
admitted requests, not once per request. Requests are admitted one or two a step as others
finish, and each step with an uncached prompt ran a whole encoder pass (T5-XXL: 9.5 GB over
PCIe). A step that runs a pass now also encodes the prompts of the requests next in line
(``StepPlan.upcoming``) into the prompt cache (``placement.batched_encode``).

The tiny Flux under DLO on the CPU (encoders streamed, as ``--offload dlo`` does by
default), driven step by step (tests/engine/driver.py hands the runner the plan's upcoming
requests as the engine loop does). Counts the batched encoder passes and the passes of the
streamed T5's own offload handle (each pass streams every layer of a full-size T5; the tiny
one's two layers fit its two slots, so bytes are not counted here), never timings; outputs
equal the same workload without encoding ahead."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, OffloadConfig, PipelineConfig, RunnerConfig
from ditserve.engine.request import NewRequest, SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner
from ditserve.engine.step.plan import StepPlan

TOLERANCE = 1e-4  # fp32 on CPU, pixels in [0, 1]: a prompt's embedding alone or batched
# Eight unique prompts (no cache hit hides an encode), all queued at once, two at a time:
# after the first step one or two are admitted a step, as the running ones finish.
QUEUE = [(f"r{i}", SamplingParams(prompt=f"prompt number {i}", height=32, width=32,
                                  num_inference_steps=2 + i % 3, seed=i)) for i in range(8)]


@pytest.fixture(scope="module")
def streamed_runner(tiny_model_dir):  # type: ignore[no-untyped-def]
    runner = ModelRunner(RunnerConfig.of(EngineConfig(model=str(tiny_model_dir), device="cpu",
                                                      offload=OffloadConfig(enabled=True))),
                         model_dir=tiny_model_dir)
    assert "text_encoder_2" in runner.whole.streamed  # T5 streams, as --offload dlo does
    yield runner
    runner.close()


def counters(runner: ModelRunner) -> dict[str, int]:
    t5 = runner.whole.streamed["text_encoder_2"].handle.report()
    encode, cache = runner.whole.report()["encode"], runner.whole.cache.stats()
    return {"passes": encode["passes"], "ahead": encode["ahead"], "t5_passes": t5["passes"],
            "hits": cache.hits}


def serve(runner: ModelRunner, *, ahead: bool
          ) -> tuple[dict[str, torch.Tensor], dict[str, int], list[StepPlan]]:
    """The queue from an empty prompt cache: its pixels, the counters it moved, its plans."""
    runner.whole.cache.clear()
    before, plans = counters(runner), []
    pixels, _ = drive(runner, {0: QUEUE}, max_num_seqs=2, plans=plans, encode_ahead=ahead)
    after = counters(runner)
    return pixels, {k: after[k] - before[k] for k in after}, plans


def test_a_pass_encodes_the_next_requests_and_their_admission_hits(streamed_runner) -> None:  # type: ignore[no-untyped-def]
    drive(streamed_runner, {0: [("warm", QUEUE[0][1])]}, max_num_seqs=1)  # past cold loads
    alone_pixels, alone, plans = serve(streamed_runner, ahead=False)
    admitting = sum(1 for p in plans if p.encode)
    # Without encoding ahead: one pass per step that admits, each streaming all of T5.
    assert alone["passes"] == alone["t5_passes"] == admitting >= 5
    assert alone["ahead"] == 0

    ahead_pixels, ahead, _ = serve(streamed_runner, ahead=True)
    # A pass holds at most a full step's prompts (2 x max_num_seqs = 4): the first encodes
    # the two admitted and the two next; the request after them misses and its pass takes
    # the two after it; the last misses alone.
    assert ahead["passes"] == ahead["t5_passes"] == 3
    assert ahead["ahead"] == 4  # r2, r3 and r5, r6 were encoded before their admission
    assert ahead["hits"] - alone["hits"] == 4  # ... and admitted from the cache
    assert set(ahead_pixels) == set(alone_pixels) == {rid for rid, _ in QUEUE}
    for rid, pixels in ahead_pixels.items():
        assert (pixels - alone_pixels[rid]).abs().max().item() <= TOLERANCE, rid


def test_no_pass_runs_only_to_encode_ahead(streamed_runner) -> None:  # type: ignore[no-untyped-def]
    """A step whose admitted prompts are all cached runs no encoder pass, whatever waits."""
    whole = streamed_runner.whole
    whole.cache.clear()
    admitted = SamplingParams(prompt="cached prompt", height=32, width=32)
    waiting = [NewRequest(f"w{i}", SamplingParams(prompt=f"waiting {i}", height=32, width=32), i)
               for i in range(3)]
    state: Any = type("State", (), {"params": admitted})()
    with whole.encoding([state]):
        pass  # the first admission encodes its prompt
    passes, ahead = whole.encode.passes, whole.encode.ahead
    with whole.encoding([state], ahead=waiting):
        pass
    assert (whole.encode.passes, whole.encode.ahead) == (passes, ahead)


def test_a_disabled_prompt_cache_encodes_nothing_ahead(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    runner = ModelRunner(RunnerConfig.of(EngineConfig(model=str(tiny_model_dir), device="cpu",
                                                      offload=OffloadConfig(enabled=True),
                                                      pipeline=PipelineConfig(prompt_cache_size=0))),
                         model_dir=tiny_model_dir)
    try:
        drive(runner, {0: QUEUE[:4]}, max_num_seqs=2)
        assert runner.whole.report()["encode"]["ahead"] == 0  # it would be thrown away
    finally:
        runner.close()


def test_the_engine_loop_hands_the_runner_the_requests_next_in_line(tiny_model_dir, tiny_runner) -> None:  # type: ignore[no-untyped-def]
    """Through the real engine (its step loop builds ``RankWork.upcoming``): four requests
    queued at one slot take fewer encoder passes than admissions, and equal their solo runs."""
    from ditserve.engine.config import SchedulerConfig
    from ditserve.engine.loop.engine import DiffusionEngine

    engine = DiffusionEngine(EngineConfig(model=str(tiny_model_dir), device="cpu",
                                          scheduler=SchedulerConfig(max_num_seqs=1))).start()
    requests = [SamplingParams(prompt=f"queued prompt {i}", height=32, width=32,
                               num_inference_steps=3, seed=i) for i in range(4)]
    try:
        warm = engine.pipeline_report()["encode"]  # the warm-up's pass
        results = [h.result(timeout=120) for h in [engine.add_request(p) for p in requests]]
        encode = engine.pipeline_report()["encode"]
    finally:
        engine.shutdown()
    # One slot: four admissions. However the loop's first step races the later additions,
    # a pass that finds the next request waiting encodes it too.
    assert encode["ahead"] - warm["ahead"] >= 1
    assert encode["passes"] - warm["passes"] <= 3
    for params, result in zip(requests, results, strict=True):
        alone, _ = drive(tiny_runner, {0: [("x", params)]}, max_num_seqs=1)
        assert (result.pixels - alone["x"]).abs().max().item() <= TOLERANCE
