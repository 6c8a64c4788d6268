"""Deadlines: the measured step time and the finish estimate the scheduler judges them by.

Pure Python (no torch), used by ``StepScheduler``. The scheduler measures the wall time
between consecutive busy steps with its own clock (``StepClock``, an exponential average:
encode, decode and host work included, which is what a client waits for). A new request's
finish (``finish_steps``) is a fluid model of the replica - it drains ``max_batch_tokens``
rows x tokens per step - over the work that goes before it (by the policy), but never sooner
than its own steps. A held request is late (``late_by``) when now + its remaining steps at the
measured step time is past its deadline: a lower bound on its finish, so a request that could
still make it is never stopped; until a step time is measured only a passed deadline counts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from ditserve.engine.sched.policy import Queued

# Weight of the newest step in the step-time average: about the last ten steps count.
STEP_EMA = 0.2


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


def late_by(request: Queued, now: float, step_s: float | None) -> str | None:
    """Why ``request`` can no longer meet its deadline, or None if it still can (or has
    none)."""
    deadline = request.deadline_at
    if deadline is None:
        return None
    step_s = step_s or 0.0
    finish = now + request.remaining_steps * step_s
    if finish <= deadline:
        return None
    return (f"deadline_exceeded: {deadline - request.arrived_at:g} s cannot be met: "
            f"{request.remaining_steps} steps left at {step_s:.3f} s/step would finish "
            f"{finish - request.arrived_at:.1f} s after arrival")
