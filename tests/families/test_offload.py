"""DLO for every family: declared block lists, residency, mapped backings; offloaded ==
resident exactly (fp32), alone and batched; Wan 2.2's two experts through ONE set of slots."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig
from ditserve.engine.errors import OffloadError
from ditserve.engine.families import WAN
from ditserve.engine.request import SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner

VARIANTS = ["qwen-image", "wan", "wan2.2", "flux2", "flux2-klein"]


def requests(variant: str) -> dict[int, list[tuple[str, SamplingParams]]]:
    video = variant.startswith("wan")
    extra = {"num_frames": 5, "guidance_scale": 1.0} if video else {}
    cfg = {"num_frames": 5, "guidance_scale": 4.0} if video else {"true_cfg_scale": 3.0}
    return {
        0: [("a", SamplingParams(prompt="a red fox", num_inference_steps=5, seed=11,
                                 height=32, width=32, **extra))],
        2: [("b", SamplingParams(prompt="a castle at night", negative_prompt="blurry",
                                 num_inference_steps=3, seed=13, height=32, width=32, **cfg))],
    }


def runner(model_dir: Path, **offload: object) -> ModelRunner:
    config = EngineConfig(model=str(model_dir), device="cpu",
                          offload=OffloadConfig(enabled=True, **offload))  # type: ignore[arg-type]
    return ModelRunner(RunnerConfig.of(config), model_dir=model_dir)


def generate(r: ModelRunner, variant: str) -> dict[str, torch.Tensor]:
    try:
        out, sizes = drive(r, requests(variant), max_num_seqs=2)
    finally:
        r.close()
    assert max(sizes) == 2  # the two requests share forwards (in Wan 2.2: both experts)
    return out


@pytest.fixture(scope="module")
def resident(family_runner):  # type: ignore[no-untyped-def]
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def get(variant: str) -> dict[str, torch.Tensor]:
        if variant not in cache:
            cache[variant], _ = drive(family_runner(variant), requests(variant), max_num_seqs=2)
        return cache[variant]

    return get


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Offloaded == resident. Bitwise on CUDA (test_families_gpu.py); here within 1e-6: on
    the AMD EPYC CI machine a Qwen-Image request (and a Wan 2.2 cache hit) came out up to
    3e-7 apart in float32 at every commit back to the wave-2 one that had been bitwise equal
    on the previous CI machine - a CPU kernel difference, not yet pinned down (docs/offload.md)."""
    assert set(got) == set(want)
    for rid in want:
        torch.testing.assert_close(got[rid], want[rid], atol=1e-6, rtol=0, msg=rid)


@pytest.mark.parametrize("variant", VARIANTS)
def test_dlo_equals_resident_exactly(family_dir, resident, variant: str) -> None:  # type: ignore[no-untyped-def]
    r = runner(family_dir(variant), checkpoint_mmap="off")
    report = r.offload_report()
    assert report["backing_kind"] == "ordinary"
    # tiny DiTs: 2 blocks per expert; FLUX.2's 1 double-stream + 2 single-stream
    layers = {"wan2.2": 4, "flux2": 3, "flux2-klein": 3}.get(variant, 2)
    assert report["streamed_blocks"] == report["blocks"] == layers
    assert_same(generate(r, variant), resident(variant))


@pytest.mark.parametrize("variant", VARIANTS)
def test_checkpoint_mmap_equals_resident(family_dir, resident, variant: str) -> None:  # type: ignore[no-untyped-def]
    r = runner(family_dir(variant))  # auto: on the CPU the checkpoint is mapped
    report = r.offload_report()
    assert report["backing_kind"] == "checkpoint_mmap"
    assert report["skipped_materialization"] is True
    assert report["bound_tensors"] == report["expected_tensors"] > 0
    assert_same(generate(r, variant), resident(variant))


@pytest.mark.parametrize("variant", ["qwen-image", "wan2.2"])
def test_hbm_budget_residency_equals_resident(family_dir, resident, variant: str) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.placement.budget_plan import BudgetError

    probe = runner(family_dir(variant), checkpoint_mmap="off")
    facts = probe.offload_report()
    probe.close()
    # The budget covers the whole pipeline (docs/offload.md, "One HBM budget"): the smallest
    # one it can run in streams every block; one more slot's worth keeps a block resident.
    with pytest.raises(BudgetError) as refused:
        runner(family_dir(variant), checkpoint_mmap="off", hbm_budget_gib=0.0)
    budget = refused.value.minimum_bytes + facts["slot_bytes"] + 1024
    r = runner(family_dir(variant), checkpoint_mmap="off", hbm_budget_gib=budget / 2**30)
    report = r.offload_report()
    assert report["residency"] == "hbm_budget"
    assert report["resident_blocks"] >= 1 and report["streamed_blocks"] >= 1
    assert_same(generate(r, variant), resident(variant))


