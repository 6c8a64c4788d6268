"""Sequence parallelism over the families (gloo, two CPU processes of one DP rank): Qwen-Image
with DLO AllGather over the SP group, Wan 2.2 (two experts, a batch straddling the boundary)
with rank-local DLO (AllGather streams one DiT only), and Wan 2.2 TI2V resident, equal the
single-process resident result; so does Z-Image with DLO AllGather (its refiners' and main
layers' streams each sharded, prompts of different lengths masked, CFG rows). The sizes need
padding: 48 px is 3 x 3 Qwen-Image tokens; 9 frames at 48 px are 3 x 3 x 3 Wan 2.2 tokens
(TI2V's 16x VAE: 96 px); the
Qwen-Image prompts differ in length (masked text) and CFG adds negative-prompt rows."""

from __future__ import annotations

import pytest
from engine.driver import drive  # type: ignore[import-not-found]
from families.family_support import true_cfg  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, OffloadConfig, ParallelConfig, SchedulerConfig
from ditserve.engine.loop.engine import DiffusionEngine
from ditserve.engine.request import SamplingParams

pytestmark = pytest.mark.slow
TOLERANCE = 1e-4  # fp32; the SP attention sums keys in another order (as batching does)


def requests(variant: str) -> list[SamplingParams]:
    video = variant.startswith("wan")
    side = 96 if variant == "wan2.2-ti2v" else 48  # odd token grids: padded shards
    base = {"height": side, "width": side, **({"num_frames": 9} if video else {})}
    return [
        SamplingParams(prompt="a red fox in the snow", num_inference_steps=3, seed=31,
                       guidance_scale=1.0, **base),
        SamplingParams(prompt="castle", negative_prompt="fog and rain", num_inference_steps=2,
                       seed=32, guidance_scale=3.0, **base, **true_cfg(variant)),
        SamplingParams(prompt="a lake", num_inference_steps=4, seed=33, guidance_scale=1.0,
                       **base),
    ]


@pytest.mark.parametrize(("variant", "offload"), [
    ("qwen-image", OffloadConfig(enabled=True)),
    ("flux2", OffloadConfig(enabled=True)),
    ("flux2-klein", OffloadConfig()),
    ("wan2.2", OffloadConfig(enabled=True, use_allgather=False)),
    ("wan2.2-ti2v", OffloadConfig()),
    ("z-image", OffloadConfig(enabled=True)),
])
def test_sp2_generation_equals_resident(family_dir, family_runner, monkeypatch,
                                        variant: str, offload: OffloadConfig) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("DITSERVE_WORKER_TIMEOUT_S", "120")
    wanted = requests(variant)
    alone = []
    for i, params in enumerate(wanted):
        pixels, _ = drive(family_runner(variant), {0: [(f"solo{i}", params)]}, max_num_seqs=1)
        alone.append(pixels[f"solo{i}"])
    config = EngineConfig(
        model=str(family_dir(variant)), device="cpu", offload=offload,
        parallel=ParallelConfig(sequence_parallel_size=2),
        scheduler=SchedulerConfig(max_num_seqs=3),
    )
    engine = DiffusionEngine(config).start()
    try:
        results = [h.result(timeout=240) for h in [engine.add_request(p) for p in wanted]]
        report = engine.offload_report(refresh=True)
        stats = engine.stats()
    finally:
        engine.shutdown()
    for i, result in enumerate(results):
        assert (result.pixels - alone[i]).abs().max().item() <= TOLERANCE, f"request {i}"
    assert stats.mean_batch_rows > 1  # the requests shared forwards
    if offload.enabled and offload.use_allgather:
        ranks = report["ranks"]
        assert {r["transfer"] for r in ranks} == {"h2d+allgather"}
        assert {r["shard_bytes"] for r in ranks} == {ranks[0]["streamed_bytes"] // 2}
        assert ranks[0]["passes"] == ranks[1]["passes"] > 0
