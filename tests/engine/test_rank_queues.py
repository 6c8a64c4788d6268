"""RankQueues: the shared queue and per-rank schedulers of a replica (pure, no torch)."""

from __future__ import annotations

import pytest

from ditserve.engine.config import SchedulerConfig
from ditserve.engine.errors import QueueFullError
from ditserve.engine.request import SamplingParams
from ditserve.engine.sched.rank_queues import RankQueues
from ditserve.engine.sched.work import ResolvedScheduling
from ditserve.engine.step.plan import RunnerOutput


def params(size: int = 64, steps: int = 2) -> SamplingParams:
    return SamplingParams(prompt="p", height=size, width=size, num_inference_steps=steps)


def finish_step(queues: RankQueues, rank: int) -> list[str]:
    """Run one perfect step on ``rank``; returns the requests it finished."""
    scheduler = queues.schedulers[rank]
    plan = scheduler.schedule()
    scheduler.update(plan, RunnerOutput(stepped=list(plan.denoise), decoded=list(plan.decode)))
    for rid in plan.decode:
        queues.remove(rid)
    return list(plan.decode)


def test_one_rank_takes_everything_directly() -> None:
    queues = RankQueues(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=1)), ranks=1)
    for rid in "abc":
        queues.add(rid, params())
    assert [queues.rank_of(r) for r in "abc"] == [0, 0, 0]
    assert queues.num_waiting == 3 and queues.queue_position("c") == 2


def test_shared_queue_fills_free_slots_least_loaded_first() -> None:
    queues = RankQueues(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=1)), ranks=2)
    for rid in "abcd":
        queues.add(rid, params())
    assert (queues.rank_of("a"), queues.rank_of("b")) == (0, 1)
    assert queues.is_shared("c") and queues.is_shared("d")
    assert (queues.queue_position("c"), queues.queue_position("d")) == (2, 3)  # a, b first
    assert queues.num_waiting == 4  # a, b wait at their ranks until the next schedule


def test_a_freed_rank_takes_the_oldest_shared_request() -> None:
    queues = RankQueues(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=1)), ranks=2)
    queues.add("long", params(steps=100))
    queues.add("short", params(steps=1))
    queues.add("next", params(steps=1))
    assert queues.has_work([1])
    assert finish_step(queues, 1) == ["short"]
    queues.release()
    assert queues.rank_of("next") == 1  # not queued behind "long" on rank 0


def test_a_shared_request_goes_to_a_rank_with_room_for_its_work() -> None:
    # Budget 100 tokens (16-pixel tokens: 128x128 is 64). Rank 0 runs a 128x128 request, rank
    # 1 a 64x64 one (16): another 128x128 request fits only rank 1's room, though both ranks
    # have a free batch slot and rank 0 would win the tie on load.
    queues = RankQueues(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=4, max_batch_tokens=100)), ranks=2)
    queues.add("big", params(size=128))
    queues.add("small", params(size=64))
    assert (queues.rank_of("big"), queues.rank_of("small")) == (0, 1)
    queues.add("big2", params(size=128))
    assert queues.rank_of("big2") == 1
    queues.add("big3", params(size=128))  # fits nowhere now: waits in the shared queue
    assert queues.is_shared("big3")
    finish_step(queues, 0)  # "big" (2 steps) is still running: still no room
    assert queues.is_shared("big3")
    finish_step(queues, 0)
    queues.release()
    assert queues.rank_of("big3") == 0


def test_same_shape_group_preferred_among_equally_loaded() -> None:
    queues = RankQueues(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=2)), ranks=2)
    queues.add("small", params(size=64))
    queues.add("big", params(size=128))
    for rank in (0, 1):
        plan = queues.schedulers[rank].schedule()
        queues.schedulers[rank].update(plan, RunnerOutput(stepped=list(plan.denoise)))
    queues.add("big2", params(size=128))
    assert queues.rank_of("big2") == queues.rank_of("big")


def test_shared_work_counts_only_where_it_fits() -> None:
    queues = RankQueues(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=1)), ranks=2)
    for rid in "abc":
        queues.add(rid, params())
    for rank in (0, 1):
        queues.schedulers[rank].schedule()
    assert queues.has_work([0]) and queues.has_work([1])  # their own running requests


def test_remove_frees_shared_and_handed_requests() -> None:
    queues = RankQueues(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=1)), ranks=2)
    for rid in "abc":
        queues.add(rid, params())
    assert queues.remove("c") is None and not queues.is_shared("c")
    assert queues.remove("a") == 0
    assert queues.rank_of("a") is None
    with pytest.raises(ValueError):
        queues.add("b", params())


@pytest.mark.parametrize("ranks", [1, 2])
def test_queue_limit_counts_every_waiting_request_of_the_replica(ranks: int) -> None:
    # max_num_seqs 1: one step fills every rank's slot; then with one rank "a" waits, with two
    # "a" and "b" wait (shared or at their ranks); either way the bound counts all of them.
    queues = RankQueues(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=1, max_queue=ranks)), ranks=ranks)
    for rank in range(ranks):
        queues.add(f"running-{rank}", params())
    for scheduler in queues.schedulers:
        scheduler.schedule()
    for rid in "ab"[:ranks]:
        queues.add(rid, params())
    with pytest.raises(QueueFullError):
        queues.add("c", params())
    with pytest.raises(ValueError):
        queues.add("a", params())
