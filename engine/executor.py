"""Executors: run one wave of StepPlans, one plan per data-parallel rank.

``LocalExecutor`` runs a single in-process ModelRunner (dp = 1). The multi-process executor
(``ditserve.engine.distributed.executor``) runs rank 0 in-process and ranks 1..N-1 in worker
processes, and keeps their weight collectives matched. The engine loop only sees this
interface, so scheduling is identical in both cases.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from ditserve.engine.config import EngineConfig
from ditserve.engine.request import SamplingParams
from ditserve.engine.scheduler import RunnerOutput, StepPlan

NewRequests = Sequence[tuple[str, SamplingParams, int]]  # (request id, params, seed)


class Executor(Protocol):
    num_ranks: int
    runner: Any  # rank 0's ModelRunner (in this process)
    # True: ranks may step at their own pace (``execute_rank``); False: only in waves.
    independent: bool

    def execute(
        self, plans: Sequence[StepPlan], new: Sequence[NewRequests]
    ) -> list[RunnerOutput]: ...
    def execute_rank(self, rank: int, plan: StepPlan, new: NewRequests) -> RunnerOutput: ...
    def offload_reports(self, *, refresh: bool = False) -> list[dict[str, Any] | None]: ...
    def shutdown(self) -> None: ...


class LocalExecutor:
    """One ModelRunner in this process."""

    num_ranks = 1
    independent = True

    def __init__(self, config: EngineConfig, *, model_dir: Path) -> None:
        from ditserve.engine.model_runner import ModelRunner

        self.runner = ModelRunner(config, model_dir=model_dir)

    def execute(
        self, plans: Sequence[StepPlan], new: Sequence[NewRequests]
    ) -> list[RunnerOutput]:
        return [self.runner.execute(plans[0], new[0])]

    def execute_rank(self, rank: int, plan: StepPlan, new: NewRequests) -> RunnerOutput:
        return self.runner.execute(plan, new)

    def offload_reports(self, *, refresh: bool = False) -> list[dict[str, Any] | None]:
        return [self.runner.offload_report()]

    def shutdown(self) -> None:
        self.runner.close()


def make_executor(config: EngineConfig, *, model_dir: Path) -> Executor:
    if config.parallel.world_size > 1:
        from ditserve.engine.distributed.executor import MultiProcessExecutor

        return MultiProcessExecutor(config, model_dir=model_dir)
    return LocalExecutor(config, model_dir=model_dir)
