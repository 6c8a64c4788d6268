"""Data parallelism over the families (gloo, two CPU ranks): Qwen-Image and Wan 2.1 with DLO
AllGather shards (each rank holds half of every block) equal the resident result; Wan 2.2's
two experts stream rank-locally (AllGather is refused for them, see test_offload)."""

from __future__ import annotations

import pytest
from engine.driver import drive  # type: ignore[import-not-found]
from families.family_support import true_cfg  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, OffloadConfig, ParallelConfig, SchedulerConfig
from ditserve.engine.loop.engine import DiffusionEngine
from ditserve.engine.request import SamplingParams

pytestmark = pytest.mark.slow
TOLERANCE = 1e-4  # batching changes the reduction order (as tests/distributed)


def requests(variant: str) -> list[SamplingParams]:
    video = variant.startswith("wan")
    base = {"height": 32, "width": 32, **({"num_frames": 5} if video else {})}
    return [
        SamplingParams(prompt="a red fox", num_inference_steps=3, seed=21,
                       guidance_scale=1.0, **base),
        SamplingParams(prompt="a castle", negative_prompt="fog", num_inference_steps=2,
                       seed=22, guidance_scale=3.0, **base, **true_cfg(variant)),
        SamplingParams(prompt="a lake", num_inference_steps=4, seed=23, guidance_scale=1.0,
                       **base),
    ]


@pytest.mark.parametrize(("variant", "allgather"),
                         [("qwen-image", True), ("wan", True), ("wan2.2", False),
                          ("flux2", True)])
def test_dp2_generation_equals_resident(family_dir, family_runner, monkeypatch,
                                        variant: str, allgather: bool) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("DITSERVE_WORKER_TIMEOUT_S", "120")
    wanted = requests(variant)
    alone = []
    for i, params in enumerate(wanted):
        pixels, _ = drive(family_runner(variant), {0: [(f"solo{i}", params)]}, max_num_seqs=1)
        alone.append(pixels[f"solo{i}"])
    config = EngineConfig(
        model=str(family_dir(variant)), device="cpu",
        offload=OffloadConfig(enabled=True, use_allgather=allgather),
        parallel=ParallelConfig(data_parallel_size=2), scheduler=SchedulerConfig(max_num_seqs=2),
    )
    engine = DiffusionEngine(config).start()
    try:
        results = [h.result(timeout=180) for h in [engine.add_request(p) for p in wanted]]
        ranks = engine.offload_report(refresh=True)["ranks"]
    finally:
        engine.shutdown()
    for i, result in enumerate(results):
        assert (result.pixels - alone[i]).abs().max().item() <= TOLERANCE, f"request {i}"
    assert len(ranks) == 2
    if allgather:
        assert {r["transfer"] for r in ranks} == {"h2d+allgather"}
        assert {r["shard_bytes"] for r in ranks} == {ranks[0]["streamed_bytes"] // 2}
        assert ranks[0]["passes"] == ranks[1]["passes"] > 0
    else:
        assert {r["group_size"] for r in ranks} == {1}
        assert {r["streamed_blocks"] for r in ranks} == {4}  # both experts, on each rank
