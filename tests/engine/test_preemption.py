"""Preemption at step boundaries with a real (tiny) model: a paused request's output equals an
uninterrupted run bit for bit, and the engine reports pauses, resumes and deadline refusals."""

from __future__ import annotations

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, SchedulerConfig
from ditserve.engine.errors import DeadlineError
from ditserve.engine.loop.engine import DiffusionEngine, RequestEvent
from ditserve.engine.request import SamplingParams
from ditserve.engine.step.plan import StepPlan

PRIORITY_ONE_SLOT = SchedulerConfig(max_num_seqs=1, scheduling_policy="priority")
BATCH = SamplingParams(prompt="a lighthouse at dusk", num_inference_steps=6, seed=7,
                       priority=1)
URGENT = SamplingParams(prompt="a red fox", num_inference_steps=3, seed=8, priority=0)


def paused_and_resumed(runner, config: SchedulerConfig = PRIORITY_ONE_SLOT  # type: ignore[no-untyped-def]
                       ) -> tuple[dict[str, torch.Tensor], list[StepPlan]]:
    plans: list[StepPlan] = []
    pixels, _ = drive(runner, {0: [("batch", BATCH)], 2: [("urgent", URGENT)]},
                      max_num_seqs=1, config=config, plans=plans)
    return pixels, plans


def test_a_paused_request_resumes_to_the_uninterrupted_output(tiny_runner) -> None:  # type: ignore[no-untyped-def]
    pixels, plans = paused_and_resumed(tiny_runner)
    # Steps 0-1 denoise the batch request, 2-4 only the urgent one (the batch one waits with
    # its state untouched), then the batch request resumes without a second encode.
    assert [p.denoise for p in plans] == [("batch",)] * 2 + [("urgent",)] * 3 \
        + [("batch",)] * 4
    assert [p.encode for p in plans if p.encode] == [("batch",), ("urgent",)]
    alone, _ = drive(tiny_runner, {0: [("x", BATCH)]}, max_num_seqs=1)
    assert torch.equal(pixels["batch"], alone["x"])
    urgent_alone, _ = drive(tiny_runner, {0: [("x", URGENT)]}, max_num_seqs=1)
    assert torch.equal(pixels["urgent"], urgent_alone["x"])


class Recorder:
    def __init__(self) -> None:
        self.preempted: list[str] = []
        self.resumed: list[tuple[str, float]] = []

    def on_step(self, **_: object) -> None: ...
    def on_finished(self, result: object) -> None: ...
    def on_failed(self, request_id: str, reason: str) -> None: ...
    def on_preempted(self, request_id: str) -> None:
        self.preempted.append(request_id)

    def on_resumed(self, request_id: str, seconds: float) -> None:
        self.resumed.append((request_id, seconds))


def test_the_engine_pauses_for_a_higher_priority_request_and_refuses_late_ones(
        tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    recorder = Recorder()
    config = EngineConfig(model=str(tiny_model_dir), device="cpu", scheduler=PRIORITY_ONE_SLOT)
    engine = DiffusionEngine(config, observers=[recorder]).start()
    try:
        events: list[RequestEvent] = []
        urgent: list[object] = []

        def on_batch_event(event: RequestEvent) -> None:
            events.append(event)
            if event.kind == "step" and event.step == 2 and not urgent:
                # In the loop thread, between two steps: the next plan sees it.
                urgent.append(engine.add_request(URGENT, request_id="urgent"))

        batch = engine.add_request(BATCH, request_id="batch", on_event=on_batch_event)
        result = batch.result(timeout=120)
        assert urgent and urgent[0].result(timeout=120).pixels is not None  # type: ignore[attr-defined]
        kinds = [e.kind for e in events if e.kind != "queued"]
        assert kinds[:3] == ["step", "step", "paused"]
        assert [e.step for e in events if e.kind == "step"] == [1, 2, 3, 4, 5, 6]
        assert recorder.preempted == ["batch"] and recorder.resumed[0][0] == "batch"
        # The engine's result equals an uninterrupted run of the same request.
        again = engine.add_request(BATCH, request_id="again").result(timeout=120)
        assert torch.equal(result.pixels, again.pixels)
        # Step times are measured now: a deadline no estimate can meet is refused at once.
        assert engine.stats().step_seconds is not None
        with pytest.raises(DeadlineError, match="deadline_s=0.001 cannot be met"):
            engine.add_request(SamplingParams(prompt="x", num_inference_steps=50,
                                              deadline_s=0.001))
    finally:
        engine.shutdown()


def test_without_priority_policy_nothing_is_paused(tiny_runner) -> None:  # type: ignore[no-untyped-def]
    _, plans = paused_and_resumed(tiny_runner, SchedulerConfig(max_num_seqs=1))
    assert [p.denoise for p in plans] == [("batch",)] * 6 + [("urgent",)] * 3
