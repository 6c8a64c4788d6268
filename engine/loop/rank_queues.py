"""RankQueues: where waiting requests live in a replica - one shared queue, one scheduler per rank.

Pure Python (no torch), owned by the engine and always used under the engine's lock. With one
rank a request goes straight to that rank's StepScheduler (whose admission policy then sees
the whole queue). With several data-parallel ranks it first waits in a shared FIFO and is
handed, oldest first, to the least-loaded rank that has room for it - a free batch slot and,
within the step's work budget, room for its rows x tokens (or nothing else to do) - preferring
a rank already running its shape group, whose forward it then joins. So a request never waits
behind a busy rank while another rank has room. The replica's queue bound (``max_queue``) is
checked here, over every waiting request of every rank.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from ditserve.engine.config import SchedulerConfig
from ditserve.engine.errors import QueueFullError
from ditserve.engine.request import SamplingParams
from ditserve.engine.scheduler import DEFAULT_WORK_RULE, StepScheduler
from ditserve.engine.work import RequestWork


class RankQueues:
    """The shared queue and the per-rank schedulers of one replica (see module docstring)."""

    def __init__(self, config: SchedulerConfig, ranks: int) -> None:
        self.max_queue = config.max_queue
        self.schedulers = [StepScheduler(config) for _ in range(ranks)]
        self._shared: OrderedDict[str, tuple[SamplingParams, RequestWork]] = OrderedDict()
        self._rank_of: dict[str, int] = {}

    # -- queries ------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self.schedulers) + len(self._shared)

    @property
    def num_running(self) -> int:
        return sum(s.num_running for s in self.schedulers)

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
        _, work = next(iter(self._shared.values()))
        return any(self.schedulers[r].has_room(work) for r in ranks)

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
        if len(self.schedulers) == 1:
            self._hand(request_id, params, work, 0)
        else:
            self._shared[request_id] = (params, work)
            self.release()

    def release(self) -> None:
        """Hand shared requests, oldest first, to ranks with room for them."""
        while self._shared:
            request_id, (params, work) = next(iter(self._shared.items()))
            free = [r for r, s in enumerate(self.schedulers) if s.has_room(work)]
            if not free:
                return
            del self._shared[request_id]
            self._hand(request_id, params, work, self._pick(params, free))

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
              rank: int) -> None:
        self.schedulers[rank].add(request_id, params, work)
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
