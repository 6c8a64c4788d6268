"""How a worker answers rank 0's messages (no processes: the answer function alone)."""

from __future__ import annotations

from ditserve.engine.distributed.worker import (
    RankStep,
    Reports,
    Wave,
    WorkerFailure,
    WorkerReply,
    _answer,
)
from ditserve.engine.scheduler import RunnerOutput, StepPlan


class Runner:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.steps: list[tuple[StepPlan, object, dict[str, object]]] = []

    def execute(self, plan: StepPlan, new: object, **kwargs: object) -> RunnerOutput:
        if self.fail:
            raise RuntimeError("boom")
        self.steps.append((plan, new, kwargs))
        return RunnerOutput(finished={"late": "pixels"})

    def offload_report(self) -> dict[str, int]:
        return {"passes": 3}


def test_a_report_request_runs_no_step() -> None:
    # A step would wait for the runner's queued work and return its late outputs, which the
    # report request would drop.
    runner = Runner()
    reply = _answer(runner, 1, Reports())
    assert reply == WorkerReply(None, {"passes": 3}) and runner.steps == []


def test_steps_run_this_ranks_plan_and_attach_a_report_only_when_asked() -> None:
    runner = Runner()
    plans = [StepPlan(step_id=0), StepPlan(step_id=1)]
    wave = _answer(runner, 1, Wave(plans=plans, new=[[], ["r"]], forward=True))
    step = _answer(runner, 1, RankStep(StepPlan(step_id=2), [], reports=True))
    assert isinstance(wave, WorkerReply) and wave.offload_report is None
    assert isinstance(step, WorkerReply) and step.offload_report == {"passes": 3}
    assert runner.steps == [(plans[1], ["r"], {"collective_wave": True}),
                            (StepPlan(step_id=2), [], {})]


def test_an_error_becomes_a_failure_naming_the_rank() -> None:
    reply = _answer(Runner(fail=True), 1, RankStep(StepPlan(step_id=0), []))
    assert isinstance(reply, WorkerFailure) and reply.rank == 1 and "boom" in reply.message
