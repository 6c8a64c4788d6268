"""The offload decided once (``engine.config.resolved_offload``): each resolution rule, what
the runtime sites read off the result, and that the raw option is read only where it is
resolved."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from engine.test_runner_config import BELOW_THE_CUT  # type: ignore[import-not-found]

from ditserve.engine.config import OffloadConfig, ParallelConfig, ResolvedOffload
from ditserve.engine.config.resolved_offload import ENCODER_SLOTS
from ditserve.engine.distributed.topology import Topology

ENGINE = Path(__file__).resolve().parents[2] / "engine"
# Where the raw option may be read: the composition root, resolving it once for every rank the
# engine starts. A launched rank (`ditserve worker`) and a runner built on its own, as tests
# and tools build one, resolve it by the same rule through ``config.RunnerConfig.of``.
COMPOSITION_ROOTS = {"loop/engine.py"}


def test_offload_not_enabled_is_off_and_keeps_the_cache_root() -> None:
    resolved = ResolvedOffload.of(OffloadConfig(cache_root="/cache"),
                                  parallel=ParallelConfig(data_parallel_size=2))
    assert (resolved.mode, resolved.enabled, resolved.cache_root) == ("off", False, "/cache")
    assert not resolved.governs_encoders


def test_a_weight_group_of_several_ranks_gathers_over_it() -> None:
    dp = ResolvedOffload.of(OffloadConfig(enabled=True),
                            parallel=ParallelConfig(data_parallel_size=4))
    sp = ResolvedOffload.of(OffloadConfig(enabled=True),
                            parallel=ParallelConfig(sequence_parallel_size=2))
    assert (dp.mode, dp.group_size, dp.weight_group, dp.lockstep) == ("allgather", 4, "dp", True)
    # SP ranks already run in lockstep within their group: no DP-wide step group.
    assert (sp.mode, sp.group_size, sp.weight_group, sp.lockstep) == ("allgather", 2, "sp", False)


def test_no_group_or_allgather_turned_off_streams_locally() -> None:
    alone = ResolvedOffload.of(OffloadConfig(enabled=True), parallel=ParallelConfig())
    declined = ResolvedOffload.of(OffloadConfig(enabled=True, use_allgather=False),
                                  parallel=ParallelConfig(data_parallel_size=4))
    for resolved in (alone, declined):
        assert (resolved.mode, resolved.group_size, resolved.weight_group) == ("local", 1, None)
        assert resolved.enabled and not resolved.allgather and not resolved.lockstep


def test_the_budget_and_components_come_through_and_decide_the_encoders() -> None:
    resolved = ResolvedOffload.of(OffloadConfig(enabled=True, hbm_budget_gib=40.0,
                                                components="dit"), parallel=ParallelConfig())
    assert (resolved.budget_gib, resolved.components) == (40.0, "dit")
    assert not resolved.governs_encoders
    assert resolved.dit_options().hbm_budget_gib == 40.0
    assert resolved.dit_options(budget_gib=12.5).hbm_budget_gib == 12.5


def test_encoders_stream_rank_locally_through_their_own_slots() -> None:
    resolved = ResolvedOffload.of(
        OffloadConfig(enabled=True, slots=8, compress="lossless", resident_layers=2),
        parallel=ParallelConfig(data_parallel_size=2))
    assert resolved.encoder_options() == OffloadConfig(enabled=True, slots=ENCODER_SLOTS,
                                                       use_allgather=False)


def test_a_group_belongs_to_allgather_only() -> None:
    with pytest.raises(ValueError, match="AllGather"):
        ResolvedOffload(mode="local", group_size=2, weight_group="dp")
    with pytest.raises(ValueError, match="AllGather"):
        ResolvedOffload(mode="allgather")


def test_dp_ranks_step_together_only_when_they_gather() -> None:
    parallel = ParallelConfig(data_parallel_size=2)
    gathered = ResolvedOffload.of(OffloadConfig(enabled=True), parallel=parallel)
    local = ResolvedOffload.of(OffloadConfig(enabled=True, use_allgather=False),
                               parallel=parallel)
    assert Topology.of(parallel, offload=gathered).step_groups == ((0, 1),)
    assert Topology.of(parallel, offload=local).step_groups == ((0,), (1,))


def _raw_offload_reads(path: Path) -> int:
    """Reads of ``<config>.offload`` (the raw option group), by an ``EngineConfig`` named
    ``config`` or held as ``<x>.config``."""
    count = 0
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and node.attr == "offload":
            owner = node.value
            named = (owner.id if isinstance(owner, ast.Name)
                     else owner.attr if isinstance(owner, ast.Attribute) else None)
            count += named == "config"
    return count


def _holds_root_configs(path: Path) -> bool:
    """Whether a ``config`` in ``path`` may be an ``EngineConfig``: not in ``config`` itself,
    nor below the cut, where ``config`` is a ``RunnerConfig`` whose ``offload`` is resolved
    (test_runner_config keeps the root config out of there)."""
    relative = path.relative_to(ENGINE)
    return relative.parts[0] != "config" and relative.parts[0] not in BELOW_THE_CUT


def test_the_raw_offload_option_is_read_only_where_it_is_resolved() -> None:
    reads = {str(path.relative_to(ENGINE)): n for path in sorted(ENGINE.rglob("*.py"))
             if _holds_root_configs(path) and (n := _raw_offload_reads(path))}
    assert set(reads) <= COMPOSITION_ROOTS, (
        "read the resolved offload (engine.config.ResolvedOffload, handed down from the "
        f"composition root) instead of config.offload: {reads}")
    assert all(n == 1 for n in reads.values()), f"each root resolves once: {reads}"
