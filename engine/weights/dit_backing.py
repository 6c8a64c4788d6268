"""The host backings of a model's DiTs under offload, one per DiT, as one HostWeightPlan.

Most families have one DiT (``transformer``): its backing and plan come from
``weights.backing_choice.prepare_dit`` unchanged. Wan 2.2 has two experts that offload streams
as one ``ExpertStack`` (names prefixed by component: ``transformer.blocks.0...``,
``transformer_2.blocks.0...``). Each expert gets its own backing (checkpoint mmap of its own
folder, or its own node-cache entry, keyed by component), and the plans are combined under
the stack's names: all mapped alike -> one mapped plan over both experts' mappings; any mix
-> an ordinary plan (the backend copies every streamed tensor into its own slabs, whatever
it views) that says why. The combined plan owns the experts' plans and closes them with it.

Called by the model runner when offload is enabled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from ditserve.engine.config import OffloadConfig
from ditserve.engine.errors import OffloadError
from ditserve.engine.offload.host.weight_plan import BackingKind, Coverage, HostWeightPlan
from ditserve.engine.weights.host_fit import HostFit


def prepare_dits(
    model_dir: str | Path,
    *,
    dtype: str,
    offload: OffloadConfig,
    sp_size: int = 1,
    streams_from_mapping: bool = False,
    sharded: bool = False,
    keep_private: str | None = None,
    host_fit: HostFit | None = None,
) -> tuple[dict[str, nn.Module], HostWeightPlan]:
    """Every DiT of the model (by component) with its backing, and the one plan for them.

    keep_private: why the DiTs' tensors will be replaced after loading (``--quantization``):
    each is then loaded ordinarily (see ``backing_choice.prepare_dit``).
    sp_size: the replica's sequence-parallel size (the node cache entry's identity has it).
    host_fit: the load's host plan (``weights.host_check``), whose DiT backing ``auto`` follows.

    sharded: offload will keep 1/group shards and rebuild blocks with a collective; refused
    for several experts (a step may run one expert on one rank and the other elsewhere, so
    the ranks' collectives could not stay matched).
    """
    from ditserve.engine.weights.backing_choice import prepare_dit
    from ditserve.engine.weights.loader import dit_components

    components = dit_components(model_dir)
    if sharded and len(components) > 1:
        raise OffloadError(
            f"{str(model_dir)!r} has {len(components)} experts ({', '.join(components)}); "
            "AllGather sharding streams one DiT only - set offload.use_allgather=false "
            "(--dlo-no-use-allgather) to stream each rank's experts rank-locally"
        )
    prepared: dict[str, tuple[nn.Module, HostWeightPlan]] = {}
    try:
        for name in components:
            prepared[name] = prepare_dit(model_dir, dtype=dtype, offload=offload,
                                         sp_size=sp_size,
                                         streams_from_mapping=streams_from_mapping,
                                         component=name, keep_private=keep_private,
                                         host_fit=host_fit)
    except BaseException:
        for _, plan in prepared.values():
            plan.close()
        raise
    dits = {name: module for name, (module, _) in prepared.items()}
    if len(prepared) == 1:
        (plan,) = (p for _, p in prepared.values())
        return dits, plan
    return dits, combine_plans({name: plan for name, (_, plan) in prepared.items()})


class _SubPlans:
    """The lease of a combined plan: closing it closes every expert's own plan."""

    def __init__(self, plans: Mapping[str, HostWeightPlan]) -> None:
        self._plans = list(plans.values())

    def close(self) -> None:
        for plan in self._plans:
            plan.close()


def combine_plans(plans: Mapping[str, HostWeightPlan]) -> HostWeightPlan:
    """One plan for an ExpertStack from each expert's plan (see module doc); consumes them."""
    reason = "; ".join(f"{name}: {plan.reason}" for name, plan in plans.items())
    kinds = {plan.kind for plan in plans.values()}
    sources: dict[str, Any] = {}
    for name, plan in plans.items():
        sources.update({f"{name}.{key}": view for key, view in plan.consume().items()})
    lease = _SubPlans(plans)
    first = next(iter(plans.values()))
    if len(kinds) > 1 or not first.mapped:
        # An expert bound to a mapping has no private copy; as an ordinary backing its views
        # are copied into the backend's slabs like any tensor, and the mapping goes with the
        # last view.
        why = reason if len(kinds) == 1 else (
            f"experts on different backings, all streamed from private slabs ({reason})")
        return HostWeightPlan(BackingKind.ORDINARY, reason=why, lease=lease)
    bindings = {
        f"{name}.{key}": dataclasses.replace(binding, name=f"{name}.{key}")
        for name, plan in plans.items() for key, binding in plan.bindings.items()
    }
    coverage = Coverage(
        expected=sum(p.coverage.expected for p in plans.values()),
        bound=sum(p.coverage.bound for p in plans.values()),
        bound_bytes=sum(p.coverage.bound_bytes for p in plans.values()),
    )
    return HostWeightPlan(
        first.kind, reason=reason, bindings=bindings, sources=sources,
        mappings=[m for p in plans.values() for m in p.mappings], coverage=coverage,
        skipped_materialization=any(p.skipped_materialization for p in plans.values()),
        lease=lease,
        auto_pin_limit_bytes=sum(p.auto_pin_limit_bytes for p in plans.values()),
    )
