"""The step loops of a started engine: schedule, execute, apply, deliver, until a final phase.

One loop per step group of the executor (every rank alone when ranks are independent, all
ranks together under DLO AllGather). An iteration plans one step of each rank in the group
under the engine's lock, runs it on the executor without the lock (torch releases the GIL in
kernels, so HTTP handlers stay responsive), then applies the outputs to the schedulers and
hands statuses, results and previews to ``delivery``. A loop that dies fails the replica
(``_loop_died``): pending requests fail with the reason, never hang.

Built and started by ``engine.DiffusionEngine.start``; shares the engine's lock, wake-up
condition, pending requests, lifecycle and delivery.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ditserve.engine.errors import EngineStoppedError
from ditserve.engine.executor import Executor, RankWork
from ditserve.engine.loop.delivery import Delivery
from ditserve.engine.loop.lifecycle import EnginePhase, Lifecycle
from ditserve.engine.loop.pending import PendingRequests
from ditserve.engine.request import RequestStatus
from ditserve.engine.step.plan import RunnerOutput, StatusChange

# How long a worker's own step loop may sit idle before the engine pings the worker.
HEARTBEAT_S = 2.0

log = logging.getLogger(__name__)


class StepLoops:
    """The loops of one engine over its executor (module docstring)."""

    def __init__(self, executor: Executor, *, pending: PendingRequests, lifecycle: Lifecycle,
                 delivery: Delivery, lock: threading.Lock,
                 wakeup: threading.Condition) -> None:
        self._executor = executor
        self._pending = pending
        self._lifecycle = lifecycle
        self._delivery = delivery
        self._lock = lock
        self._wakeup = wakeup

    def run(self, group: tuple[int, ...]) -> None:
        """Step the ranks of ``group`` together, at their own pace, until a final phase."""
        # A loop of workers only pings them while idle, so a dead or hung worker fails the
        # replica within HEARTBEAT_S + the worker timeout, not at the next request.
        heartbeat_s = None if 0 in group else HEARTBEAT_S
        executor = self._executor
        try:
            while (has_work := self._wait_for_work(group, heartbeat_s)) is not None:
                if has_work:
                    self._step(executor, group)
                else:
                    executor.step({rank: RankWork.idle() for rank in group})
        except BaseException as e:  # a loop must never die silently
            log.exception("engine loop died")
            self._loop_died(e)

    def _step(self, executor: Executor, group: tuple[int, ...]) -> None:
        """One engine step of ``group``: schedule, execute, apply."""
        work = self._schedule(group)
        try:
            outputs = executor.step(work)
        finally:
            with self._lock:
                self._pending.step_ended(group)
        self._apply(work, outputs)

    def _wait_for_work(self, group: tuple[int, ...], heartbeat_s: float | None) -> bool | None:
        """True: ``group`` has work; False: idle for ``heartbeat_s``; None: stopping."""
        with self._lock:
            idle_since = time.monotonic()
            while not self._lifecycle.phase.is_final and not self._pending.queues.has_work(group):
                if heartbeat_s is None:
                    self._wakeup.wait()
                    continue
                # Measured from idle_since: other loops' notifications must not postpone it.
                remaining = heartbeat_s - (time.monotonic() - idle_since)
                if remaining <= 0:
                    return False
                self._wakeup.wait(timeout=remaining)
            return None if self._lifecycle.phase.is_final else True

    def _schedule(self, group: tuple[int, ...]) -> dict[int, RankWork]:
        """Plan one step of every rank in ``group``, with the requests each plan admits."""
        if 0 in group:  # rank 0's runner is in this process (``Executor.runner``)
            # Not before the queued step has reached its plan point (``scheduler.plan_at``):
            # requests arriving until then still make the next step.
            self._executor.runner.plan_point.wait()
        with self._lock:
            self._pending.queues.release()
            self._wakeup.notify_all()  # released requests may be another loop's work
            now = time.monotonic()
            plans = {rank: self._pending.queues.schedulers[rank].schedule() for rank in group}
            self._pending.step_started(group, list(plans.values()), now)
            return {rank: RankWork(plan, self._pending.admitted(plan, now),
                                   self._pending.upcoming(plan))
                    for rank, plan in plans.items()}

    def _apply(self, work: dict[int, RankWork], outputs: dict[int, RunnerOutput]) -> None:
        """Apply a step's outputs: statuses, stats, observers, results and progress events."""
        with self._lock:
            changes = [c for rank, w in work.items()
                       for c in self._pending.queues.schedulers[rank].update(w.plan, outputs[rank])]
            self._pending.count(list(outputs.values()), finished=sum(
                c.status == RequestStatus.FINISHED_OK for c in changes))
            self._pending.queues.release()
            self._wakeup.notify_all()
            moved = self._pending.moved_in_queue()
        self._delivery.forwards(list(outputs.values()))
        finished = {rid: pixels for out in outputs.values() for rid, pixels in out.finished.items()}
        audio = {rid: track for out in outputs.values() for rid, track in out.audio.items()}
        for change in changes:
            self._deliver(change, finished, audio)
        self._deliver_previews(list(outputs.values()))
        for handle in moved:
            self._delivery.queued(handle)

    def _deliver_previews(self, outputs: list[RunnerOutput]) -> None:
        """Partial images: each decoded preview, after the step event of its step."""
        for out in outputs:
            for rid, (step, pixels) in out.previews.items():
                handle = self._pending.get(rid)
                if handle is not None:
                    self._delivery.preview(handle, step, pixels)

    def _deliver(self, change: StatusChange, finished: dict[str, Any],
                 audio: dict[str, tuple[Any, int]]) -> None:
        rid = change.request_id
        if not change.status.is_finished:  # a step, a pause or a resume
            self._delivery.progress(change, self._pending.get(rid))
            return
        with self._lock:
            handle, rank = self._pending.remove(rid)
            self._wakeup.notify_all()
        if change.status == RequestStatus.FINISHED_DEADLINE:
            self._delivery.deadline_exceeded(rid, handle, change.error or "deadline_exceeded",
                                             started=change.steps_done > 0)
        elif change.status == RequestStatus.FINISHED_ERROR:
            self._delivery.failed(rid, handle, change.error or "failed")
        elif handle is not None and finished.get(rid) is not None:
            self._delivery.finished(handle, finished[rid], rank=rank or 0,
                                    audio=audio.get(rid))

    def _loop_died(self, error: BaseException) -> None:
        """The replica cannot continue: FAILED, every pending request fails, loops leave."""
        message = f"the engine loop died: {error}"
        with self._lock:
            self._lifecycle.move(EnginePhase.FAILED, message)
            handles = self._pending.take_all()
            self._wakeup.notify_all()
        for handle in handles:
            self._delivery.stopped(handle, EngineStoppedError(message))
