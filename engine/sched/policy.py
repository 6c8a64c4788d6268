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
  and never one already paused ``max_preemptions`` times. With ``urgent_companions`` K, a
  step holding an urgent request (priority below 0) holds at most K rows of other requests
  beside it: others wait, and running ones beyond K are paused when it is admitted (the same
  eligibility rules), so an urgent request runs at close to its idle latency.

How long the work will take is ``engine.sched.deadlines``' (it asks ``ahead_of`` here who goes first).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

FCFS = "fcfs"
PRIORITY = "priority"
URGENT_BELOW = 0  # a priority below the default is urgent (``urgent_companions``)


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
    @property
    def request_id(self) -> str: ...
    @property
    def rows(self) -> int: ...


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

    def companion_fits(self, running: Iterable[Q], request: Queued) -> bool: ...

    def excess_companions(self, running: Iterable[Q], admitted: Queued,
                          joined: set[str]) -> list[Q]: ...


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

    def companion_fits(self, running: Iterable[Q], request: Queued) -> bool:
        return True  # no request is urgent under arrival order

    def excess_companions(self, running: Iterable[Q], admitted: Queued,
                          joined: set[str]) -> list[Q]:
        return []


def admission_order(config: Any) -> AdmissionOrder:
    """The strategy of a ``SchedulerConfig``'s ``scheduling_policy``."""
    if config.scheduling_policy == PRIORITY:
        return PriorityOrder.of(config)
    return ArrivalOrder()
def is_urgent(request: Queued) -> bool:
    """Whether a request is urgent: ``SchedulerConfig.urgent_companions`` bounds the rows of
    other requests a step holds beside it."""
    return request.priority < URGENT_BELOW


@dataclass(frozen=True)
class PriorityOrder:
    """Admission order and preemption choice of the ``priority`` policy (module docstring)."""

    aging_s: float
    max_preemptions: int
    urgent_companions: int | None = None  # rows beside an urgent request (None: unbounded)

    @classmethod
    def of(cls, config: Any) -> PriorityOrder:
        """The order of a ``SchedulerConfig`` (its aging, pause limit and urgent bound)."""
        return cls(config.aging_s, config.max_preemptions, config.urgent_companions)

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

    # -- urgent requests (``urgent_companions``) --------------------------------------------
    def _companion_rows(self, running: Iterable[Q]) -> int | None:
        """Rows of the non-urgent running requests while an urgent one runs and the bound is
        set; None when there is nothing to bound."""
        held = list(running)
        if self.urgent_companions is None or not any(is_urgent(r) for r in held):
            return None
        return sum(r.rows for r in held if not is_urgent(r))

    def companion_fits(self, running: Iterable[Q], request: Queued) -> bool:
        """Whether ``request`` may join the running batch beside its urgent requests."""
        rows = self._companion_rows(running)
        return (is_urgent(request) or rows is None or self.urgent_companions is None
                or rows + request.rows <= self.urgent_companions)

    def excess_companions(self, running: Iterable[Q], admitted: Queued,
                          joined: set[str]) -> list[Q]:
        """After ``admitted`` joined the batch: the non-urgent running requests to pause so
        the rows beside an urgent request fit the bound (worst priority, latest arrival
        first; never one that joined this pass, is in its last step or was paused
        ``max_preemptions`` times). Empty unless ``admitted`` is urgent."""
        held = list(running)
        rows, limit = self._companion_rows(held), self.urgent_companions
        if not is_urgent(admitted) or rows is None or limit is None or rows <= limit:
            return []
        eligible = [r for r in held if not is_urgent(r) and r.request_id not in joined
                    and r.remaining_steps > 1 and r.times_paused < self.max_preemptions]
        eligible.sort(key=lambda r: (-r.priority, -r.arrival))
        chosen: list[Q] = []
        for request in eligible:
            if rows <= limit:
                break
            chosen.append(request)
            rows -= request.rows
        return chosen
