"""Sequence-parallel engine on CPU (gloo): SP 2 and dp 2 x sp 2 replicas of the tiny Flux.

Every request must equal the single-process resident result: image sizes whose token count
needs padding (52 px: 13 x 13 tokens) and sizes that divide, requests batched together with
different step counts, CFG rows; DLO AllGather over the SP group (each rank holds half of
every block), over the DP groups of a dp 2 x sp 2 replica (four processes), and rank-local
blocks with ``use_allgather=false``; a killed SP rank fails the replica with an error naming it.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, OffloadConfig, ParallelConfig, SchedulerConfig
from ditserve.engine.errors import EngineStoppedError
from ditserve.engine.loop.engine import DiffusionEngine, EnginePhase
from ditserve.engine.request import SamplingParams

pytestmark = pytest.mark.slow
TOLERANCE = 1e-4  # fp32; the SP attention sums keys in another order (as batching does)

REQUESTS = [
    SamplingParams(prompt="sp fox", num_inference_steps=3, seed=61, height=52, width=52),
    SamplingParams(prompt="sp lighthouse", num_inference_steps=2, seed=62, height=52, width=52),
    SamplingParams(prompt="sp ramen", negative_prompt="blur", true_cfg_scale=2.5,
                   num_inference_steps=4, seed=63, height=48, width=48),
    SamplingParams(prompt="sp bee", num_inference_steps=5, seed=64, height=52, width=52),
]


def engine_for(model_dir, *, dp: int = 1, sp: int = 2, **offload) -> DiffusionEngine:  # type: ignore[no-untyped-def]
    config = EngineConfig(
        model=str(model_dir), device="cpu",
        parallel=ParallelConfig(data_parallel_size=dp, sequence_parallel_size=sp),
        offload=OffloadConfig(**offload), scheduler=SchedulerConfig(max_num_seqs=2))
    return DiffusionEngine(config).start()


@pytest.fixture(scope="module")
def alone(tiny_runner):  # type: ignore[no-untyped-def]
    out = []
    for i, params in enumerate(REQUESTS):
        pixels, _ = drive(tiny_runner, {0: [(f"solo{i}", params)]}, max_num_seqs=1)
        out.append(pixels[f"solo{i}"])
    return out


def generate_all(engine: DiffusionEngine) -> list:  # type: ignore[type-arg]
    handles = [engine.add_request(p) for p in REQUESTS]  # at once: they batch
    return [h.result(timeout=240) for h in handles]


@pytest.fixture(scope="class")
def sp_engine(tiny_model_dir):  # type: ignore[no-untyped-def]
    # Class scope: one replica at a time in this process (one default process group).
    engine = engine_for(tiny_model_dir, enabled=True)  # DLO, AllGather over the SP group
    yield engine
    engine.shutdown()


class TestSp2AllGatherOverTheSpGroup:
    def test_batched_requests_equal_single_process_resident(self, sp_engine, alone) -> None:  # type: ignore[no-untyped-def]
        results = generate_all(sp_engine)
        for i, result in enumerate(results):
            assert (result.pixels - alone[i]).abs().max().item() <= TOLERANCE, f"request {i}"
        stats = sp_engine.stats()
        assert stats.ranks == 1  # one DP rank, on two processes
        assert stats.mean_batch_rows > 1  # requests shared forwards

    def test_each_rank_holds_half_of_every_block(self, sp_engine) -> None:  # type: ignore[no-untyped-def]
        ranks = sp_engine.offload_report(refresh=True)["ranks"]
        assert len(ranks) == 2
        assert {r["transfer"] for r in ranks} == {"h2d+allgather"}
        assert [r["group_rank"] for r in ranks] == [0, 1]
        assert {r["group_size"] for r in ranks} == {2}
        streamed = ranks[0]["streamed_bytes"]
        assert {r["shard_bytes"] for r in ranks} == {r["host_bytes"] for r in ranks} \
            == {streamed // 2}
        assert ranks[0]["passes"] == ranks[1]["passes"] > 0  # every gather was matched


def test_dp2_sp2_replica_equals_single_process(tiny_model_dir, alone, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("DITSERVE_WORKER_TIMEOUT_S", "180")  # four cold starts on two cores
    # Four processes: two DP ranks of two SP processes each; DLO AllGather over the DP
    # groups {0, 2} and {1, 3}, so all four step together.
    engine = engine_for(tiny_model_dir, dp=2, sp=2, enabled=True)
    try:
        results = generate_all(engine)
        ranks = engine.offload_report(refresh=True)["ranks"]
        stats = engine.stats()
    finally:
        engine.shutdown()
    for i, result in enumerate(results):
        assert (result.pixels - alone[i]).abs().max().item() <= TOLERANCE, f"request {i}"
    assert stats.ranks == 2
    assert {r.rank for r in results} == {0, 1}  # both DP ranks served requests
    assert len(ranks) == 4
    assert [r["group_rank"] for r in ranks] == [0, 0, 1, 1]  # process d*2 + s: DP index d
    assert {r["shard_bytes"] for r in ranks} == {ranks[0]["streamed_bytes"] // 2}
    assert len({r["passes"] for r in ranks}) == 1


def test_rank_local_blocks_then_a_killed_sp_rank_is_reported(tiny_model_dir, alone) -> None:  # type: ignore[no-untyped-def]
    engine = engine_for(tiny_model_dir, enabled=True, use_allgather=False)
    try:
        # --dlo-no-use-allgather: every SP rank streams complete blocks of its own.
        first = engine.add_request(REQUESTS[0]).result(timeout=240)
        assert (first.pixels - alone[0]).abs().max().item() <= TOLERANCE
        ranks = engine.offload_report(refresh=True)["ranks"]
        assert {r["group_size"] for r in ranks} == {1}
        # Each rank's own host copy of every block (its checkpoint mapping: the blocks'
        # bytes without the slots' alignment padding), not half of them.
        streamed = ranks[0]["streamed_bytes"]
        assert len({r["host_bytes"] for r in ranks}) == 1
        assert 0.95 * streamed <= ranks[0]["host_bytes"] <= streamed

        started = threading.Event()
        long = engine.add_request(
            SamplingParams(prompt="long", num_inference_steps=1000, seed=5, height=52, width=52),
            on_event=lambda e: started.set() if e.kind == "step" else None)
        assert started.wait(120)
        os.kill(engine.executor.worker_pids()[1], signal.SIGKILL)  # mid all-to-all, mostly
        with pytest.raises(EngineStoppedError) as failure:
            long.result(timeout=120)
        assert "rank 1" in str(failure.value)
        assert engine.phase is EnginePhase.FAILED and "rank 1" in str(engine.failure)
    finally:
        engine.shutdown()
