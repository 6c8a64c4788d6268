"""InFlightSteps: how far the step loop runs ahead of the GPU, and what finished steps yield.

On CUDA a step's kernels are queued, not run, so without a bound the loop would race ahead of
the GPU by any number of steps: progress events would announce steps that have not run, the
step-time metric would time how fast Python queues kernels, and aborts would take effect late.
Syncing after every step bounds it, but leaves the GPU idle while the host prepares the next
step (with layerwise offload the copy engine idles too). So the runner keeps one step queued
behind the one the GPU is running: after queueing step N it waits for step N-1's fence.

A step's decodes are copied to pinned host memory without a sync and handed back once that
step's fence has passed: one step later on CUDA, at once on the CPU (nothing is queued there).
Each forward is timed with CUDA events, so the reported step time is GPU time. So are the
step's other parts (``timed_part``: the admitted prompts' encode, the finished requests'
decode), with the host's time queuing them beside: at DEBUG, each completed step logs them, so
time between forwards can be named (issue 47's priority run lost 0.3-1.9 s at a time there).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclass
class CompletedStep:
    """A step whose GPU work has finished: its decoded outputs and its forward, if it ran one."""

    decodes: dict[str, Any] = field(default_factory=dict)
    audio: dict[str, tuple[Any, int]] = field(default_factory=dict)  # sound tracks, with rate
    requests: int = 0
    rows: int = 0
    groups: int = 0  # shape groups: one forward each
    tokens: int = 0  # work: rows x tokens
    seconds: float = 0.0


class Span:
    """A stretch of the open step's queued work, timed as the rest of the step is: between two
    CUDA events on the current stream on a GPU (read once the step has completed), by the wall
    clock on the CPU (where nothing is queued)."""

    def __init__(self, device: torch.device) -> None:
        self._stream: Any = None
        self._events: tuple[Any, Any] | None = None
        if device.type == "cuda":
            self._stream = torch.cuda.current_stream(device)
            self._events = (torch.cuda.Event(enable_timing=True),
                            torch.cuda.Event(enable_timing=True))
            self._events[0].record(self._stream)
        self._started = time.perf_counter()
        self.host_s = 0.0  # the host's time queuing it (set by ``end``)

    def end(self) -> Span:
        self.host_s = time.perf_counter() - self._started
        if self._events is not None:
            self._events[1].record(self._stream)
        return self

    def seconds(self) -> float:
        """GPU seconds; call once the step has completed (its fence passed)."""
        if self._events is None:
            return self.host_s
        return float(self._events[0].elapsed_time(self._events[1])) / 1000.0


@dataclass
class StepPart:
    """A part of a step besides its forward: what, for how many requests, and its span."""

    name: str
    count: int
    span: Span

    def describe(self) -> str:
        return (f"{self.name} {self.count} in {1e3 * self.span.seconds():.1f} ms "
                f"(host {1e3 * self.span.host_s:.1f} ms)")


@dataclass
class _QueuedStep:
    result: CompletedStep = field(default_factory=CompletedStep)
    forward: Span | None = None  # the step's forwards, queued
    fence: Any = None  # CUDA event recorded after everything the step queued
    queued_work: bool = False
    parts: list[StepPart] = field(default_factory=list)


class InFlightSteps:
    """The runner's open step and its queued ones; see the module docstring."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._cuda = device.type == "cuda"
        self._open = _QueuedStep()
        self._queued: deque[_QueuedStep] = deque()
        self._forward: Span | None = None

    @property
    def num_queued(self) -> int:
        """Closed steps whose GPU work may not have finished yet."""
        return len(self._queued)

    # -- building the open step -----------------------------------------------------------------
    def forward_started(self) -> None:
        self._open.queued_work = True
        self._forward = Span(self._device)

    def forward_ended(self, *, requests: int, rows: int, groups: int = 1,
                      tokens: int = 0) -> None:
        """The step's forwards are queued: ``groups`` of them over ``requests`` requests,
        ``rows`` rows and ``tokens`` rows x tokens."""
        step = self._open
        step.result.requests, step.result.rows = requests, rows
        step.result.groups, step.result.tokens = groups, tokens
        assert self._forward is not None, "forward_ended without forward_started"
        step.forward, self._forward = self._forward.end(), None

    @contextlib.contextmanager
    def timed_part(self, name: str, count: int) -> Iterator[None]:
        """Time the body as a part of the open step (``count`` requests); nothing when 0.
        Only where DEBUG logging is on: recording events costs a little every step."""
        if not count or not log.isEnabledFor(logging.DEBUG):
            yield
            return
        span = Span(self._device)
        yield
        self._open.parts.append(StepPart(name, count, span.end()))

    def work_queued(self) -> None:
        """The open step queued GPU work that is not a forward (a collective-only pass)."""
        self._open.queued_work = True

    def add_decode(self, request_id: str, output: Any, audio: Any = None,
                   audio_rate: int = 0) -> None:
        """``output`` (and ``audio``, a sound track of ``audio_rate`` samples/s) is valid on
        the host once the step it was queued in has completed."""
        self._open.queued_work = True
        self._open.result.decodes[request_id] = output
        if audio is not None:
            self._open.result.audio[request_id] = (audio, audio_rate)

    def forget(self, request_id: str) -> None:
        """Drop a request's pending decode (it was aborted): it is never handed back."""
        for step in (self._open, *self._queued):
            step.result.decodes.pop(request_id, None)
            step.result.audio.pop(request_id, None)

    # -- closing ----------------------------------------------------------------------------------
    def close(self) -> list[CompletedStep]:
        """Close the open step; return the steps that completed, oldest first.

        Waits until at most one step is still queued, or none when this step queued nothing
        (an idle loop iteration flushes, so the last request's pixels are not held back).
        """
        step, self._open = self._open, _QueuedStep()
        if self._cuda:
            step.fence = torch.cuda.Event(blocking=True)  # the waiting thread sleeps
            step.fence.record(torch.cuda.current_stream(self._device))
        self._queued.append(step)
        keep = 1 if self._cuda and step.queued_work else 0
        completed = []
        while len(self._queued) > keep:
            done = self._queued.popleft()
            if done.fence is not None:
                done.fence.synchronize()  # releases the GIL
            if done.forward is not None:
                done.result.seconds = done.forward.seconds()
            if done.parts:
                log.debug("step parts besides the forward: %s",
                          ", ".join(part.describe() for part in done.parts))
            completed.append(done.result)
        return completed
