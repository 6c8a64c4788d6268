"""PlanPoint (``scheduler.plan_at``): the loop plans the next step only once the queued one
has reached a block partway through its forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ditserve.engine.config import EngineConfig, SchedulerConfig
from ditserve.engine.config.rules import problems
from ditserve.engine.request import SamplingParams
from ditserve.engine.runner.plan_point import PlanPoint


class Event:
    """Stands in for a CUDA event: records where it was recorded and whether it was waited on."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def record(self) -> None:
        self.log.append("record")

    def synchronize(self) -> None:
        self.log.append("wait")


class Blocks(nn.Module):
    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log
        self.pairs = nn.ModuleList(nn.Identity() for _ in range(4))
        self.singles = nn.ModuleList(nn.Identity() for _ in range(6))
        for i, block in enumerate([*self.pairs, *self.singles]):
            block.register_forward_pre_hook(lambda m, a, i=i: self.log.append(f"block {i}"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in [*self.pairs, *self.singles]:
            x = block(x)
        return x


def test_the_event_is_recorded_at_the_block_a_fraction_into_the_forward() -> None:
    log: list[str] = []
    model = Blocks(log)
    point = PlanPoint(model, ("pairs", "singles"), 0.8, device=torch.device("cpu"),
                      make_event=lambda: Event(log))
    assert point.active and point.block_index == 8  # of 10 blocks, across both lists
    model(torch.zeros(1))
    assert log[log.index("record") - 1] == "block 8"  # after block 8's own pre-hook...
    assert log[log.index("record") + 1] == "block 9"  # ...before the block after it
    log.clear()
    point.wait()
    point.wait()  # once per point: a step with no forward does not wait again
    assert log == ["wait"]
    point.close()
    model(torch.zeros(1))
    assert "record" not in log


def test_two_passes_in_one_step_wait_for_the_later_one() -> None:
    log: list[str] = []
    model = Blocks(log)
    events: list[Event] = []

    def make() -> Event:
        events.append(Event(log))
        return events[-1]

    point = PlanPoint(model, ("pairs", "singles"), 0.5, device=torch.device("cpu"), make_event=make)
    model(torch.zeros(1))
    model(torch.zeros(1))  # a second shape group's forward in the same step
    log.clear()
    point.wait()
    assert len(events) == 2 and log == ["wait"]  # the second group's point, the later one


def test_off_at_zero_and_on_a_cpu_device() -> None:
    model = Blocks([])
    assert not PlanPoint(model, ("pairs",), 0.0, device=torch.device("cpu")).active
    assert not PlanPoint(model, ("pairs",), 0.8, device=torch.device("cpu")).active
    PlanPoint(model, ("pairs",), 0.8, device=torch.device("cpu")).wait()  # returns at once


@pytest.mark.parametrize("value", [-0.1, 1.0, 2, "late"])
def test_plan_at_outside_zero_to_one_is_refused(value: object) -> None:
    config = EngineConfig(scheduler=SchedulerConfig(plan_at=value))  # type: ignore[arg-type]
    assert any("scheduler.plan_at" in p for p in problems(config))
    assert not any("plan_at" in p for p in problems(
        EngineConfig(scheduler=SchedulerConfig(plan_at=0.8))))


def test_the_engine_loop_waits_for_the_plan_point_before_it_plans(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """Through the real engine: every plan after the first waits on rank 0's plan point."""
    from ditserve.engine.loop.engine import DiffusionEngine

    engine = DiffusionEngine(EngineConfig(model=str(tiny_model_dir), device="cpu",
                                          scheduler=SchedulerConfig(plan_at=0.8))).start()
    log: list[str] = []
    runner = engine.executor.runner
    runner.plan_point.close()
    runner.plan_point = PlanPoint(runner.pipeline.transformer, runner.pipeline.block_lists,
                                  0.8, device=torch.device("cpu"), make_event=lambda: Event(log))
    try:
        result = engine.add_request(SamplingParams(prompt="a fox", height=32, width=32,
                                                   num_inference_steps=3, seed=0))
        result.result(timeout=120)
    finally:
        engine.shutdown()
    # Three forwards, each recording its point; the loop waited on each before planning on.
    assert log.count("record") == 3
    assert log.count("wait") >= 2
    waits_in_a_row = [a == b == "wait" for a, b in zip(log, log[1:], strict=False)]
    assert not any(waits_in_a_row)  # never twice for one point
