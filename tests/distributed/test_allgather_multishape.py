"""Multi-shape steps on dp=2 AllGather DLO (gloo, CPU): ranks with different numbers of shape
groups in one step still run matched passes (one per step; a rank without requests joins with
an idle pass), and every request equals its output alone."""

from __future__ import annotations

import pytest
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, OffloadConfig, ParallelConfig, SchedulerConfig
from ditserve.engine.loop.engine import DiffusionEngine
from ditserve.engine.request import SamplingParams

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4
# (height, width): five different shape groups, so the ranks (which share the five requests
# unevenly: an odd count) always hold different numbers of groups.
SIZES = [(64, 64), (32, 64), (48, 48), (64, 32), (32, 32)]
REQUESTS = [SamplingParams(prompt=f"shape {i}", height=h, width=w, seed=90 + i,
                           num_inference_steps=2 + i % 3,
                           negative_prompt="neg" if i == 1 else None,
                           true_cfg_scale=2.0 if i == 1 else 1.0)
            for i, (h, w) in enumerate(SIZES)]


def test_dp2_allgather_ranks_with_different_group_counts_stay_matched(tiny_model_dir, tiny_runner,
                                                                      monkeypatch) -> None:  # type: ignore[no-untyped-def]
    alone = {}
    for i, params in enumerate(REQUESTS):
        pixels, _ = drive(tiny_runner, {0: [(f"solo{i}", params)]}, max_num_seqs=1)
        alone[i] = pixels[f"solo{i}"]
    monkeypatch.setenv("DITSERVE_WORKER_TIMEOUT_S", "120")
    engine = DiffusionEngine(EngineConfig(
        model=str(tiny_model_dir), device="cpu",
        offload=OffloadConfig(enabled=True, use_allgather=True),
        parallel=ParallelConfig(data_parallel_size=2),
        scheduler=SchedulerConfig(max_num_seqs=4))).start()
    try:
        before = engine.offload_report(refresh=True)["ranks"]
        handles = [engine.add_request(p) for p in REQUESTS]
        results = [h.result(timeout=120) for h in handles]
        after = engine.offload_report(refresh=True)["ranks"]
    finally:
        engine.shutdown()
    for i, result in enumerate(results):
        assert (result.pixels - alone[i]).abs().max().item() <= TOLERANCE, f"request {i}"
    # Each rank ran its own number of shape groups, yet both ran the same passes and moved
    # the same shard bytes.
    per_rank = [sum(r.rank == rank for r in results) for rank in (0, 1)]
    assert per_rank[0] != per_rank[1] and max(per_rank) >= 2
    assert after[0]["passes"] == after[1]["passes"] > before[0]["passes"]
    assert after[0]["h2d_bytes"] == after[1]["h2d_bytes"]
