"""AdapterRoom: the distinct LoRA adapters a rank's step holds, against ``--max-loras``.

The scheduler (``engine.sched.scheduler``) builds one per admission pass over the requests whose
adapters the rank's runner pins (running and paused: a paused request keeps its state and
adapters) and asks, for each waiting request, whether its adapters fit beside them. A request
that does not fit waits, in its order, like one that does not fit the work budget; the room
frees as requests end. So the runner's bank (``bank``) never holds more than ``max_loras``
adapters at once, and never has to evict one a running request uses.

A request whose adapters fit no step alone (more than ``max_loras`` stacked) is refused at
validation (``DiffusionEngine.validate_params``), so waiting always ends: with nothing held,
every valid request fits. Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from ditserve.engine.adapters.rows import AdapterKey
from ditserve.engine.request import SamplingParams


class Holder(Protocol):
    """A request as the scheduler holds it (``ScheduledRequest``)."""

    @property
    def params(self) -> SamplingParams: ...


def adapter_keys(request: Holder) -> set[AdapterKey]:
    return {ref.key for ref in request.params.loras}


class AdapterRoom:
    """The adapters held by a step's requests and the bound they stay under."""

    def __init__(self, limit: int | None, *held: Iterable[Holder]) -> None:
        """limit: the most distinct adapters at once (None: unbounded); held: the requests
        whose adapters the runner pins."""
        self.limit = limit
        self.keys: set[AdapterKey] = set()
        for requests in held:
            for request in requests:
                self.take(request)

    def fits(self, request: Holder) -> bool:
        """Whether ``request``'s adapters fit beside the held ones (always, with none held)."""
        if self.limit is None or not request.params.loras or not self.keys:
            return True
        return len(self.keys | adapter_keys(request)) <= self.limit

    def take(self, request: Holder) -> None:
        self.keys |= adapter_keys(request)
