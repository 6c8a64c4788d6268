"""How a worker answers rank 0's messages (no processes: the answer function alone)."""

from __future__ import annotations

import pytest

from ditserve.engine.distributed.protocol import Reports, Step, WorkerFailure, WorkerReply
from ditserve.engine.distributed.worker import answer
from ditserve.engine.executor import RankWork
from ditserve.engine.request import NewRequest, SamplingParams
from ditserve.engine.step.plan import RunnerOutput, StepPlan


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
    reply = answer(runner, 1, Reports())
    assert reply == WorkerReply(None, {"passes": 3}) and runner.steps == []


def test_steps_run_this_ranks_work_and_attach_a_report_only_when_asked() -> None:
    runner = Runner()
    new = (NewRequest("r", SamplingParams(prompt="p"), 7),)
    upcoming = (NewRequest("next", SamplingParams(prompt="q"), 8),)  # prompts to encode ahead
    together = answer(runner, 1, Step(RankWork(StepPlan(step_id=1), new, upcoming),
                                      collective=True))
    alone = answer(runner, 1, Step(RankWork(StepPlan(step_id=2)), reports=True))
    assert isinstance(together, WorkerReply) and together.offload_report is None
    assert isinstance(alone, WorkerReply) and alone.offload_report == {"passes": 3}
    assert runner.steps == [
        (StepPlan(step_id=1), new, {"upcoming": upcoming, "collective_wave": True}),
        (StepPlan(step_id=2), (), {"upcoming": (), "collective_wave": False})]


def test_an_error_becomes_a_failure_naming_the_rank() -> None:
    reply = answer(Runner(fail=True), 1, Step(RankWork(StepPlan(step_id=0))))
    assert isinstance(reply, WorkerFailure) and reply.rank == 1 and "boom" in reply.message


def test_the_idle_plan_runs_nothing() -> None:
    runner = Runner()
    reply = answer(runner, 1, Step(RankWork.idle()))
    plan, new, _ = runner.steps[0]
    assert isinstance(reply, WorkerReply) and reply.output.finished == {"late": "pixels"}
    assert plan.step_id is None and new == ()
    assert not (plan.encode or plan.denoise or plan.decode or plan.freed)


@pytest.mark.slow
def test_a_link_carries_messages_of_any_size_between_two_processes() -> None:
    # Small messages travel in one frame, longer ones (replies with pixels) in two sends.
    import torch.multiprocessing as mp
    from distributed.link_target import run_end  # type: ignore[import-not-found]

    from ditserve.engine.distributed.rendezvous import host_store

    store = host_store(2, 60)
    mp.spawn(run_end, args=(store.port,), nprocs=2, join=True)
