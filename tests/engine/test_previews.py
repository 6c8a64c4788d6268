"""Partial images: previews of a running request's latents, decoded at evenly spaced steps
(SamplingParams.partial_images -> the runner's previews -> "preview" events)."""

from __future__ import annotations

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.loop.engine import DiffusionEngine, RequestEvent
from ditserve.engine.request import NewRequest, SamplingParams
from ditserve.engine.sched.scheduler import StepScheduler
from ditserve.engine.sched.work import ResolvedScheduling


@pytest.mark.parametrize(("steps", "partial", "expected"), [
    (4, 0, set()), (4, 1, {2}), (4, 2, {1, 3}), (4, 3, {1, 2, 3}), (28, 3, {7, 14, 21}),
    (2, 3, {1}), (1, 3, set()), (9, 2, {3, 6}),
])
def test_preview_steps_are_evenly_spaced_and_never_the_last(steps, partial, expected) -> None:
    params = SamplingParams(prompt="x", num_inference_steps=steps, partial_images=partial)
    assert params.preview_steps == expected


@pytest.mark.parametrize("value", [-1, 4, True, 1.0])
def test_partial_images_is_validated(value) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(prompt="x", partial_images=value).validate()
    assert info.value.field == "partial_images"


WITH_PREVIEWS = SamplingParams(prompt="a fox", num_inference_steps=4, seed=3, num_images=2,
                               partial_images=2)


def run_with_previews(runner) -> tuple[dict[int, torch.Tensor], torch.Tensor]:  # type: ignore[no-untyped-def]
    """Drive WITH_PREVIEWS to the end; its previews by step and its final pixels."""
    scheduler = StepScheduler(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=1)))
    scheduler.add("p", WITH_PREVIEWS)
    new = [NewRequest("p", WITH_PREVIEWS, 3)]
    previews: dict[int, torch.Tensor] = {}
    finished = {}
    while scheduler.has_work() or not finished:
        plan = scheduler.schedule()
        out = runner.execute(plan, new)
        new = []
        scheduler.update(plan, out)
        assert not out.failed
        for rid, (step, pixels) in out.previews.items():
            assert rid == "p"
            previews[step] = pixels.clone()  # read now: a late copy would show here
        finished.update(out.finished)
    return previews, finished["p"]


def test_previews_are_decoded_latents_and_leave_the_result_alone(tiny_runner) -> None:
    plain = SamplingParams(prompt="a fox", num_inference_steps=4, seed=3, num_images=2)
    alone, _ = drive(tiny_runner, {0: [("plain", plain)]}, max_num_seqs=1)
    previews, final = run_with_previews(tiny_runner)
    finished = {"p": final}
    assert sorted(previews) == [1, 3]
    for pixels in previews.values():
        assert pixels.shape == (2, 3, 64, 64) and pixels.device.type == "cpu"
        assert float(pixels.min()) >= 0.0 and float(pixels.max()) <= 1.0
    assert not torch.equal(previews[1], previews[3])  # the trajectory moved between them
    assert not torch.allclose(previews[3], finished["p"])  # a preview is not the result
    torch.testing.assert_close(finished["p"], alone["plain"])


def test_engine_emits_previews_after_their_step(tiny_model_dir) -> None:
    config = EngineConfig(model=str(tiny_model_dir), device="cpu",
                          scheduler=SchedulerConfig(max_num_seqs=2))
    engine = DiffusionEngine(config).start()
    try:
        events: list[RequestEvent] = []
        quiet: list[RequestEvent] = []
        handle = engine.add_request(
            SamplingParams(prompt="x", num_inference_steps=6, seed=1, partial_images=2),
            on_event=events.append)
        other = engine.add_request(SamplingParams(prompt="y", num_inference_steps=6, seed=2),
                                   on_event=quiet.append)
        handle.result(timeout=60)
        other.result(timeout=60)
    finally:
        engine.shutdown()
    kinds = [(e.kind, e.step) for e in events if e.kind in ("step", "preview")]
    assert kinds == [("step", 1), ("step", 2), ("preview", 2), ("step", 3), ("step", 4),
                     ("preview", 4), ("step", 5), ("step", 6)]
    preview = next(e for e in events if e.kind == "preview")
    assert preview.pixels.shape == (1, 3, 64, 64) and preview.total_steps == 6
    assert not any(e.kind == "preview" for e in quiet)  # only the request that asked


@pytest.mark.gpu
def test_previews_on_cuda_are_complete_when_handed_back(tiny_model_dir, tiny_runner) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ditserve.engine.runner.model_runner import ModelRunner

    cuda = ModelRunner(RunnerConfig.of(EngineConfig(model=str(tiny_model_dir), device="cuda")),
                       model_dir=tiny_model_dir)
    on_cuda, final_cuda = run_with_previews(cuda)
    on_cpu, final_cpu = run_with_previews(tiny_runner)
    assert sorted(on_cuda) == sorted(on_cpu) == [1, 3]
    for step in on_cpu:  # the pinned copies had landed (the runner waited for them)
        torch.testing.assert_close(on_cuda[step], on_cpu[step], atol=2e-3, rtol=0)
    torch.testing.assert_close(final_cuda, final_cpu, atol=2e-3, rtol=0)
