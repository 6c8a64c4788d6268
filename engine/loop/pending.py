"""PendingRequests: what an engine holds for each request between ``add_request`` and its
outcome - the caller's handle, the queue or rank batch it is in - and the step counters.

Pure Python (no torch). Owned by ``DiffusionEngine`` and always used under the engine's lock:
the request API adds and removes, the step loops take admitted requests out as
``NewRequest`` for the runners and learn whose queue position moved.
"""

from __future__ import annotations

from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.loop.results import EngineStats, RequestHandle
from ditserve.engine.request import NewRequest
from ditserve.engine.sched.rank_queues import RankQueues
from ditserve.engine.sched.work import ResolvedScheduling
from ditserve.engine.step.plan import RequestWork, RunnerOutput, StepPlan


class PendingRequests:
    """Handles by request id, the replica's queues, and counters (see module docstring)."""

    def __init__(self, config: ResolvedScheduling, ranks: int) -> None:
        self.queues = RankQueues(config, ranks)
        self._handles: dict[str, RequestHandle] = {}
        self._steps_run = 0
        self._rows_run = 0
        self._finished = 0
        self._cache = [0, 0, 0]  # step cache: block runs, skipped blocks, skipped bytes
        # Steps on the executor now, by step group: (started at, requests it denoises). A
        # request aborted meanwhile is still computed until the step ends.
        self._in_flight: dict[tuple[int, ...], tuple[float, int]] = {}

    def step_started(self, group: tuple[int, ...], plans: list[StepPlan], now: float) -> None:
        requests = sum(len(plan.denoise) for plan in plans)
        if requests:
            self._in_flight[group] = (now, requests)

    def step_ended(self, group: tuple[int, ...]) -> None:
        self._in_flight.pop(group, None)

    def __len__(self) -> int:
        return len(self._handles)

    def ids(self) -> list[str]:
        return list(self._handles)

    def get(self, request_id: str) -> RequestHandle | None:
        return self._handles.get(request_id)

    def stats(self, now: float | None = None) -> EngineStats:
        """now: the monotonic clock (the age of the steps in flight)."""
        q = self.queues
        measured = [s.step_seconds for s in q.schedulers if s.step_seconds is not None]
        return EngineStats(q.num_running, q.num_waiting, self._steps_run, self._rows_run,
                           self._finished, len(q.schedulers), paused=q.num_paused,
                           waiting_high_priority=q.num_waiting_below(0),
                           step_seconds=max(measured) if measured else None,
                           step_cache_block_runs=self._cache[0],
                           step_cache_skipped_blocks=self._cache[1],
                           step_cache_skipped_bytes=self._cache[2],
                           step_in_flight_s=max((now - start for start, _ in
                                                 self._in_flight.values()), default=None)
                           if now is not None else None,
                           requests_in_flight=sum(n for _, n in self._in_flight.values()))

    def add(self, handle: RequestHandle, work: RequestWork | None = None) -> None:
        """Queue a request (``work``: its rows x tokens by the model's WorkRule);
        InvalidRequestError for an id in use, QueueFullError at max_queue."""
        rid = handle.request_id
        if rid in self._handles:
            raise InvalidRequestError("request_id", f"{rid!r} is already in use")
        self.queues.add(rid, handle.params, work)
        self._handles[rid] = handle
        handle.queue_position = self.queues.queue_position(rid)

    def remove(self, request_id: str) -> tuple[RequestHandle | None, int | None]:
        """Forget a request (finished, failed or aborted): its handle and the rank it was on.
        A running request's batch slot is freed at its rank's next step."""
        return self._handles.pop(request_id, None), self.queues.remove(request_id)

    def take_all(self) -> list[RequestHandle]:
        """Forget everything (the engine cannot go on); returns the handles still waiting."""
        self.queues.clear()
        handles, self._handles = list(self._handles.values()), {}
        return handles

    def admitted(self, plan: StepPlan, now: float) -> tuple[NewRequest, ...]:
        """The requests ``plan`` admits, as the runner receives them; they start now."""
        admitted = []
        for rid in plan.encode:
            handle = self._handles.get(rid)
            if handle is not None:  # not aborted meanwhile
                handle.started_at = now
                admitted.append(NewRequest(rid, handle.params, handle.seed))
        return tuple(admitted)

    def upcoming(self, plan: StepPlan) -> tuple[NewRequest, ...]:
        """The waiting requests ``plan`` names as next in line (their prompts may be encoded
        ahead); they stay waiting."""
        handles = ((rid, self._handles.get(rid)) for rid in plan.upcoming)
        return tuple(NewRequest(rid, h.params, h.seed) for rid, h in handles if h is not None)

    def count(self, outputs: list[RunnerOutput], finished: int) -> None:
        """Count a step: its forwards' rows (a step with any forward counts once) and the
        requests it finished."""
        for out in outputs:
            self._cache[0] += out.step_cache_block_runs
            self._cache[1] += out.step_cache_skipped_blocks
            self._cache[2] += out.step_cache_skipped_bytes
        rows = sum(out.forward_rows for out in outputs)
        if rows:
            self._steps_run += 1
            self._rows_run += rows
        self._finished += finished

    def moved_in_queue(self) -> list[RequestHandle]:
        """Listening requests whose queue position changed since they were last told."""
        moved = []
        for rid, position in self.queues.waiting_positions().items():
            handle = self._handles.get(rid)
            if handle is not None and handle.on_event is not None \
                    and handle.queue_position != position:
                handle.queue_position = position
                moved.append(handle)
        return moved
