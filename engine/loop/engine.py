"""DiffusionEngine: the thread-safe request API over the step loops that drive the executor.

Owns the pending requests (``pending``: handles, and one StepScheduler per data-parallel
rank behind a shared queue), the executor (the model runners, ``executor``) and the lifecycle
phase (``lifecycle``; the engine and its step loops are its only writers).
``start()`` loads and warms up (``startup``), then runs one step loop thread per step group of
the executor - every rank alone when ranks are independent, all ranks together under DLO
AllGather (``step_loop``: schedule, execute, apply; torch releases the GIL in kernels, so HTTP
handlers stay responsive). With several ranks, new requests wait in one shared
queue and go, oldest first, to the least-loaded rank that has a free batch slot.

Callers submit from any thread (``add_request`` returns a handle with a concurrent Future) or
from asyncio (``await generate(...)``). Progress events and the observers (metrics, the step
log: constructor arguments) are called from the loop threads (``delivery``). The types it
hands back live in ``results``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ditserve.engine.adapters.catalog import AdapterCatalog
from ditserve.engine.adapters.files import rank_inspector
from ditserve.engine.config import EngineConfig, ResolvedOffload, validate
from ditserve.engine.config.step_cache import POLICIES as STEP_CACHE_POLICIES
from ditserve.engine.errors import EngineStoppedError, InvalidRequestError
from ditserve.engine.executor import Executor
from ditserve.engine.loop.client import EngineFacts
from ditserve.engine.loop.delivery import Delivery
from ditserve.engine.loop.lifecycle import EnginePhase, Lifecycle
from ditserve.engine.loop.pending import PendingRequests
from ditserve.engine.loop.results import (
    EngineObserver,
    EngineStats,
    GenerationResult,
    RequestEvent,
    RequestHandle,
)
from ditserve.engine.loop.startup import ModelLeases, WarmUp, open_executor, served_family
from ditserve.engine.loop.step_loop import StepLoops
from ditserve.engine.request import ModelLimits, SamplingParams
from ditserve.engine.runner.start_phases import StartTimeline
from ditserve.engine.sched.scheduler import StepScheduler
from ditserve.engine.sched.work import ResolvedScheduling

__all__ = [
    "DiffusionEngine", "EngineObserver", "EnginePhase", "EngineStats", "GenerationResult",
    "RequestEvent", "RequestHandle", "WarmUp",
]

log = logging.getLogger(__name__)


class DiffusionEngine:
    """The engine of one replica. ``start()`` loads the model; ``shutdown()`` drains and stops.
    It is the server's ``engine.loop.client.EngineClient``.

    observers: told about every forward and every finished or failed request (metrics).
    warmup: what to run before ready beyond the small warm-up step (the compile size).
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        observers: Sequence[EngineObserver] = (),
        warmup: WarmUp | None = None,
    ) -> None:
        self.config = validate(config)
        self.warmup = warmup or WarmUp()
        # Where the start goes (process start to READY), for the log and /metrics.
        self.start_timeline = StartTimeline()
        self.executor: Executor | None = None
        self.model_dir: Path | None = None
        self._delivery = Delivery(observers)
        self._lifecycle = Lifecycle()
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        # The offload decided once, beside the scheduling: every rank runs with this one.
        self.offload = ResolvedOffload.of(self.config.offload, parallel=self.config.parallel)
        self._queue_for(config)
        self._threads: list[threading.Thread] = []
        self.adapters: AdapterCatalog | None = None  # the served LoRA adapters, from start()
        self._model_leases = ModelLeases()  # on the pulled cache entries served from

    @property
    def schedulers(self) -> list[StepScheduler]:
        """One StepScheduler per data-parallel rank."""
        return self._pending.queues.schedulers

    @property
    def runner(self) -> Any:
        """Rank 0's ModelRunner, in this process."""
        return self.executor.runner if self.executor is not None else None

    # -- lifecycle --------------------------------------------------------------------------
    @property
    def phase(self) -> EnginePhase:
        return self._lifecycle.phase

    @property
    def failure(self) -> str | None:
        """Why the engine is FAILED (it could not start, or its loop died), else None."""
        return self._lifecycle.error

    @property
    def ready(self) -> bool:
        return self.phase is EnginePhase.READY

    def _adopt_fitted_scheduler(self, executor: Executor) -> None:
        """Schedule by the requests per step the HBM budget's plan lowered to (every rank
        plans alike; nothing is queued before READY, so the queues are rebuilt empty)."""
        fitted = getattr(executor.runner, "config", self.config).scheduler
        if fitted == self.config.scheduler:
            return
        self.config = replace(self.config, scheduler=fitted)
        with self._lock:
            self._queue_for(self.config)

    def _queue_for(self, config: EngineConfig) -> None:
        """The (empty) rank queues of ``config``'s scheduling. The step budget, when unset, is
        max_num_seqs requests of the family's usual size; a step's distinct adapters are
        bounded by --max-loras (what the runner keeps)."""
        scheduler = ResolvedScheduling.for_family(config.scheduler, served_family(config.model),
                                                  max_loras=config.adapters.max_loras)
        self._pending = PendingRequests(scheduler, config.parallel.data_parallel_size)
        self.max_request_tokens = scheduler.max_request_tokens

    def start(self) -> DiffusionEngine:
        """Load the model and warm up (blocking), then start the step loops: -> READY."""
        try:
            self._model_leases.take(self.config)
            executor, self.model_dir = open_executor(
                self.config, self.warmup, offload=self.offload,
                on_compiling=lambda: self._lifecycle.move(EnginePhase.COMPILING),
                timeline=self.start_timeline)
            adapters = self.config.adapters
            bank = getattr(executor.runner, "adapters", None)
            self.adapters = AdapterCatalog(adapters, inspect=rank_inspector(
                self.model_dir, max_rank=adapters.max_lora_rank,
                shapes=bank.linear_shapes() if bank is not None else None))
        except BaseException as e:
            self._model_leases.release()
            self._lifecycle.move(EnginePhase.FAILED, f"{type(e).__name__}: {e}")
            raise
        self._adopt_fitted_scheduler(executor)
        with self._lock:
            stopped_meanwhile = self.phase.is_final
            if not stopped_meanwhile:
                self.executor = executor
                loops = StepLoops(executor, pending=self._pending, lifecycle=self._lifecycle,
                                  delivery=self._delivery, lock=self._lock, wakeup=self._wakeup)
                self._threads = [
                    threading.Thread(target=loops.run, args=(group,), daemon=True,
                                     name=f"ditserve-engine-{'-'.join(map(str, group))}")
                    for group in executor.step_groups
                ]
                for thread in self._threads:
                    thread.start()
                self._lifecycle.move(EnginePhase.READY)  # refused if a drain began meanwhile
                if self.phase is EnginePhase.READY:
                    self.start_timeline.ready()
        if stopped_meanwhile:
            executor.shutdown()
            self._model_leases.release()
        return self

    def drain(self) -> None:
        """Refuse new requests from now on; running and queued ones continue."""
        with self._lock:
            self._lifecycle.move(EnginePhase.DRAINING)

    def shutdown(self, grace_seconds: float = 0.0) -> None:
        """Drain, let work finish for up to ``grace_seconds``, abort the rest, stop."""
        deadline = time.monotonic() + grace_seconds
        with self._lock:
            self._lifecycle.move(EnginePhase.DRAINING)
            while self._pending and time.monotonic() < deadline \
                    and any(thread.is_alive() for thread in self._threads):
                self._wakeup.wait(timeout=min(0.05, max(0.0, deadline - time.monotonic())))
            for rid in self._pending.ids():
                self._abort_locked(rid, "engine shut down")
            self._lifecycle.move(EnginePhase.STOPPED)  # a FAILED engine stays FAILED
            self._wakeup.notify_all()  # the loops see a final phase and leave
        for thread in self._threads:
            thread.join(timeout=60)
        # Dropping the executor lets the model's device memory go back once collected, even
        # while callers still hold request handles (each keeps the engine for its cancel()):
        # an engine started later in the same process would otherwise find the old one's
        # resident modules under its HBM budget.
        executor, self.executor = self.executor, None
        if executor is not None:
            executor.shutdown()
        self._model_leases.release()  # the ranks read the model no more

    # -- what the server reads (engine.loop.client.EngineClient) -------------------------------------
    @property
    def limits(self) -> ModelLimits:
        """What the loaded model can run; the defaults before it loaded."""
        return self.runner.limits if self.runner is not None else ModelLimits()

    def facts(self) -> EngineFacts | None:
        """The loaded model's limits, rank 0's device and the DiT's dtype; None before."""
        runner = self.runner
        if runner is None:
            return None
        names = tuple(e.name for e in self.adapters.entries()) if self.adapters else ()
        return EngineFacts(limits=runner.limits, device=str(runner.device),
                           dtype=self.config.dtype, adapters=names)

    def adapter_stats(self) -> dict[str, int]:
        bank = getattr(self.runner, "adapters", None)
        return {"loaded": len(self.adapters.entries()) if self.adapters else 0,
                "resident": len(bank.resident) if bank is not None else 0,
                "bytes": int(bank.nbytes) if bank is not None else 0}

    @property
    def step_cache_policies(self) -> tuple[str, ...]:
        """The step-cache policies the served model takes (all of them before loading)."""
        return self.runner.step_cache.policies if self.runner else STEP_CACHE_POLICIES

    @property
    def condition_images(self) -> tuple[int, int]:
        """(fewest, most) conditioning images a request may bring; (0, 0): text only."""
        return self.limits.condition_images

    def stats(self) -> EngineStats:
        with self._lock:
            return self._pending.stats(time.monotonic())

    def pipeline_report(self) -> dict[str, Any] | None:
        """Rank 0's plan of the whole pipeline and its prompt-cache counters (other DP ranks
        keep their own caches; their counters are not summed here)."""
        if self.executor is None:
            return None
        return dict(self.executor.runner.pipeline_report())

    def start_report(self) -> dict[str, Any]:
        """Seconds per start phase and process start to READY (None until ready)."""
        return self.start_timeline.report()

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
        """Raise InvalidRequestError naming the first field the loaded model cannot run;
        returns the request with the model's defaults filled in (``validate_for``)."""
        params = params.validate_for(self.limits)
        bound = self.config.adapters.max_loras
        if len(params.loras) > bound:  # it could never run: no step may hold its adapters
            raise InvalidRequestError("loras", f"the request stacks {len(params.loras)} LoRA "
                                      f"adapters, but this server keeps at most {bound} "
                                      "resident at once (--max-loras); name fewer")
        if self.runner is not None:  # what the served model's step cache can do
            self.runner.step_cache.check(params.step_cache)
            self.runner.work_rule.check_request(params, self.max_request_tokens)
        return params

    def add_request(
        self,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        on_event: Callable[[RequestEvent], None] | None = None,
    ) -> RequestHandle:
        """Validate and enqueue; raises InvalidRequestError, QueueFullError, DeadlineError (its
        ``deadline_s`` cannot be met by the scheduler's estimate), EngineStoppedError."""
        params = self.validate_params(params)  # with the model's defaults filled in
        rid = request_id or uuid.uuid4().hex
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        handle = RequestHandle(rid, params, seed, concurrent.futures.Future(),
                               abort_fn=self.abort, on_event=on_event)
        # Its share of a step's work budget, by the served model's token grid and CFG rule.
        work = self.runner.work_rule.of(params) if self.runner is not None else None
        with self._lock:
            if self.phase is EnginePhase.FAILED:
                raise EngineStoppedError(str(self.failure))
            if self.phase is not EnginePhase.READY:
                raise EngineStoppedError("the engine is not accepting requests (starting or "
                                         "shutting down)")
            self._pending.add(handle, work)
            if self.adapters is not None:  # in use (not unloadable) until the request ends
                self.adapters.hold_until_done(params.loras, handle.future)
            self._wakeup.notify_all()
        self._delivery.queued(handle)
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
        handle, _ = self._pending.remove(request_id)
        if handle is None:
            return False
        self._wakeup.notify_all()
        self._delivery.aborted(handle, reason)
        return True
