"""Ulysses sequence parallelism on the families' tiny DiTs: sharded forward == plain forward.

Two gloo ranks (one spawn for every case, ~15 s: each process imports torch and diffusers)
run each family's DiT plain and sharded (``sp_target``); token counts that divide by the
group and ones that need padding, several rows, masked prompts, cross attention and per-token
timesteps. The pure token layout is checked here without processes.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp
from distributed.sp_target import CASES, run_rank  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, ParallelConfig, sequence_parallel_problems
from ditserve.engine.distributed.rendezvous import host_store
from ditserve.engine.distributed.topology import Topology
from ditserve.engine.errors import ConfigError
from ditserve.engine.loop.engine import DiffusionEngine, EnginePhase
from ditserve.engine.parallel.sharding import attention_heads
from ditserve.engine.parallel.tokens import TokenShard, key_mask


@pytest.mark.parametrize(("total", "parts"), [(16, 2), (15, 2), (7, 4), (3, 4), (45, 3)])
def test_shards_tile_the_padded_sequence_and_only_padding_is_masked(total: int, parts: int) -> None:
    x = torch.arange(total, dtype=torch.float32)[None, :, None] + 1  # (1, total, 1), no zeros
    shards = [TokenShard(total, parts, r) for r in range(parts)]
    pieces = torch.cat([s.take(x, 1) for s in shards], dim=1)
    assert pieces.shape[1] == shards[0].padded and shards[0].padded % parts == 0
    assert torch.equal(pieces[:, :total], x)  # every token once, in order
    assert torch.count_nonzero(pieces[:, total:]) == 0  # then zeros
    mask = key_mask([(shards[0], None)], rows=2, device=torch.device("cpu"))
    if total % parts == 0:
        assert mask is None  # nothing to mask: attention keeps its unmasked path
    else:
        assert mask is not None and mask.shape == (2, shards[0].padded)
        assert mask[0].tolist() == [True] * total + [False] * (shards[0].padded - total)


def test_joint_key_mask_follows_the_all_to_all_order() -> None:
    # Text of 3 tokens (row 1: 2 real) and image of 5, over 2 ranks: rank r's keys are
    # [text_r, image_r], ranks in order.
    text, image = TokenShard(3, 2, 0), TokenShard(5, 2, 0)
    real_text = torch.tensor([[True, True, True], [True, True, False]])
    mask = key_mask([(text, real_text), (image, None)], rows=2, device=torch.device("cpu"))
    assert mask is not None
    t, i = True, False  # readability: real / masked
    assert mask[0].tolist() == [t, t, t, t, t] + [t, i, t, t, i]
    assert mask[1].tolist() == [t, t, t, t, t] + [i, i, t, t, i]


@pytest.mark.slow
def test_sequence_parallel_dits_equal_the_plain_forward(tmp_path) -> None:  # type: ignore[no-untyped-def]
    world = 2
    store = host_store(world, 120)
    mp.spawn(run_rank, args=(world, store.port, str(tmp_path)), nprocs=world, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for name, (_, inputs) in CASES.items():
        for rank in ranks:
            assert len(rank[name]) == len(inputs)
            for case, result in enumerate(rank[name]):
                # fp32: only the order of the attention's key sum differs (joint streams).
                assert result["diff"] <= 1e-5, f"{name} case {case}: {result}"
                # The first block saw this rank's slice of the (padded) image tokens.
                assert result["sharded"] == -(-result["plain"] // world), f"{name} case {case}"
    # A peer that never joins: rank 0's all-to-all gave up with gloo's timeout error.
    assert "time" in ranks[0]["hung_peer"].lower(), ranks[0]["hung_peer"]


def test_head_counts_are_read_off_plain_and_grouped_query_attentions() -> None:
    # diffusers' Attention spells its count ``heads``; Cosmos3's grouped-query attention
    # ``num_attention_heads`` and ``num_key_value_heads``: Ulysses must split all of them.
    from diffusers.models.attention_processor import Attention

    class GroupedQuery(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.processor = object()
            self.num_attention_heads, self.num_key_value_heads = 32, 8

    model = torch.nn.ModuleList([Attention(query_dim=16, heads=4, dim_head=4), GroupedQuery()])
    assert attention_heads(model) == (4, 8, 32)
    with pytest.raises(ConfigError, match="no attention with a head count"):
        attention_heads(torch.nn.Linear(2, 2))


def test_the_heads_rule_names_each_dit_and_the_sizes_that_fit() -> None:
    assert sequence_parallel_problems(1, {"transformer": 3}) == []
    assert sequence_parallel_problems(4, {"transformer": 24, "transformer_2": 40}) == []
    (problem,) = sequence_parallel_problems(3, {"transformer": 24, "transformer_2": 40})
    assert "40 attention heads of the model's transformer_2" in problem
    assert "use one of 1, 2, 4, 5, 8, 10" in problem


def test_an_engine_refuses_sp_sizes_its_model_cannot_split_before_spawning(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    # The tiny Flux has 2 heads; nothing is spawned or loaded before the refusal.
    config = EngineConfig(model=str(tiny_model_dir), device="cpu",
                          parallel=ParallelConfig(sequence_parallel_size=3))
    engine = DiffusionEngine(config)
    with pytest.raises(ConfigError, match="does not divide the 2 attention heads"):
        engine.start()
    assert engine.phase is EnginePhase.FAILED


@pytest.mark.parametrize(("dp", "sp", "sequence", "weight"), [
    (1, 1, (), ()),
    (2, 1, (), ((0, 1),)),  # DP only: the weight group is every process
    (1, 2, ((0, 1),), ((0, 1),)),  # SP only: DLO shards over the SP group
    (2, 2, ((0, 1), (2, 3)), ((0, 2), (1, 3))),  # DP first: same SP index across DP ranks
    (3, 2, ((0, 1), (2, 3), (4, 5)), ((0, 2, 4), (1, 3, 5))),
])
def test_topology_names_the_sp_and_weight_groups(dp: int, sp: int, sequence: tuple,  # type: ignore[type-arg]
                                                 weight: tuple) -> None:  # type: ignore[type-arg]
    topology = Topology(dp, sp)
    assert topology.sequence_groups == sequence
    assert topology.weight_groups == weight
    assert [tuple(topology.processes(d)) for d in range(dp)] == list(sequence or
                                                                     ((d,) for d in range(dp)))
    every = sorted(p for group in weight or ((p,) for p in range(dp * sp)) for p in group)
    assert every == list(range(dp * sp))  # each process in exactly one weight group


def test_sp_engines_key_their_node_cache_entry_by_placement(tiny_model_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from ditserve.cachectl.store import CacheStore
    from ditserve.engine.config import OffloadConfig
    from ditserve.engine.weights.dit_backing import prepare_dits

    offload = OffloadConfig(enabled=True, runtime_cache=True, cache_root=str(tmp_path))
    for sp_size in (1, 2):
        _, plan = prepare_dits(tiny_model_dir, dtype="float32", offload=offload, sp_size=sp_size)
        plan.close()
    parallel = sorted((e.identity or {})["parallel"]["sp_size"] for e in CacheStore(tmp_path).list())
    assert parallel == [1, 2]  # an SP 2 replica has its own entry (its ranks share it)
    (sp2,) = [e.identity for e in CacheStore(tmp_path).list()
              if e.identity and e.identity["parallel"]["sp_size"] == 2]
    assert sp2["parallel"]["sp_impl"] == "ulysses"
