"""A pure-Python stand-in for DiffusionEngine, for in-process API tests (no torch).

It implements the server's ``EngineClient`` (phase, facts, add_request, abort, validate_params,
stats, events; the observers as a constructor argument) and lets a test choose the outcome of each request:
finish (with "preview" events for ``partial_images``), fail, hang (never finishes), or a full
queue. Validation is the real ``SamplingParams.validate`` with the tiny model's rules. With a
``frame_step`` it is a video model: its results are (n, F, 3, H, W) seeded noise (so their
MP4s are not tiny).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from ditserve.engine.config import EngineConfig
from ditserve.engine.config.step_cache import POLICIES as STEP_CACHE_POLICIES
from ditserve.engine.errors import (
    DeadlineError,
    DitServeError,
    InvalidRequestError,
    QueueFullError,
    RequestAborted,
)
from ditserve.engine.loop.client import EngineFacts
from ditserve.engine.loop.engine import EnginePhase, EngineStats, GenerationResult, RequestEvent
from ditserve.engine.request import MAX_FRAMES, MAX_SIDE, ModelLimits


@dataclass
class FakeEngine:
    outcome: str = "finish"  # finish | fail | hang | queue_full
    phase: EnginePhase = EnginePhase.READY
    failure: str | None = None
    config: EngineConfig = field(default_factory=EngineConfig)
    observers: list[Any] = field(default_factory=list)
    aborted: list[tuple[str, str]] = field(default_factory=list)
    pixel_multiple: int = 4
    max_prompt_chars: int = 4000
    offload: dict[str, Any] | None = None  # what offload_report() returns
    pipeline: dict[str, Any] | None = None  # what pipeline_report() returns
    frame_step: int | None = None  # a video model's (Wan: 4); None: an image model
    max_side: int = MAX_SIDE  # what the model's positional table reaches
    max_frames: int = MAX_FRAMES
    adapters: Any = None  # an AdapterCatalog, when a test serves adapters
    step_cache_policies: tuple[str, ...] = STEP_CACHE_POLICIES  # what the model takes
    submitted: list[Any] = field(default_factory=list)  # every accepted request's params
    _handles: dict[str, Any] = field(default_factory=dict)
    _ids: Any = field(default_factory=itertools.count)

    @property
    def ready(self) -> bool:
        return self.phase is EnginePhase.READY

    @property
    def limits(self) -> ModelLimits:
        video = self.frame_step is not None
        return ModelLimits(pixel_multiple=self.pixel_multiple, max_side=self.max_side,
                           frame_step=self.frame_step,
                           max_frames=self.max_frames if video else 1,
                           max_prompt_chars=self.max_prompt_chars)

    def facts(self) -> EngineFacts | None:
        return EngineFacts(self.limits, device="cpu", dtype="float32") if self.ready else None

    def adapter_stats(self) -> dict[str, int]:
        loaded = len(self.adapters.entries()) if self.adapters is not None else 0
        return {"loaded": loaded, "resident": 0, "bytes": 0}

    def start(self) -> FakeEngine:
        self.phase = EnginePhase.READY
        return self

    def drain(self) -> None:
        self.phase = EnginePhase.DRAINING

    def validate_params(self, params: Any) -> Any:
        return params.validate_for(self.limits)

    def add_request(self, params: Any, *, request_id: str | None = None,
               on_event: Any = None) -> Any:
        self.validate_params(params)
        if self.outcome == "queue_full":
            raise QueueFullError("1 requests are waiting (max_queue=1)")
        if self.outcome == "deadline":
            raise DeadlineError(f"deadline_s={params.deadline_s} cannot be met: the scheduler "
                                "estimates 59.3 s", estimate_s=59.3)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._handles:
            raise InvalidRequestError("request_id", f"{rid!r} is already in use")
        handle = SimpleNamespace(request_id=rid, future=concurrent.futures.Future(),
                                 seed=params.seed or 0, submitted_at=time.monotonic(),
                                 on_event=on_event)
        self._handles[rid] = handle
        self.submitted.append(params)
        emit = on_event or (lambda event: None)
        steps = params.num_inference_steps
        emit(RequestEvent(rid, "queued", 0, steps, 0))
        if self.outcome == "finish":
            color = torch.tensor([10, 20, 30], dtype=torch.float32).view(1, 3, 1, 1) / 255
            pixels = color.expand(params.num_images, 3, params.height, params.width).contiguous()
            if self.frame_step is not None:
                noise = torch.Generator().manual_seed(params.seed or 0)
                pixels = torch.rand(params.num_images, params.num_frames, 3, params.height,
                                    params.width, generator=noise)
            for step in range(1, steps + 1):
                emit(RequestEvent(rid, "step", step, steps))
                if step in params.preview_steps:
                    emit(RequestEvent(rid, "preview", step, steps, pixels=pixels * step / steps))
            result = GenerationResult(rid, pixels, params.seed or 0, steps, 0.0, 0.01)
            emit(RequestEvent(rid, "finished", steps, steps))
            handle.future.set_result(result)
            for observer in self.observers:
                observer.on_finished(result)
        elif self.outcome == "fail":
            emit(RequestEvent(rid, "failed", error="decode failed: boom"))
            handle.future.set_exception(DitServeError(f"request {rid} failed: decode failed"))
            for observer in self.observers:
                observer.on_failed(rid, "decode failed")
        if handle.future.done():
            self._handles.pop(rid, None)  # a finished (or aborted) request frees its id
        return handle

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        handle = self._handles.pop(request_id, None)
        if handle is None or handle.future.done():
            return False
        self.aborted.append((request_id, reason))
        handle.future.set_exception(RequestAborted(f"request {request_id}: {reason}"))
        if handle.on_event is not None:
            handle.on_event(RequestEvent(request_id, "aborted", error=reason))
        return True

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0, 0, 0)

    def pipeline_report(self) -> dict[str, Any] | None:
        return self.pipeline

    def offload_report(self) -> dict[str, Any] | None:
        return self.offload

    def start_report(self) -> dict[str, Any]:
        return {"phases": {}, "start_to_ready_s": None}

    def shutdown(self, grace_seconds: float = 0.0) -> None:
        self.phase = EnginePhase.STOPPED
