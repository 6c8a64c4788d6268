"""Host weight formats through AllGather DLO: two real gloo ranks (see ``formats_target``)."""

from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp
from offload.formats_target import run_rank  # type: ignore[import-not-found]

from ditserve.engine.distributed.rendezvous import host_store


@pytest.mark.slow
def test_packed_and_fp8_blocks_gather_exactly_over_two_gloo_ranks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The equality checks (packed == plain == resident, weights decoded back exactly, FP8
    # DLO == resident FP8) run inside the ranks; a failure there fails the spawn.
    world = 2
    store = host_store(world, 120)
    mp.spawn(run_rank, args=(world, store.port, str(tmp_path)), nprocs=world, join=True)
    facts = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for rank, f in enumerate(facts):
        plain, packed, fp8 = f["plain"], f["packed"], f["fp8"]
        assert packed["group_rank"] == rank and packed["group_size"] == world
        assert packed["transfer"] == "h2d+allgather+decode"
        assert packed["backing"] == "pageable-packed-shards"
        # Each rank holds its stripes of every packed run (and half of the raw fp32 region):
        # 0.75 of its plain shard, plus the stripes' tile padding at these small sizes.
        assert packed["host_bytes"] == packed["shard_bytes"]
        assert 0.75 < packed["packed_ratio"] < 0.82
        assert packed["host_bytes"] < 0.82 * plain["host_bytes"]
        # What crossed "PCIe" is this rank's part; the gathers rebuilt whole packed runs.
        assert packed["h2d_bytes"] * world == packed["gathered_bytes"]
        assert packed["h2d_bytes"] < 0.82 * plain["h2d_bytes"]
        # FP8 blocks: fp8 weights + fp32 scales shard like any region, about half the bytes.
        assert f["fp8_layers"] == 6
        assert fp8["streamed_bytes"] < 0.6 * plain["streamed_bytes"]
    assert facts[0]["packed"]["packed_escapes"] == facts[1]["packed"]["packed_escapes"]
