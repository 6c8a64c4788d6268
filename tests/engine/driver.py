"""Scripted, thread-free step driver for engine tests (scheduler + runner, fixed arrivals)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ditserve.engine.config import SchedulerConfig
from ditserve.engine.request import NewRequest, SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner
from ditserve.engine.sched.scheduler import StepScheduler
from ditserve.engine.sched.work import ResolvedScheduling
from ditserve.engine.step.plan import RunnerOutput, StepPlan

Arrivals = Mapping[int, Sequence[tuple[str, SamplingParams]]]


def drive(
    runner: ModelRunner, arrivals: Arrivals, *, max_num_seqs: int, max_bypass: int = 0,
    outputs: list[RunnerOutput] | None = None, allow_failures: bool = False,
    config: SchedulerConfig | None = None, plans: list[StepPlan] | None = None,
    encode_ahead: bool = True,
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Run a scripted arrival pattern to completion without threads.

    arrivals[k] are added just before engine step k. Returns each request's decoded pixels
    and the batch size (requests) of every denoise step. ``max_bypass`` 0 admits in
    strict arrival order. ``outputs`` collects every step's RunnerOutput; failed requests
    fail the run unless ``allow_failures``. ``config`` replaces the scheduler config made of
    ``max_num_seqs`` and ``max_bypass``; ``plans`` collects every step's plan.
    ``encode_ahead``: hand the runner the plan's upcoming requests, as the engine does.
    """
    config = config or SchedulerConfig(max_num_seqs=max_num_seqs, max_bypass=max_bypass)
    if not isinstance(config, ResolvedScheduling):
        config = ResolvedScheduling.for_family(config)
    scheduler = StepScheduler(config)
    pending = dict(arrivals)
    results: dict[str, torch.Tensor] = {}
    batch_sizes: list[int] = []
    step = 0
    queued: dict[str, NewRequest] = {}  # added, not yet admitted
    while pending or scheduler.has_work():
        for rid, params in pending.pop(step, ()):
            scheduler.add(rid, params, runner.work_rule.of(params))
            queued[rid] = NewRequest(rid, params, params.seed if params.seed is not None else 0)
        plan = scheduler.schedule()
        # As the engine does: the runner receives a request when the plan admits it.
        new = [queued.pop(rid) for rid in plan.encode if rid in queued]
        upcoming = [queued[rid] for rid in plan.upcoming if rid in queued] if encode_ahead else []
        output = runner.execute(plan, new, upcoming=upcoming)
        scheduler.update(plan, output)
        if plans is not None:
            plans.append(plan)
        assert allow_failures or not output.failed, output.failed
        if outputs is not None:
            outputs.append(output)
        if plan.denoise:
            batch_sizes.append(len(plan.denoise))
        results.update(output.finished)
        step += 1
        assert step < 10_000, "scripted run did not terminate"
    return results, batch_sizes
