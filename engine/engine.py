"""DiffusionEngine: the background step loop and the thread-safe request API.

Owns one StepScheduler per data-parallel rank and an Executor (the model runners) and drives
them in waves: every rank's ``schedule -> execute -> update``, one step per iteration, on a
dedicated thread (torch releases the GIL in kernels, so HTTP handlers stay responsive). Each
DP rank has its own continuous batch. With several ranks, new requests wait in one shared
queue and go, oldest first, to the least-loaded rank that has a free batch slot.

Callers submit from any thread (``add_request`` returns a handle with a concurrent Future) or
from asyncio (``await generate(...)``). Per-request progress events and engine-wide observers
(metrics) are called from the loop thread. The types it hands back live in ``results``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ditserve.engine.config import EngineConfig, validate
from ditserve.engine.errors import (
    DitServeError,
    EngineStoppedError,
    InvalidRequestError,
    QueueFullError,
    RequestAborted,
)
from ditserve.engine.rank_queues import RankQueues
from ditserve.engine.request import RequestStatus, SamplingParams
from ditserve.engine.results import (
    EngineObserver,
    EngineStats,
    GenerationResult,
    RequestEvent,
    RequestHandle,
)
from ditserve.engine.scheduler import StatusChange, StepPlan, StepScheduler

# How long an independent rank's worker may sit idle before the engine pings it.
HEARTBEAT_S = 2.0

__all__ = [
    "DiffusionEngine", "EngineObserver", "EngineStats", "GenerationResult", "RequestEvent",
    "RequestHandle",
]

log = logging.getLogger(__name__)


class DiffusionEngine:
    """The engine of one replica. ``start()`` loads the model; ``shutdown()`` drains and stops."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        observers: list[EngineObserver] | None = None,
    ) -> None:
        self.config = validate(config)
        self.observers = list(observers or [])
        self.queues = RankQueues(config.scheduler, config.parallel.data_parallel_size)
        self.executor: Any = None
        self.model_dir: Path | None = None
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._handles: dict[str, RequestHandle] = {}
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._accepting = False
        self._loop_error: BaseException | None = None
        self._steps_run = 0
        self._rows_run = 0
        self._finished = 0
        self.ready = False
        # With config.compile: also warm up (compile) at this (height, width) before ready.
        # The HTTP server sets its default size; None skips it (the first requests compile).
        self.compile_warmup_size: tuple[int, int] | None = None
        self.compiling = False  # True while the warm-up compiles the blocks (before ready)

    @property
    def schedulers(self) -> list[StepScheduler]:
        """One StepScheduler per data-parallel rank."""
        return self.queues.schedulers

    @property
    def scheduler(self) -> StepScheduler:
        """Rank 0's scheduler (the only one when data_parallel_size is 1)."""
        return self.schedulers[0]

    @property
    def runner(self) -> Any:
        """Rank 0's ModelRunner, in this process."""
        return self.executor.runner if self.executor is not None else None

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> DiffusionEngine:
        """Load the model (blocking), run one warm-up step, start the step loop."""
        from ditserve.engine.executor import make_executor
        from ditserve.engine.tiny_model import ensure_tiny

        if self.config.model is None:
            self.model_dir = ensure_tiny()
            log.warning("no --model given: serving the embedded tiny model (random weights) "
                        "from %s", self.model_dir)
        else:
            self.model_dir = Path(self.config.model)
        self.executor = make_executor(self.config, model_dir=self.model_dir)
        try:
            self._warmup()
        except BaseException:
            self.executor.shutdown()
            raise
        self._accepting = True
        self._start_loops()
        self.ready = True
        return self

    def _warmup(self) -> None:
        # One real step through every stage on every rank, so the first request does not pay
        # for lazy initialization (and every rank proves it can run).
        multiple = self.pixel_multiple
        self._warm_step(multiple * 2, multiple * 2, requests=1)
        size = self.compile_warmup_size
        if self.config.compile is None or size is None:
            return
        # Compiled blocks recompile when a shape first changes: the token count (resolution),
        # then the batch (a batch of 1 is always its own graph). Three warm-up steps leave a
        # graph for batch 1 and one for any larger batch, both for any resolution, so no
        # request after /ready waits for a compile.
        height, width = size
        log.info("--compile: compiling the DiT blocks for %dx%d before ready (can take minutes)",
                 width, height)
        self.compiling = True  # /ready says "compiling" rather than "loading" meanwhile
        try:
            self._warm_step(height, width, requests=1)
            if self.config.scheduler.max_num_seqs > 1:
                self._warm_step(height, width, requests=2)
        finally:
            self.compiling = False

    def _warm_step(self, height: int, width: int, *, requests: int) -> None:
        """One one-step wave with ``requests`` requests per rank, waited for and checked."""
        params = SamplingParams(prompt="warm up", height=height, width=width,
                                num_inference_steps=1, seed=0)
        plans, new = [], []
        for rank in range(self.executor.num_ranks):
            scheduler = StepScheduler(self.config.scheduler)
            ids = [f"warmup-{rank}-{i}" for i in range(requests)]
            for rid in ids:
                scheduler.add(rid, params)
            plans.append(scheduler.schedule())
            new.append([(rid, params, 0) for rid in ids])
        outputs = self.executor.execute(plans, new)
        # An empty wave waits for what the first one queued (decoded pixels come back late on
        # a GPU), so the warm-up covers the whole request path, the hand-back included.
        idle = [StepPlan(step_id=-1) for _ in plans]
        flushed = self.executor.execute(idle, [[] for _ in plans])
        for rank, (out, late) in enumerate(zip(outputs, flushed, strict=True)):
            failed = {**out.failed, **late.failed}
            if failed:
                raise DitServeError(f"warm-up step failed on rank {rank}: {failed}")
            missing = {rid for rid, *_ in new[rank]} - {**out.finished, **late.finished}.keys()
            if missing:
                raise DitServeError(f"warm-up step on rank {rank} returned no image for "
                                    f"{', '.join(sorted(missing))}")

    def stop_accepting(self) -> None:
        """New requests are refused from now on; running and queued ones continue."""
        with self._lock:
            self._accepting = False
            self.ready = False

    def shutdown(self, grace_seconds: float = 0.0) -> None:
        """Stop admitting, let work finish for up to ``grace_seconds``, abort the rest, stop."""
        self.stop_accepting()
        deadline = time.monotonic() + grace_seconds
        with self._lock:
            while self._handles and time.monotonic() < deadline and self._loop_alive():
                self._wakeup.wait(timeout=min(0.05, max(0.0, deadline - time.monotonic())))
            for rid in list(self._handles):
                self._abort_locked(rid, "engine shut down")
            self._stopping = True
            self._wakeup.notify_all()
        for thread in self._threads:
            thread.join(timeout=60)
        if self.executor is not None:
            self.executor.shutdown()

    def _loop_alive(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)

    # -- properties used by the API layer ---------------------------------------------------
    @property
    def pixel_multiple(self) -> int:
        return int(self.runner.pixel_multiple) if self.runner else 16

    @property
    def max_prompt_chars(self) -> int | None:
        return self.runner.max_prompt_chars if self.runner else None

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(
                self.queues.num_running, self.queues.num_waiting,
                self._steps_run, self._rows_run, self._finished, len(self.schedulers),
            )

    def queue_position(self, request_id: str) -> int | None:
        with self._lock:
            return self.queues.queue_position(request_id)

    def offload_report(self, *, refresh: bool = False) -> dict[str, Any] | None:
        """Rank 0's offload report, with every rank's under ``ranks`` when there are several.

        Other ranks' reports are cached (refreshed every few seconds while busy);
        ``refresh=True`` fetches fresh ones, waiting for the current step to end.
        """
        if self.executor is None:
            return None
        reports = self.executor.offload_reports(refresh=refresh)
        if reports[0] is None:
            return None
        report = dict(reports[0])
        if len(reports) > 1:
            report["ranks"] = reports
        return report

    # -- requests ---------------------------------------------------------------------------
    def validate_params(self, params: SamplingParams) -> SamplingParams:
        return params.validate(pixel_multiple=self.pixel_multiple,
                               max_prompt_chars=self.max_prompt_chars,
                               frame_step=self.runner.frame_step if self.runner else None)

    def add_request(
        self,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        on_event: Callable[[RequestEvent], None] | None = None,
    ) -> RequestHandle:
        """Validate and enqueue; raises InvalidRequestError, QueueFullError, EngineStoppedError."""
        self.validate_params(params)
        rid = request_id or uuid.uuid4().hex
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        handle = RequestHandle(rid, params, seed, concurrent.futures.Future(), self, on_event)
        with self._lock:
            if self._loop_error is not None:
                raise EngineStoppedError(f"the engine loop died: {self._loop_error}")
            if not self._accepting:
                raise EngineStoppedError("the engine is not accepting requests (starting or "
                                         "shutting down)")
            if rid in self._handles:
                raise InvalidRequestError("request_id", f"{rid!r} is already in use")
            limit = self.config.scheduler.max_queue
            if limit is not None and self.queues.is_full(limit):
                raise QueueFullError(f"every batch slot is taken and {limit} requests are "
                                     f"waiting (max_queue={limit})")
            self.queues.add(rid, params)
            self._handles[rid] = handle
            position = handle.queue_position = self.queues.queue_position(rid)
            self._wakeup.notify_all()
        self._emit(handle, RequestEvent(rid, "queued", 0, params.num_inference_steps, position))
        return handle

    async def generate(
        self,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        on_event: Callable[[RequestEvent], None] | None = None,
    ) -> GenerationResult:
        """Async form of add_request + wait; cancelling the awaiting task aborts the request."""
        handle = self.add_request(params, request_id=request_id, on_event=on_event)
        try:
            return await asyncio.wrap_future(handle.future)
        except asyncio.CancelledError:
            self.abort(handle.request_id)
            raise

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Abort a request; a running one frees its batch slot at the next step boundary."""
        with self._lock:
            return self._abort_locked(request_id, reason)

    def _abort_locked(self, request_id: str, reason: str) -> bool:
        handle = self._handles.pop(request_id, None)
        if handle is None:
            return False
        self.queues.remove(request_id)  # a running request is freed at its next step
        self._wakeup.notify_all()
        if not handle.future.done():
            handle.future.set_exception(RequestAborted(f"request {request_id}: {reason}"))
        self._emit(handle, RequestEvent(request_id, "aborted", error=reason))
        return True

    # -- the loop ---------------------------------------------------------------------------
    def _start_loops(self) -> None:
        """One loop over all ranks (waves), or one loop per rank when ranks are independent."""
        independent = self.executor.independent and self.executor.num_ranks > 1
        groups = ([[r] for r in range(self.executor.num_ranks)] if independent
                  else [list(range(self.executor.num_ranks))])
        self._threads = [
            threading.Thread(target=self._run_loop, args=(ranks,), daemon=True,
                             name=f"ditserve-engine-{'-'.join(map(str, ranks))}")
            for ranks in groups
        ]
        for thread in self._threads:
            thread.start()

    def _run_loop(self, ranks: list[int]) -> None:
        """Drive ``ranks``: all of them in waves, or a single rank at its own pace."""
        wave = len(ranks) == self.executor.num_ranks
        # An idle worker of an independent rank is pinged, so a dead or hung one fails the
        # replica within HEARTBEAT_S + the worker timeout, not at the next request.
        pings = not wave and ranks[0] > 0
        try:
            while True:
                work = self._wait_for_work(ranks, heartbeat_s=HEARTBEAT_S if pings else None)
                if work is None:
                    return
                if not work:
                    self.executor.execute_rank(ranks[0], StepPlan(step_id=-1), [])
                    continue
                plans, new = self._begin_step(ranks)
                if wave:
                    outputs = self.executor.execute(plans, new)
                else:
                    outputs = [self.executor.execute_rank(ranks[0], plans[0], new[0])]
                self._end_step(ranks, plans, outputs)
        except BaseException as e:  # a loop must never die silently
            log.exception("engine loop died")
            with self._lock:
                if self._loop_error is None:
                    self._loop_error = e
                self._stopping = True  # the replica cannot continue: stop the other loops
                self.ready = False
                self._accepting = False
                self.queues.clear()
                for rid in list(self._handles):
                    handle = self._handles.pop(rid)
                    if not handle.future.done():
                        handle.future.set_exception(
                            EngineStoppedError(f"the engine loop died: {e}"))
                self._wakeup.notify_all()

    def _wait_for_work(self, ranks: list[int], *, heartbeat_s: float | None) -> bool | None:
        """True: ``ranks`` have work; False: idle for ``heartbeat_s``; None: stopping."""
        with self._lock:
            idle_since = time.monotonic()
            while not self._stopping and not self.queues.has_work(ranks):
                if heartbeat_s is None:
                    self._wakeup.wait()
                    continue
                # Measured from idle_since: other loops' notifications must not postpone it.
                remaining = heartbeat_s - (time.monotonic() - idle_since)
                if remaining <= 0:
                    return False
                self._wakeup.wait(timeout=remaining)
            return None if self._stopping else True

    def _begin_step(self, ranks: list[int]) -> tuple[list[StepPlan], list[list[Any]]]:
        """Schedule one step of ``ranks``; returns their plans and admitted requests."""
        with self._lock:
            self.queues.release()
            self._wakeup.notify_all()  # released requests may be another loop's work
            plans = [self.schedulers[r].schedule() for r in ranks]
            now = time.monotonic()
            new = []
            for plan in plans:
                admitted = []
                for rid in plan.encode:
                    handle = self._handles.get(rid)
                    if handle is not None:  # not aborted meanwhile
                        handle.started_at = now
                        admitted.append((rid, handle.params, handle.seed))
                new.append(admitted)
        return plans, new

    def _end_step(self, ranks: list[int], plans: list[StepPlan], outputs: list[Any]) -> None:
        """Apply a step's outputs: statuses, stats, observers, results and progress events."""
        with self._lock:
            changes = [c for r, plan, out in zip(ranks, plans, outputs, strict=True)
                       for c in self.schedulers[r].update(plan, out)]
            rows = sum(out.forward_rows for out in outputs)
            if rows:
                self._steps_run += 1
                self._rows_run += rows
            self.queues.release()
            self._wakeup.notify_all()
            moved = self._moved_in_queue_locked()
        for out in outputs:
            if out.forward_rows:
                for observer in self.observers:
                    observer.on_step(requests=out.forward_requests, rows=out.forward_rows,
                                     seconds=out.forward_seconds)
        finished = {rid: pixels for out in outputs for rid, pixels in out.finished.items()}
        self._dispatch(changes, finished)
        self._emit_previews(outputs)
        for handle in moved:
            self._emit(handle, RequestEvent(handle.request_id, "queued", 0,
                                            handle.params.num_inference_steps,
                                            handle.queue_position))

    def _moved_in_queue_locked(self) -> list[RequestHandle]:
        """Listening requests whose queue position changed since they were last told."""
        moved = []
        for rid, position in self.queues.waiting_positions().items():
            handle = self._handles.get(rid)
            if handle is not None and handle.on_event is not None \
                    and handle.queue_position != position:
                handle.queue_position = position
                moved.append(handle)
        return moved

    def _dispatch(self, changes: list[StatusChange], finished: dict[str, Any]) -> None:
        for change in changes:
            rid = change.request_id
            if change.status == RequestStatus.DENOISING:
                handle = self._handles.get(rid)
                if handle is not None:
                    self._emit(handle, RequestEvent(rid, "step", change.steps_done,
                                                    change.total_steps))
            elif change.status == RequestStatus.FINISHED_OK:
                self._finish(rid, finished.get(rid))
            elif change.status == RequestStatus.FINISHED_ERROR:
                self._fail(rid, change.error or "failed")

    def _emit_previews(self, outputs: list[Any]) -> None:
        """Partial images: each decoded preview, after the step event of its step."""
        for out in outputs:
            for rid, (step, pixels) in out.previews.items():
                handle = self._handles.get(rid)
                if handle is not None:
                    self._emit(handle, RequestEvent(rid, "preview", step,
                                                    handle.params.num_inference_steps,
                                                    pixels=pixels))

    def _finish(self, rid: str, pixels: Any) -> None:
        with self._lock:
            handle = self._handles.pop(rid, None)
            rank = self.queues.remove(rid) or 0
            self._finished += 1
            self._wakeup.notify_all()
        if handle is None or pixels is None:
            return
        now = time.monotonic()
        started = handle.started_at or now
        result = GenerationResult(
            request_id=rid, pixels=pixels,
            seed=handle.seed, num_inference_steps=handle.params.num_inference_steps,
            queue_seconds=started - handle.submitted_at,
            latency_seconds=now - handle.submitted_at, rank=rank,
        )
        self._emit(handle, RequestEvent(rid, "finished", result.num_inference_steps,
                                        result.num_inference_steps))
        if not handle.future.done():
            handle.future.set_result(result)
        for observer in self.observers:
            observer.on_finished(result)

    def _fail(self, rid: str, reason: str) -> None:
        with self._lock:
            handle = self._handles.pop(rid, None)
            self.queues.remove(rid)
            self._wakeup.notify_all()
        for observer in self.observers:
            observer.on_failed(rid, reason)
        if handle is None:
            return
        self._emit(handle, RequestEvent(rid, "failed", error=reason))
        if not handle.future.done():
            handle.future.set_exception(DitServeError(f"request {rid} failed: {reason}"))

    @staticmethod
    def _emit(handle: RequestHandle, event: RequestEvent) -> None:
        if handle.on_event is None:
            return
        try:
            handle.on_event(event)
        except Exception:  # a broken listener must not break the loop
            log.exception("progress listener of %s failed", handle.request_id)
