"""Scheduling policy: the order of admission, and whom to pause.

Pure Python (no torch), called only by ``StepScheduler`` (engine/sched/scheduler.py), which owns the
request lifecycle; this module only decides. Two policies (``SchedulerConfig.scheduling_policy``),
two strategies behind one ``AdmissionOrder`` protocol, so the scheduler runs one admission
loop and never asks which policy it has:

- ``fcfs`` (``ArrivalOrder``): arrival order with the scheduler's bounded bypass; ``priority``
  is ignored and nothing is ever paused (the behaviour before priorities existed).
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

How long the work will take is ``engine.sched.deadlines``' (it asks ``ahead_of`` here who goes first).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

FCFS = "fcfs"
PRIORITY = "priority"


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


class AdmissionOrder(Protocol):
    """What the scheduler asks its policy: who goes first, whom to pause, who is ahead."""

    def order(self, requests: Iterable[Q], now: float) -> list[Q]: ...

    def victims(self, running: Sequence[Q], candidate: Queued, *,
                tokens_short: int, slots_short: int) -> list[Q] | None: ...

    def ahead_of(self, new: Queued, running: Iterable[Q], queued: Iterable[Q],
                 now: float) -> list[Q]: ...

    def key_of_new(self, priority: int, deadline_s: float | None, arrived_at: float,
                   now: float) -> tuple[float, ...]: ...


@dataclass(frozen=True)
class ArrivalOrder:
    """The ``fcfs`` policy: arrival order, nobody is ever paused, everything held goes first."""

    def order(self, requests: Iterable[Q], now: float) -> list[Q]:
        return sorted(requests, key=lambda r: r.arrival)

    def victims(self, running: Sequence[Q], candidate: Queued, *,
                tokens_short: int, slots_short: int) -> list[Q] | None:
        return None

    def ahead_of(self, new: Queued, running: Iterable[Q], queued: Iterable[Q],
                 now: float) -> list[Q]:
        return [*running, *queued]

    def key_of_new(self, priority: int, deadline_s: float | None, arrived_at: float,
                   now: float) -> tuple[float, ...]:
        # Every request ties: ``min`` over the replica's shared queue (kept in arrival order)
        # then picks the oldest.
        return ()


def admission_order(policy: str, *, aging_s: float, max_preemptions: int) -> AdmissionOrder:
    """The strategy of a ``scheduling_policy`` value."""
    if policy == PRIORITY:
        return PriorityOrder(aging_s, max_preemptions)
    return ArrivalOrder()


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

    def key_of_new(self, priority: int, deadline_s: float | None, arrived_at: float,
                   now: float) -> tuple[int, float, float]:
        """The key of a request not scheduled yet (the replica's shared queue), with its
        arrival time as the last tie-break."""
        waited = max(0.0, now - arrived_at)
        deadline = math.inf if deadline_s is None else arrived_at + deadline_s
        return (priority - int(waited // self.aging_s), deadline, arrived_at)

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

    def ahead_of(self, new: Queued, running: Iterable[Q], queued: Iterable[Q],
                 now: float) -> list[Q]:
        """The requests that go before ``new``: running ones it may not pause (priority not
        worse than its own) and queued ones earlier in the order."""
        key = self.key(new, now)
        return [*(r for r in running if r.priority <= new.priority),
                *(r for r in queued if self.key(r, now) < key)]