@pytest.mark.parametrize("variant", ["qwen-image", "wan2.2"])
def test_runtime_cache_build_then_hit_equals_resident(family_dir, resident, variant: str,
                                                      tmp_path) -> None:  # type: ignore[no-untyped-def]
    cache = tmp_path / "cache"
    first = runner(family_dir(variant), runtime_cache=True, cache_root=str(cache))
    report = first.offload_report()
    assert report["backing_kind"] == "runtime_cache"
    assert report["backing_reason"].count("built after an ordinary load") == (
        2 if variant == "wan2.2" else 1)  # one entry per expert
    assert_same(generate(first, variant), resident(variant))

    second = runner(family_dir(variant), runtime_cache=True, cache_root=str(cache))
    report = second.offload_report()
    assert report["backing_kind"] == "runtime_cache"
    assert report["skipped_materialization"] is True  # every DiT mapped, none loaded
    assert report["backing_reason"].count("DiT load skipped") == (2 if variant == "wan2.2" else 1)
    assert_same(generate(second, variant), resident(variant))


def test_wan22_experts_stream_through_one_set_of_slots(family_dir, family_runner) -> None:  # type: ignore[no-untyped-def]
    r = runner(family_dir("wan2.2"), checkpoint_mmap="off")
    one = runner(family_dir("wan"), checkpoint_mmap="off")
    try:
        report, single = r.offload_report(), one.offload_report()
        assert report["resident_block_names"] == []  # everything streams by default
        # Both experts' blocks are streamed, yet the slots are those of one expert: two
        # slots of the largest block, not two per expert.
        assert report["streamed_blocks"] == 2 * single["streamed_blocks"]
        assert report["slots"] == single["slots"] == 2
        assert report["slot_bytes"] == single["slot_bytes"]
        assert report["streamed_bytes"] == 2 * single["streamed_bytes"]
        # A step of one expert moves about one expert's blocks (plus the boundary prefetch).
        before = r.offload_report()["bytes_transferred"]
        params = SamplingParams(prompt="x", num_inference_steps=1, seed=1, height=32,
                                width=32, num_frames=5, guidance_scale=1.0)
        drive(r, {0: [("one-step", params)]}, max_num_seqs=1)
        moved = r.offload_report()["bytes_transferred"] - before
        assert moved < report["streamed_bytes"]
    finally:
        r.close()
        one.close()


def test_declared_block_lists_drive_discovery(family_runner) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.offload.discovery import discover

    for variant in VARIANTS:
        pipeline = family_runner(variant).pipeline
        family = pipeline.family
        found = discover(pipeline.transformer, pipeline.block_lists)
        lists = {name.rsplit(".", 1)[0] for name, _ in found.blocks}
        assert lists == set(pipeline.block_lists)
        prefixes = {n.rsplit(".", 2)[0] for n in pipeline.block_lists if "." in n} or {""}
        expected = {f"{p}.{m}" if p else m for p in prefixes for m in family.resident_modules}
        assert {name for name, _ in found.resident} == expected
        # And the family's declaration alone (no list passed) finds the same blocks of a DiT.
        dit = pipeline.experts[0] if variant.startswith("wan") else pipeline.transformer
        assert [n for n, _ in discover(dit).blocks] == [
            n.split(".", 1)[1] if variant == "wan2.2" else n
            for n, _ in found.blocks[: len(discover(dit).blocks)]]
    assert WAN.block_lists == ("blocks",)


def test_allgather_with_two_experts_is_refused_before_loading(family_dir) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.weights.dit_backing import prepare_dits

    with pytest.raises(OffloadError, match="--dlo-no-use-allgather"):
        prepare_dits(family_dir("wan2.2"), dtype="float32",
                     offload=OffloadConfig(enabled=True), sharded=True)


def test_bf16_wan_maps_its_checkpoint_with_the_ordinary_loads_dtypes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # diffusers loads Wan's norms and modulation tables in float32 whatever the dtype; the
    # builders save them so, and the mapped DiT keeps them so: mapped == loaded, dtype by dtype.
    from ditserve.engine.makers.random_model import init_random
    from ditserve.engine.weights.backing_choice import prepare_dit
    from ditserve.engine.weights.loader import load_dit

    model_dir = init_random(tmp_path / "wan-bf16", family="wan", size="tiny",
                            dtype="bfloat16", device="cpu")
    loaded = load_dit(model_dir, dtype="bfloat16")
    mapped, plan = prepare_dit(model_dir, dtype="bfloat16", offload=OffloadConfig(enabled=True))
    try:
        assert str(plan.kind) == "checkpoint_mmap", plan.reason
        want = {n: t.dtype for n, t in loaded.state_dict().items()}
        assert {n: t.dtype for n, t in mapped.state_dict().items()} == want
        assert torch.float32 in want.values() and torch.bfloat16 in want.values()
        for name, tensor in mapped.state_dict().items():
            assert torch.equal(tensor, loaded.state_dict()[name]), name
    finally:
        plan.close()
