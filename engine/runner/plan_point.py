"""PlanPoint: how far the running step must be on the GPU before the loop plans the next one.

The runner keeps one step queued behind the running one (``InFlightSteps``), so the loop plans
step N+1 as soon as step N starts on the GPU. A request that arrives while N runs is then
first planned into N+2: it waits for the rest of N and all of N+1, 1.5 steps on average and
up to 2 - on a compute-bound model at full batch, 1-2 s before an urgent request's first step.

With ``scheduler.plan_at`` f > 0 (``--plan-at``) the loop plans N+1 only once N's forward has
reached the DiT block a fraction f into its blocks: a pre-hook on that block records a CUDA
event as the step is queued, and the loop waits on it (releasing the interpreter) before
planning. An arrival in the first f of step N then joins N+1, and waits 1.5 - f steps on
average (2 - f at worst). The price: the host must plan and queue N+1 within the last 1 - f
of N, or the GPU waits for it (the step log's DEBUG lines show such gaps). Under block-major
shape groups the block runs once per group, the last recording wins; a step whose forward
skips the block (step caching) or runs none does not wait. CUDA only: on the CPU nothing is
queued ahead, so there is nothing to wait for. The loop that steps rank 0 waits on rank 0's
point (the runner in the engine's process); with data parallelism the other ranks' own loops
plan as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn


class PlanPoint:
    """The plan-point hook on one DiT block and the wait on its latest event."""

    def __init__(self, model: nn.Module, block_lists: Sequence[str], fraction: float, *,
                 device: torch.device, compiled: bool = False,
                 make_event: Callable[[], Any] | None = None) -> None:
        """fraction: 0 (or a CPU device): no hook, ``wait`` returns at once. compiled: the
        blocks are torch.compile'd, so the hook is kept out of their graphs. make_event: the
        event to record (tests); a blocking CUDA event by default."""
        self._event: Any = None
        self._handle: Any = None
        self.block_index: int | None = None
        if fraction <= 0 or (device.type != "cuda" and make_event is None):
            return
        blocks: list[nn.Module] = []
        for name in block_lists:
            blocks.extend(cast(nn.ModuleList, model.get_submodule(name)))
        if not blocks:
            return
        self._make_event = make_event or (lambda: torch.cuda.Event(blocking=True))
        self.block_index = min(len(blocks) - 1, int(fraction * len(blocks)))
        hook: Callable[..., None] = self._mark
        if compiled:  # record outside the compiled region (a graph break before the block)
            hook = torch.compiler.disable(hook)
        self._handle = blocks[self.block_index].register_forward_pre_hook(hook)

    @property
    def active(self) -> bool:
        return self._handle is not None

    def _mark(self, module: nn.Module, args: Any) -> None:
        event = self._make_event()
        event.record()  # on the current stream, behind the blocks queued before this one
        self._event = event

    def wait(self) -> None:
        """Block until the GPU has reached the latest plan point queued (once per point)."""
        event, self._event = self._event, None
        if event is not None:
            event.synchronize()  # a blocking event: the thread sleeps, the GIL is released

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
