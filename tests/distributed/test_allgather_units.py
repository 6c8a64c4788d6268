"""AllGather DLO at unit level: the pure shard layout, and real gloo ranks (2 and 3 processes)."""

from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp
from distributed.allgather_target import run_rank  # type: ignore[import-not-found]

from ditserve.engine.distributed.rendezvous import host_store
from ditserve.engine.errors import OffloadError
from ditserve.engine.offload.plan import ALIGN_BYTES, TensorSpec, build_plan, layout_block
from ditserve.engine.offload.shards import shard_block, shard_slot_numel

SPECS = [
    TensorSpec("a", "f32", 4, (37, 5)),
    TensorSpec("b", "f64", 8, (3,)),
    TensorSpec("c", "f32", 4, (1000,)),
    TensorSpec("d", "f64", 8, (129, 2)),
]


@pytest.mark.parametrize("group", [1, 2, 3, 4])
def test_shards_tile_every_region_and_cover_every_element_once(group: int) -> None:
    layout = layout_block(0, "blk", SPECS, shard_multiple=group)
    shards = [shard_block(layout, rank=r, group_size=group) for r in range(group)]
    for region in layout.regions:
        slices = [next(s for s in shard.regions if s.dtype == region.dtype) for shard in shards]
        # Contiguous, equal, in rank order, tiling the padded region exactly.
        assert [s.start for s in slices] == [r * region.numel // group for r in range(group)]
        assert {s.numel for s in slices} == {region.numel // group}
        assert (slices[0].numel * region.itemsize) % ALIGN_BYTES == 0
    covered: dict[int, list[int]] = {}
    for shard in shards:
        for piece in shard.pieces:
            covered.setdefault(piece.tensor, []).extend(range(piece.src, piece.src + piece.count))
    for i, spec in enumerate(SPECS):
        assert sorted(covered[i]) == list(range(spec.numel)), spec.name
    # A rank's host bytes are 1/group of the padded block.
    assert shards[0].nbytes * group == layout.nbytes


def test_shard_slot_is_the_largest_shard_per_dtype() -> None:
    plan = build_plan([("x", SPECS), ("y", SPECS[:2])], shard_multiple=3)
    shards = [shard_block(b, rank=1, group_size=3) for b in plan.blocks]
    sizes = shard_slot_numel(shards)
    for dtype, itemsize, numel in plan.slot.regions:
        assert sizes[dtype] == (itemsize, numel // 3)


def test_shard_refuses_unpadded_regions_and_bad_ranks() -> None:
    with pytest.raises(OffloadError, match="shard_multiple=5"):  # 192 elements, not / 5
        shard_block(layout_block(0, "blk", SPECS[:1]), rank=0, group_size=5)
    with pytest.raises(OffloadError, match="outside"):
        shard_block(layout_block(0, "blk", SPECS[:1], shard_multiple=2), rank=2, group_size=2)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "slots"), [(2, 2), (3, None), (2, 4)])
def test_gloo_ranks_gather_exact_blocks(tmp_path, world: int, slots: int | None) -> None:  # type: ignore[no-untyped-def]
    # Every check (bit-identical gathered blocks, exact forwards, idle passes, a faulting
    # forward, collective restore) runs inside the ranks; a failure there fails the spawn.
    store = host_store(world, 60)
    mp.spawn(run_rank, args=(world, store.port, str(tmp_path), "gloo", slots), nprocs=world,
             join=True)
    facts = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    model_bytes = facts[0]["model_block_bytes"]
    streamed = facts[0]["report"]["streamed_bytes"]
    for rank, f in enumerate(facts):
        report = f["report"]
        assert report["group_rank"] == rank and report["group_size"] == world
        # Host bytes per rank: exactly 1/group of the padded streamed blocks, which exceed
        # the model's block bytes only by alignment padding.
        assert report["shard_bytes"] == report["host_bytes"] == streamed // world
        assert streamed % world == 0
        assert model_bytes <= streamed <= model_bytes + 5 * 5 * world * ALIGN_BYTES
        # Each rank moved only its shards over "PCIe" and gathered whole blocks.
        final = f["final"]
        assert final["h2d_bytes"] * world == final["gathered_bytes"]
        assert final["passes"] == f["passes"]
    # Every rank ran the same number of passes, so every collective was matched.
    assert len({f["passes"] for f in facts}) == 1


@pytest.mark.gpu
@pytest.mark.parametrize(("slots", "gather"), [(2, "nccl"), (4, "nccl"), (2, "copy-engine"),
                                               (4, "copy-engine")])
def test_nccl_ranks_gather_exact_blocks(tmp_path, slots: int, gather: str) -> None:  # type: ignore[no-untyped-def]
    # The CUDA path: shard H2D on the copy stream, all_gather (or peer-to-peer copies through
    # symmetric memory) on the comm stream, events and signals.
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    store = host_store(2, 60)
    mp.spawn(run_rank, args=(2, store.port, str(tmp_path), "nccl", slots, gather), nprocs=2,
             join=True)
    facts = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert facts[0]["final"]["transfer"] == (
        "h2d+p2p-copy" if gather == "copy-engine" else "h2d+allgather")
    assert facts[0]["final"]["pinned_host_bytes"] == facts[0]["final"]["shard_bytes"]
    assert facts[0]["passes"] == facts[1]["passes"]
