"""The executor interface: what the engine loop hands the model runners per step, and back.

An executor owns the model runners of one replica, one per data-parallel rank, and runs steps
of them: ``step({rank: RankWork})`` runs each given rank's plan and returns each rank's
``RunnerOutput``. ``step_groups`` says which ranks step together: the engine runs one step
loop per group, so ranks of different groups never wait for each other.

``LocalExecutor`` (here) is one in-process ModelRunner (dp = 1). ``MultiProcessExecutor``
(``ditserve.engine.distributed.executor``) runs rank 0 in this process and the other ranks in
worker processes; ``ditserve.engine.loop.startup.make_executor`` picks one. The engine loop sees
only this interface, so scheduling is identical in both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ditserve.engine.config import RunnerConfig
from ditserve.engine.request import NewRequest
from ditserve.engine.runner.start_phases import StartTimeline
from ditserve.engine.step.plan import RunnerOutput, StepPlan


@dataclass(frozen=True)
class RankWork:
    """One rank's part of a step: its plan and the requests the plan admits (plain data: it
    crosses process boundaries)."""

    plan: StepPlan
    new: tuple[NewRequest, ...] = ()
    upcoming: tuple[NewRequest, ...] = ()  # the plan's ``upcoming``: prompts to encode ahead

    @classmethod
    def idle(cls) -> RankWork:
        return cls(StepPlan.idle())


class Executor(Protocol):
    num_ranks: int
    runner: Any  # rank 0's ModelRunner (in this process)
    # Ranks that step together, each rank in exactly one group: every rank alone when no
    # collective ties them, all of them when every weight load is a collective (DLO AllGather).
    step_groups: Sequence[tuple[int, ...]]

    def step(self, work: Mapping[int, RankWork]) -> dict[int, RunnerOutput]:
        """One step of the given ranks (whole step groups), each running its own plan."""
        ...

    def offload_reports(self, *, refresh: bool = False) -> list[dict[str, Any] | None]: ...
    def shutdown(self) -> None: ...


class LocalExecutor:
    """One ModelRunner in this process."""

    num_ranks = 1
    step_groups = ((0,),)

    def __init__(self, config: RunnerConfig, *, model_dir: Path,
                 timeline: StartTimeline | None = None) -> None:
        from ditserve.engine.runner.model_runner import ModelRunner

        self.runner = ModelRunner(config, model_dir=model_dir, timeline=timeline)

    def step(self, work: Mapping[int, RankWork]) -> dict[int, RunnerOutput]:
        own = work[0]
        return {0: self.runner.execute(own.plan, own.new, upcoming=own.upcoming)}

    def offload_reports(self, *, refresh: bool = False) -> list[dict[str, Any] | None]:
        return [self.runner.offload_report()]

    def shutdown(self) -> None:
        self.runner.close()
