"""AllGather DLO through the multi-process engine on CPU (gloo): dp=2 and dp=3 generations equal
the single-process resident result, per-rank host bytes are 1/group, uneven loads (one rank
idle, different step counts, staggered arrivals) finish, a killed worker is reported, and
--dlo-no-use-allgather works."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, OffloadConfig, ParallelConfig, SchedulerConfig
from ditserve.engine.errors import EngineStoppedError
from ditserve.engine.loop.engine import DiffusionEngine, RequestEvent
from ditserve.engine.offload.discovery import discover
from ditserve.engine.offload.plan import ALIGN_BYTES
from ditserve.engine.request import SamplingParams

pytestmark = pytest.mark.slow

REQUESTS = [SamplingParams(prompt=f"ag prompt {i}", num_inference_steps=s, seed=70 + i,
                           negative_prompt="neg" if i == 1 else None,
                           true_cfg_scale=2.0 if i == 1 else 1.0)
            for i, s in enumerate([3, 2, 5, 1])]
LONG = SamplingParams(prompt="long", num_inference_steps=12, seed=5)
TOLERANCE = 1e-4  # batching changes the reduction order; see test_dp_engine.py


def start_engine(model_dir, ranks: int, *, use_allgather: bool = True) -> DiffusionEngine:  # type: ignore[no-untyped-def]
    config = EngineConfig(
        model=str(model_dir), device="cpu",
        offload=OffloadConfig(enabled=True, use_allgather=use_allgather),
        parallel=ParallelConfig(data_parallel_size=ranks),
        scheduler=SchedulerConfig(max_num_seqs=2),
    )
    return DiffusionEngine(config).start()


@pytest.fixture(scope="module")
def alone(tiny_runner) -> dict[int, object]:  # type: ignore[no-untyped-def]
    out = {}
    for i, params in enumerate(REQUESTS + [LONG]):
        pixels, _ = drive(tiny_runner, {0: [(f"solo{i}", params)]}, max_num_seqs=1)
        out[i] = pixels[f"solo{i}"]
    return out


@pytest.fixture(scope="module")
def block_bytes(tiny_runner) -> int:  # type: ignore[no-untyped-def]
    blocks = discover(tiny_runner.pipeline.transformer).blocks
    return sum(p.numel() * p.element_size() for _, m in blocks for p in m.parameters())


@pytest.fixture(scope="class")
def engine2(tiny_model_dir) -> Iterator[DiffusionEngine]:  # type: ignore[no-untyped-def]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DITSERVE_WORKER_TIMEOUT_S", "120")
        engine = start_engine(tiny_model_dir, 2)
        try:
            yield engine
        finally:
            engine.shutdown()


def check(results, alone, indices) -> None:  # type: ignore[no-untyped-def]
    for i, result in zip(indices, results, strict=True):
        assert (result.pixels - alone[i]).abs().max().item() <= TOLERANCE, f"request {i}"


class TestDp2AllGather:
    """One dp=2 AllGather engine for these tests (class scope: one replica per process at a
    time, since a process joins one default process group)."""

    def test_dp2_allgather_generation_equals_resident(self, engine2, alone) -> None:  # type: ignore[no-untyped-def]
        handles = [engine2.add_request(p) for p in REQUESTS]
        check([h.result(timeout=120) for h in handles], alone, range(len(REQUESTS)))

    def test_dp2_host_bytes_per_rank_are_half_the_blocks(self, engine2, block_bytes) -> None:  # type: ignore[no-untyped-def]
        report = engine2.offload_report(refresh=True)
        ranks = report["ranks"]
        assert len(ranks) == 2
        streamed = ranks[0]["streamed_bytes"]
        for rank, r in enumerate(ranks):
            assert r["transfer"] == "h2d+allgather"
            assert r["group_size"] == 2 and r["group_rank"] == rank
            assert r["host_bytes"] == r["shard_bytes"] == streamed // 2
            # The model's block bytes / group, up to alignment padding (256 B per tensor).
            assert block_bytes / 2 <= r["shard_bytes"] <= block_bytes / 2 + 64 * ALIGN_BYTES * 8
        # Every rank ran the same passes: warm-up, forwards and idle passes stayed matched.
        assert ranks[0]["passes"] == ranks[1]["passes"] > 0
        assert ranks[0]["h2d_bytes"] == ranks[1]["h2d_bytes"]

    def test_dp2_uneven_loads_and_staggered_arrivals(self, engine2, alone) -> None:  # type: ignore[no-untyped-def]
        # One long request keeps one rank busy while the other idles (joining gathers only);
        # then requests with other step counts arrive one by one, each after the long request
        # has made progress, so ranks run different step counts in shared steps.
        progress = [threading.Event() for _ in range(LONG.num_inference_steps + 1)]

        def on_event(event: RequestEvent) -> None:
            if event.kind == "step":
                progress[event.step].set()

        long = engine2.add_request(LONG, on_event=on_event)
        late = []
        for k, params in enumerate(REQUESTS):
            assert progress[1 + 2 * k].wait(timeout=120), "the long request made no progress"
            late.append(engine2.add_request(params))
        check([h.result(timeout=120) for h in late], alone, range(len(REQUESTS)))
        check([long.result(timeout=120)], alone, [len(REQUESTS)])
        ranks = engine2.offload_report(refresh=True)["ranks"]
        assert ranks[0]["passes"] == ranks[1]["passes"]


def test_dp3_allgather_generation_equals_resident(tiny_model_dir, alone, block_bytes) -> None:  # type: ignore[no-untyped-def]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DITSERVE_WORKER_TIMEOUT_S", "120")
        engine = start_engine(tiny_model_dir, 3)
        try:
            handles = [engine.add_request(p) for p in REQUESTS]
            results = [h.result(timeout=120) for h in handles]
            ranks = engine.offload_report(refresh=True)["ranks"]
        finally:
            engine.shutdown()
    check(results, alone, range(len(REQUESTS)))
    assert [r["group_rank"] for r in ranks] == [0, 1, 2]
    assert {r["shard_bytes"] for r in ranks} == {ranks[0]["streamed_bytes"] // 3}
    assert ranks[0]["shard_bytes"] <= block_bytes / 3 + 64 * ALIGN_BYTES * 8
    assert len({r["passes"] for r in ranks}) == 1


def test_dp2_without_allgather_keeps_rank_local_blocks(tiny_model_dir, alone, block_bytes) -> None:  # type: ignore[no-untyped-def]
    engine = start_engine(tiny_model_dir, 2, use_allgather=False)
    try:
        handles = [engine.add_request(p) for p in REQUESTS]
        results = [h.result(timeout=120) for h in handles]
        ranks = engine.offload_report(refresh=True)["ranks"]
    finally:
        engine.shutdown()
    check(results, alone, range(len(REQUESTS)))
    for r in ranks:
        assert r["transfer"] == "sync-copy" and r["group_size"] == 1
        assert r["host_bytes"] >= block_bytes  # a full copy per rank


def test_dp2_allgather_killed_worker_is_reported(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DITSERVE_WORKER_TIMEOUT_S", "60")
        engine = start_engine(tiny_model_dir, 2)
        try:
            os.kill(engine.executor.worker_pids()[1], signal.SIGKILL)
            # Rank 0 may be inside a weight gather when its peer dies: the step still ends
            # with an error naming the rank, not a hang.
            handles = [engine.add_request(p) for p in REQUESTS[:2]]
            for handle in handles:
                with pytest.raises(EngineStoppedError, match="rank 1"):
                    handle.result(timeout=90)
        finally:
            engine.shutdown()
