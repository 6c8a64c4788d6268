"""RankQueues: where waiting requests live in a replica - one shared queue, one scheduler per rank.

Pure Python (no torch), owned by the engine and always used under the engine's lock. With one
rank a request goes straight to that rank's StepScheduler (whose admission policy then sees
the whole queue). With several data-parallel ranks it first waits in a shared FIFO and is
handed, oldest first, to the least-loaded rank that has room for it - a free batch slot and,
within the step's work budget, room for its rows x tokens (or nothing else to do) - preferring
a rank already running its shape group, whose forward it then joins. So a request never waits
behind a busy rank while another rank has room. The replica's queue bound (``max_queue``) is
checked here, over every waiting request of every rank, and so is a deadline at admission:
a request whose ``deadline_s`` no rank's estimate can meet is refused (``DeadlineError``). A
request's deadline counts from its arrival here, not from its hand-over to a rank. Under the
priority policy the shared queue hands out in the policy's order (with aging), and when no
rank has room, to the rank that would pause the lowest-priority request for it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from ditserve.engine.errors import DeadlineError, QueueFullError
from ditserve.engine.request import SamplingParams
from ditserve.engine.sched.scheduler import DEFAULT_WORK_RULE, StepScheduler
from ditserve.engine.sched.work import ResolvedScheduling
from ditserve.engine.step.plan import RequestWork


class RankQueues:
    """The shared queue and the per-rank schedulers of one replica (see module docstring)."""

    def __init__(self, config: ResolvedScheduling, ranks: int, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_queue = config.max_queue
        self.clock = clock
        self.schedulers = [StepScheduler(config, clock=clock) for _ in range(ranks)]
        # request id -> (params, work, arrival time)
        self._shared: OrderedDict[str, tuple[SamplingParams, RequestWork, float]] = OrderedDict()
        self._rank_of: dict[str, int] = {}

    # -- queries ------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self.schedulers) + len(self._shared)

    @property
    def num_running(self) -> int:
        return sum(s.num_running for s in self.schedulers)

    @property
    def num_paused(self) -> int:
        return sum(s.num_paused for s in self.schedulers)

    def num_waiting_below(self, priority: int) -> int:
        """Waiting requests of a priority value below ``priority`` (sooner than it)."""
        shared = sum(params.priority < priority for params, _, _ in self._shared.values())
        return shared + sum(p < priority for s in self.schedulers for p in s.waiting_priorities())

    def is_full(self, max_queue: int) -> bool:
        """Whether one more request would exceed the replica's room: every batch slot of every
        rank taken and ``max_queue`` requests waiting beyond them. Requests admitted in a burst
        count as waiting until the next step moves them into free slots, so free slots are
        room too (a burst to an idle replica is never refused)."""
        slots = sum(s.config.max_num_seqs for s in self.schedulers)
        free_slots = max(0, slots - self.num_running)
        return self.num_waiting >= max_queue + free_slots

    def rank_of(self, request_id: str) -> int | None:
        """The rank a request was handed to (None while in the shared queue or unknown)."""
        return self._rank_of.get(request_id)

    def is_shared(self, request_id: str) -> bool:
        return request_id in self._shared

    def queue_position(self, request_id: str) -> int | None:
        """Requests ahead of this one, or None if it is not waiting."""
        if request_id in self._shared:
            # Behind everything already queued at a rank, then its place in the shared queue.
            ahead = sum(s.num_waiting for s in self.schedulers)
            return ahead + list(self._shared).index(request_id)
        rank = self._rank_of.get(request_id)
        return None if rank is None else self.schedulers[rank].queue_position(request_id)

    def waiting_positions(self) -> dict[str, int]:
        """``queue_position`` of every waiting request, in one pass."""
        positions: dict[str, int] = {}
        for scheduler in self.schedulers:
            positions.update((rid, i) for i, rid in enumerate(scheduler.waiting_ids()))
        ahead = sum(s.num_waiting for s in self.schedulers)
        positions.update((rid, ahead + i) for i, rid in enumerate(self._shared))
        return positions

    def has_work(self, ranks: Sequence[int]) -> bool:
        """Whether ``ranks`` have anything to do (shared requests count only where they fit)."""
        if any(self.schedulers[r].has_work() for r in ranks):
            return True
        if not self._shared:
            return False
        _, (params, work, _) = self._head()
        return any(r in self._ranks_for(params, work) for r in ranks)

    # -- changes ------------------------------------------------------------------------------
    def add(self, request_id: str, params: SamplingParams,
            work: RequestWork | None = None) -> None:
        """Queue a request (``work``: its rows x tokens, see ``StepScheduler.add``);
        QueueFullError when the replica has no room (``is_full``)."""
        if request_id in self._shared or request_id in self._rank_of:
            raise ValueError(f"request id {request_id!r} is already queued")
        if self.max_queue is not None and self.is_full(self.max_queue):
            raise QueueFullError(f"every batch slot is taken and {self.max_queue} requests are "
                                 f"waiting (max_queue={self.max_queue})")
        work = work or DEFAULT_WORK_RULE.of(params)
        self._check_deadline(params, work)
        now = self.clock()
        if len(self.schedulers) == 1:
            self._hand(request_id, params, work, now, 0)
        else:
            self._shared[request_id] = (params, work, now)
            self.release()

    def estimate_s(self, params: SamplingParams, work: RequestWork) -> float | None:
        """The soonest any rank expects to finish a new request (None: no step measured)."""
        estimates = [e for s in self.schedulers if (e := s.estimate_s(params, work)) is not None]
        return min(estimates) if estimates else None

    def _check_deadline(self, params: SamplingParams, work: RequestWork) -> None:
        if params.deadline_s is None:
            return
        estimate = self.estimate_s(params, work)
        if estimate is not None and estimate > params.deadline_s:
            step_s = min(s.step_seconds or 0.0 for s in self.schedulers)
            raise DeadlineError(
                f"deadline_s={params.deadline_s:g} cannot be met: the scheduler estimates "
                f"{estimate:.1f} s to finish ({params.num_inference_steps} steps at "
                f"{step_s:.3f} s/step measured, behind the work already queued); raise "
                "deadline_s, lower num_inference_steps, or use a higher priority",
                estimate_s=estimate)

    def release(self) -> None:
        """Hand shared requests, oldest first (under the priority policy: the first in its
        order), to ranks with room for them (or, under it, a rank that would pause a
        lower-priority request for it)."""
        while self._shared:
            request_id, (params, work, arrived_at) = self._head()
            free = self._ranks_for(params, work)
            if not free:
                return
            del self._shared[request_id]
            self._hand(request_id, params, work, arrived_at, self._pick(params, free))

    def _head(self) -> tuple[str, tuple[SamplingParams, RequestWork, float]]:
        order, now = self.schedulers[0].order, self.clock()
        return min(self._shared.items(),
                   key=lambda item: order.key_of_new(item[1][0].priority,
                                                     item[1][0].deadline_s, item[1][2], now))

    def _ranks_for(self, params: SamplingParams, work: RequestWork) -> list[int]:
        """Ranks with room, else the ranks that would pause the lowest priority for it."""
        free = [r for r, s in enumerate(self.schedulers) if s.has_room(work)]
        if free:
            return free
        pausable = {r: p for r, s in enumerate(self.schedulers)
                    if (p := s.pausable_priority(params)) is not None}
        return [r for r, p in pausable.items() if p == max(pausable.values())]

    def remove(self, request_id: str) -> int | None:
        """Forget a request (aborted, finished or failed); returns the rank it was on."""
        self._shared.pop(request_id, None)
        rank = self._rank_of.pop(request_id, None)
        if rank is not None:
            self.schedulers[rank].abort(request_id)  # no-op once it finished
        return rank

    def clear(self) -> None:
        self._shared.clear()
        self._rank_of.clear()

    def _hand(self, request_id: str, params: SamplingParams, work: RequestWork,
              arrived_at: float, rank: int) -> None:
        self.schedulers[rank].add(request_id, params, work, arrived_at=arrived_at)
        self._rank_of[request_id] = rank

    def _pick(self, params: SamplingParams, ranks: list[int]) -> int:
        # Least loaded first; among equals a rank whose batch already has this shape group
        # (one more row in an existing forward), then an idle one.
        key = params.batch_key()

        def load(rank: int) -> tuple[int, int, int]:
            s = self.schedulers[rank]
            running = s.running_keys()
            joins = not running or key in running
            return (s.num_waiting + s.num_running, 0 if joins else 1, rank)

        return min(ranks, key=load)
