"""Scheduling policy: the order of admission, whom to pause, and how long the work will take.

Pure Python (no torch), called only by ``StepScheduler`` (engine/scheduler.py), which owns the
request lifecycle; this module only decides. Two policies (``SchedulerConfig.scheduling_policy``):

- ``fcfs``: arrival order with the scheduler's bounded bypass; ``priority`` is ignored and
  nothing is ever paused (the behaviour before priorities existed).
- ``priority``: waiting and paused requests are admitted by the key
  (effective priority, absolute deadline, arrival), lower first, still with the bounded bypass
  for a request that does not fit the room left. Aging: every ``aging_s`` seconds a request
  has waited since it arrived (paused time included) lowers its effective priority by one
  level. So a request of priority p is ordered as a request of priority q < p that arrived
  (p - q) x ``aging_s`` seconds later: no request arriving that much after it ever goes first,
  and a steady stream of higher-priority work cannot starve it (its wait is bounded by the
  work that arrived in that window, and from the head of the order by the bounded bypass). When the head of the order cannot be admitted for lack of room, the
  lowest-priority running requests (latest arrival first among equals) are paused at this step
  boundary to make room, if and only if that makes it fit: only requests of strictly worse
  base priority, never one in its last step, never one admitted or resumed in the same pass,
  and never one already paused ``max_preemptions`` times.

The estimate (``StepClock``, ``finish_steps``): the scheduler measures the wall time between
consecutive busy steps with its clock (an exponential average: encode, decode and host work
included, which is what a client waits for); a request's finish is a fluid model of the
replica - it drains ``max_batch_tokens`` rows x tokens per step - over the work ahead of it,
but never sooner than its own remaining steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

FCFS = "fcfs"
PRIORITY = "priority"
# Weight of the newest step in the step-time average: about the last ten steps count.
STEP_EMA = 0.2


class Queued(Protocol):
    """What a policy reads of a scheduled request (``scheduler.ScheduledRequest``)."""

    @property
    def priority(self) -> int: ...
    @property
    def deadline_at(self) -> float | None: ...
    @property
    def arrival(self) -> int: ...
    @property
    def arrived_at(self) -> float: ...
    @property
    def tokens(self) -> int: ...
    @property
    def remaining_steps(self) -> int: ...
    @property
    def times_paused(self) -> int: ...


Q = TypeVar("Q", bound=Queued)


@dataclass(frozen=True)
class PriorityOrder:
    """Admission order and preemption choice of the ``priority`` policy (module docstring)."""

    aging_s: float
    max_preemptions: int

    def effective_priority(self, request: Queued, now: float) -> int:
        waited = max(0.0, now - request.arrived_at)
        return request.priority - int(waited // self.aging_s)

    def key(self, request: Queued, now: float) -> tuple[int, float, int]:
        deadline = request.deadline_at if request.deadline_at is not None else math.inf
        return (self.effective_priority(request, now), deadline, request.arrival)

    def order(self, requests: Iterable[Q], now: float) -> list[Q]:
        return sorted(requests, key=lambda r: self.key(r, now))

    def victims(self, running: Sequence[Q], candidate: Queued, *,
                           tokens_short: int, slots_short: int) -> list[Q] | None:
        """The running requests to pause so that ``candidate`` fits (they must free
        ``tokens_short`` tokens and ``slots_short`` slots), or None when pausing the eligible
        ones would not be enough (then nobody is paused)."""
        eligible = [r for r in running if r.priority > candidate.priority
                    and r.times_paused < self.max_preemptions and r.remaining_steps > 1]
        # Worst priority first; among equals the latest arrival (it has done the least).
        eligible.sort(key=lambda r: (-r.priority, -r.arrival))
        chosen: list[Q] = []
        for request in eligible:
            if tokens_short <= 0 and slots_short <= 0:
                break
            chosen.append(request)
            tokens_short -= request.tokens
            slots_short -= 1
        return chosen if tokens_short <= 0 and slots_short <= 0 else None


class StepClock:
    """The measured period of a busy step (seconds), from the scheduler's own clock."""

    def __init__(self) -> None:
        self.step_s: float | None = None
        self._busy_since: float | None = None

    def tick(self, now: float, busy: bool) -> None:
        """A step is planned at ``now``; ``busy``: it denoises something. The time since the
        previous busy step's plan is one step period."""
        if self._busy_since is not None:
            sample = now - self._busy_since
            self.step_s = sample if self.step_s is None \
                else (1 - STEP_EMA) * self.step_s + STEP_EMA * sample
        self._busy_since = now if busy else None


def finish_steps(own: Queued, ahead: Iterable[Queued], budget: int) -> int:
    """Steps until ``own`` finishes when ``ahead`` go before it (see module docstring).

    A request larger than the budget runs alone: it counts as one budget per step."""
    work = sum(min(r.tokens, budget) * r.remaining_steps for r in ahead)
    work += min(own.tokens, budget) * own.remaining_steps
    return max(own.remaining_steps, math.ceil(work / budget))
