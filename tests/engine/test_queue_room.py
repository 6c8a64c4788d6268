"""Admission room: a replica refuses a request (QueueFullError -> HTTP 429) only when every
batch slot is taken and ``max_queue`` requests wait beyond them."""

from __future__ import annotations

import pytest

from ditserve.engine.config import EngineConfig, SchedulerConfig
from ditserve.engine.errors import QueueFullError
from ditserve.engine.loop.engine import DiffusionEngine
from ditserve.engine.request import SamplingParams
from ditserve.engine.sched.rank_queues import RankQueues
from ditserve.engine.sched.work import ResolvedScheduling


def params() -> SamplingParams:
    return SamplingParams(prompt="p", num_inference_steps=2)


@pytest.mark.parametrize("ranks", [1, 2])
def test_free_slots_count_as_room(ranks: int) -> None:
    queues = RankQueues(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=2)), ranks=ranks)
    slots = 2 * ranks
    for i in range(slots + 1):  # a burst: nothing has been scheduled yet
        assert not queues.is_full(1), i
        queues.add(f"r{i}", params())
    assert queues.is_full(1)  # every slot spoken for and one waits beyond them
    assert not queues.is_full(2)


def test_running_requests_take_their_slots() -> None:
    queues = RankQueues(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=2)), ranks=1)
    queues.add("a", params())
    queues.add("b", params())
    queues.schedulers[0].schedule()  # a and b start running
    assert queues.num_running == 2 and queues.num_waiting == 0
    assert not queues.is_full(1)
    queues.add("c", params())
    assert queues.is_full(1)
    assert queues.is_full(0)


def test_a_burst_to_an_idle_engine_fills_the_batch_then_the_queue(tiny_model_dir) -> None:
    config = EngineConfig(model=str(tiny_model_dir), device="cpu",
                          scheduler=SchedulerConfig(max_num_seqs=4, max_queue=2))
    engine = DiffusionEngine(config).start()
    try:
        long = SamplingParams(prompt="long", num_inference_steps=1000, seed=1)
        handles = [engine.add_request(long) for _ in range(6)]  # 4 slots + 2 queued
        with pytest.raises(QueueFullError):
            engine.add_request(long)
        stats = engine.stats()
        assert stats.running + stats.waiting == 6
    finally:
        for handle in handles:
            handle.cancel()
        engine.shutdown()
