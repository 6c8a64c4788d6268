"""BlockMajor: run several forwards of one model in lockstep, block by block.

A multi-shape step has one forward per shape group (requests of one token grid share a
forward). Run one after the other under layerwise offload, each forward would stream every
block again. Run block-major instead - every group through block k while k is in its device
slot, then every group through block k+1 - the weights cross PCIe once per step whatever the
mix of shapes.

How, without touching the model's code: each group's forward runs, unmodified, in its own
*lane*, a greenlet (a coroutine with its own Python stack, switched explicitly on the same OS
thread). A forward pre-hook on every block of the model's block lists (the same lists offload
streams, in call order, so block position p is p-th in streaming order) suspends the lane
before the block runs and hands the block's position to the driver. The driver always resumes
the lanes that wait at the lowest position, in group order: so all lanes that need block p run
it before any lane runs block p+1, and the code between blocks (Flux's concatenation of text
and image tokens, Wan 2.2's switch of expert) runs in each lane as written. A lane that never
reaches some blocks (a Wan 2.2 group that only needs the second expert) simply waits at its
first block until the others got there.

Why greenlets and not threads or generators: a generator can only suspend in its own frame,
not inside a hook called by diffusers' forward; threads would each have their own CUDA current
stream and autograd/inference-mode state and would need locks to keep kernels in order. Lanes
share the thread, so every kernel is queued on the same stream in exactly the order the driver
resumes the lanes - the same order a single-threaded program would queue them - and nothing
syncs the host. Thread-local torch state (inference mode) is shared by the lanes, so the driver
enters inference mode around all of them: a lane's own enter/exit then restores the same state
whatever order the lanes leave in.

Called by the model runner's grouped denoise (``engine.group_forwards``) when offload streams
the blocks; ``run`` with one forward is a plain call. The hook is inert outside ``run`` and in
other threads (it only suspends this driver's lanes).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from greenlet import greenlet
from torch import nn
from torch.utils.hooks import RemovableHandle

T = TypeVar("T")


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """What one forward gave: its ``value``, or the ``error`` it raised."""

    value: T | None = None
    error: Exception | None = None


class BlockMajor:
    """Block barriers on a model's block lists, and the driver of lockstep forwards."""

    def __init__(self, model: nn.Module, block_lists: Sequence[str]) -> None:
        self._lanes: set[greenlet] = set()
        self._handles: list[RemovableHandle] = []
        self.blocks = 0
        for name in block_lists:
            blocks = model.get_submodule(name)
            if not isinstance(blocks, nn.ModuleList):
                raise TypeError(f"{name!r} of {type(model).__name__} is not a block list "
                                f"(a ModuleList), it is a {type(blocks).__name__}")
            for block in blocks:
                # prepend: the barrier runs before any other pre-hook (offload's load and
                # repoint), so a suspended lane has not touched the block yet.
                self._handles.append(
                    block.register_forward_pre_hook(self._barrier(self.blocks), prepend=True))
                self.blocks += 1

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _barrier(self, position: int) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            lane = greenlet.getcurrent()
            if lane in self._lanes:
                assert lane.parent is not None
                lane.parent.switch(position)  # back here when the driver resumes this lane

        return hook

    def run(self, forwards: Sequence[Callable[[], T]]) -> list[Outcome[T]]:
        """Call every forward, block-major; one Outcome per forward, in order. An exception
        of one forward is its outcome (the others go on); anything that is not an
        ``Exception`` (KeyboardInterrupt) unwinds every lane and propagates."""
        if len(forwards) == 1:
            return [call(forwards[0])]
        lanes = []
        for forward in forwards:
            lane = greenlet(lambda f=forward: call(f))
            # The lane sees the caller's context variables (a fresh greenlet has none).
            lane.gr_context = contextvars.copy_context()
            lanes.append(lane)
        outcomes: list[Outcome[T] | None] = [None] * len(lanes)
        waiting: dict[int, int] = {}  # lane index -> position of the block it waits at
        self._lanes.update(lanes)
        try:
            with torch.inference_mode():
                for index in range(len(lanes)):
                    self._resume(lanes, index, waiting, outcomes)
                while waiting:
                    lowest = min(waiting.values())
                    for index in [i for i, p in sorted(waiting.items()) if p == lowest]:
                        self._resume(lanes, index, waiting, outcomes)
        finally:
            for lane in lanes:
                if not lane.dead:
                    lane.throw()  # GreenletExit: unwinds its forward (hooks' finally blocks)
            self._lanes.difference_update(lanes)
        assert all(o is not None for o in outcomes)
        return [o for o in outcomes if o is not None]

    @staticmethod
    def _resume(lanes: list[greenlet], index: int, waiting: dict[int, int],
                outcomes: list[Any]) -> None:
        value = lanes[index].switch()
        if lanes[index].dead:
            outcomes[index] = value
            waiting.pop(index, None)
        else:
            waiting[index] = value


def call(forward: Callable[[], T]) -> Outcome[T]:
    """``forward()``'s value or the Exception it raised, as an Outcome."""
    try:
        return Outcome(value=forward())
    except Exception as e:  # one group's failure is its own; the driver goes on
        return Outcome(error=e)
