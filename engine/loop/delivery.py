"""Delivery: how what happened to a request reaches whoever waits for it.

Called by the engine (engine.py) from its step loops and request API, outside the engine's
lock unless a method says otherwise. A request's caller learns through its handle - progress
events (``on_event``) and the resolved ``future`` - and the engine-wide observers (metrics,
the step log: the engine's constructor arguments) through ``on_step``, ``on_finished`` and
``on_failed``. A broken listener is logged and never breaks the loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from ditserve.engine.errors import DeadlineError, DitServeError, RequestAborted
from ditserve.engine.loop.results import (
    EngineObserver,
    GenerationResult,
    RequestEvent,
    RequestHandle,
)
from ditserve.engine.request import RequestStatus
from ditserve.engine.step.plan import RunnerOutput, StatusChange

log = logging.getLogger(__name__)


class Delivery:
    """Turns step outcomes into events, futures and observer calls (see module docstring)."""

    def __init__(self, observers: Sequence[EngineObserver]) -> None:
        self.observers = tuple(observers)

    def forwards(self, outputs: Sequence[RunnerOutput]) -> None:
        """Tell the observers about every denoise forward that completed in a step."""
        for out in outputs:
            if out.forward_rows:
                for observer in self.observers:
                    observer.on_step(requests=out.forward_requests, rows=out.forward_rows,
                                     seconds=out.forward_seconds, groups=out.forward_groups,
                                     tokens=out.forward_tokens)

    def queued(self, handle: RequestHandle) -> None:
        # Progress counts the steps that run (fewer from a source image at strength < 1).
        self.emit(handle, RequestEvent(handle.request_id, "queued", 0,
                                       handle.params.denoise_steps,
                                       handle.queue_position))

    def stepped(self, handle: RequestHandle, steps_done: int, total_steps: int,
                eta_s: float | None = None) -> None:
        self.emit(handle, RequestEvent(handle.request_id, "step", steps_done, total_steps,
                                       eta_s=eta_s))

    def progress(self, change: StatusChange, handle: RequestHandle | None) -> None:
        """A request stepped (the first step after a pause tells the observers how long it
        was paused), or was paused at a step boundary for a higher-priority one."""
        rid = change.request_id
        if change.status == RequestStatus.PAUSED:
            self._notify("on_preempted", rid)
            if handle is not None:
                self.emit(handle, RequestEvent(rid, "paused", change.steps_done,
                                               change.total_steps))
            return
        if change.status != RequestStatus.DENOISING:
            return
        if change.resumed_after_s is not None:
            self._notify("on_resumed", rid, change.resumed_after_s)
        if handle is not None:
            self.stepped(handle, change.steps_done, change.total_steps, change.eta_s)

    def deadline_exceeded(self, request_id: str, handle: RequestHandle | None,
                          reason: str, *, started: bool) -> None:
        """A request the scheduler stopped because it can no longer meet its deadline."""
        self._notify("on_deadline_exceeded", request_id)
        if handle is None:
            return
        self.emit(handle, RequestEvent(request_id, "failed", error=reason))
        if not handle.future.done():
            handle.future.set_exception(DeadlineError(f"request {request_id}: {reason}",
                                                      started=started))

    def _notify(self, hook: str, *args: Any) -> None:
        """Call an optional observer hook (see ``EngineObserver``) on those that have it."""
        for observer in self.observers:
            method = getattr(observer, hook, None)
            if method is not None:
                method(*args)

    def preview(self, handle: RequestHandle, step: int, pixels: Any) -> None:
        """A partial image of a running request, decoded after its ``step``."""
        self.emit(handle, RequestEvent(handle.request_id, "preview", step,
                                       handle.params.denoise_steps, pixels=pixels))

    def finished(self, handle: RequestHandle, pixels: Any, *, rank: int,
                 audio: tuple[Any, int] | None = None) -> None:
        now = time.monotonic()
        started = handle.started_at or now
        samples, rate = audio if audio is not None else (None, 0)
        result = GenerationResult(
            request_id=handle.request_id, pixels=pixels, audio=samples, audio_rate=rate,
            seed=handle.seed, num_inference_steps=handle.params.num_inference_steps,
            queue_seconds=started - handle.submitted_at,
            latency_seconds=now - handle.submitted_at, rank=rank,
        )
        steps = handle.params.denoise_steps
        self.emit(handle, RequestEvent(handle.request_id, "finished", steps, steps))
        if not handle.future.done():
            handle.future.set_result(result)
        for observer in self.observers:
            observer.on_finished(result)

    def failed(self, request_id: str, handle: RequestHandle | None, reason: str) -> None:
        """A request the runner failed (``handle`` None: no one waits for it any more)."""
        for observer in self.observers:
            observer.on_failed(request_id, reason)
        if handle is None:
            return
        self.emit(handle, RequestEvent(request_id, "failed", error=reason))
        if not handle.future.done():
            handle.future.set_exception(DitServeError(f"request {request_id} failed: {reason}"))

    def aborted(self, handle: RequestHandle, reason: str) -> None:
        if not handle.future.done():
            handle.future.set_exception(RequestAborted(f"request {handle.request_id}: {reason}"))
        self.emit(handle, RequestEvent(handle.request_id, "aborted", error=reason))

    @staticmethod
    def stopped(handle: RequestHandle, error: BaseException) -> None:
        """The engine cannot go on (its loop died): the request fails with ``error``."""
        if not handle.future.done():
            handle.future.set_exception(error)

    @staticmethod
    def emit(handle: RequestHandle, event: RequestEvent) -> None:
        if handle.on_event is None:
            return
        try:
            handle.on_event(event)
        except Exception:  # a broken listener must not break the loop
            log.exception("progress listener of %s failed", handle.request_id)
