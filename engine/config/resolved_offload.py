"""The offload options decided once: off, rank-local streaming, or AllGather over a group.

``OffloadConfig`` is what a user wrote; ``ResolvedOffload`` is what the engine runs: the mode
(``off`` / ``local`` / ``allgather`` with its group), the components DLO governs and the HBM
budget, plus the few fields runtime sites read (the streaming options the offload layer
takes, the node cache's root). The composition root (``DiffusionEngine``, beside its
``ResolvedScheduling``) resolves it from a judged ``EngineConfig`` and hands it down inside
each rank's ``RunnerConfig`` (``ditserve worker`` and a runner built on its own resolve it by
the same rule, in ``RunnerConfig.of``), so no runtime site re-derives "is AllGather on?" from
the raw options. Pure Python (no torch), like the rest of ``config``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from ditserve.engine.config.types import DloComponents, OffloadConfig, ParallelConfig

OffloadMode = Literal["off", "local", "allgather"]
WeightGroup = Literal["dp", "sp"]
# Text encoders stream rank-locally through two slots, which reach the copy floor for
# rank-local streaming (``offload.builders.DEFAULT_SLOTS``): an encode is short, and DP ranks
# encode different prompts at different times, so there is no group to gather over.
ENCODER_SLOTS = 2


@dataclass(frozen=True, kw_only=True)
class ResolvedOffload:
    """How the DiT's weights live, decided once (module docstring).

    mode: "off" (resident), "local" (streamed from this rank's host memory) or "allgather"
        (each rank keeps 1/group_size of every block and rebuilds it with a collective).
    group_size: the ranks sharing the AllGather shards (1 unless mode is "allgather").
    weight_group: which group AllGather shards over ("dp" or "sp"), None otherwise.
    components: what DLO governs besides the DiT ("all" also parks or streams the text
        encoders; "dit" keeps them resident).
    budget_gib: ``--dlo-hbm-budget-gib`` (GiB, "auto" or None).
    options: the streaming options the offload layer takes (``enable_offload``).
    cache_root: the node cache's root (None: $DITSERVE_CACHE_ROOT or the default); read with
        offload off too, as the compile cache's home.
    """

    mode: OffloadMode = "off"
    group_size: int = 1
    weight_group: WeightGroup | None = None
    components: DloComponents = "all"
    budget_gib: float | str | None = None
    options: OffloadConfig = field(default_factory=OffloadConfig)
    cache_root: str | None = None

    def __post_init__(self) -> None:
        if (self.mode == "allgather") != (self.group_size > 1 and self.weight_group is not None):
            raise ValueError(f"an offload in mode {self.mode!r} cannot have a group of "
                             f"{self.group_size} ({self.weight_group!r}): AllGather and only "
                             "AllGather shards over a group of more than one rank")

    @classmethod
    def of(cls, offload: OffloadConfig, *, parallel: ParallelConfig) -> ResolvedOffload:
        """The resolution rules, for options already judged (``config.validate``):

        - offload not enabled: off (the node cache's root is kept);
        - enabled, ``use_allgather`` and a weight group of more than one rank (DP if dp > 1,
          else SP): allgather over that group;
        - otherwise enabled: local.
        """
        if not offload.enabled:
            return cls(cache_root=offload.cache_root)
        group = parallel.weight_group if offload.use_allgather else None
        size = parallel.weight_group_size if group is not None else 1
        return cls(mode="allgather" if size > 1 else "local", group_size=size,
                   weight_group=group if size > 1 else None, components=offload.components,
                   budget_gib=offload.hbm_budget_gib, options=offload,
                   cache_root=offload.cache_root)

    @property
    def enabled(self) -> bool:
        """The DiT streams (locally or gathered)."""
        return self.mode != "off"

    @property
    def allgather(self) -> bool:
        """Blocks are sharded over ``weight_group`` and rebuilt by a collective."""
        return self.mode == "allgather"

    @property
    def lockstep(self) -> bool:
        """Every block load is a collective across DP ranks, so they step together."""
        return self.allgather and self.weight_group == "dp"

    @property
    def governs_encoders(self) -> bool:
        """DLO parks or streams the text encoders (``components`` "all" under DLO)."""
        return self.enabled and self.components == "all"

    def dit_options(self, *, budget_gib: float | None = None) -> OffloadConfig:
        """The options ``enable_offload`` takes for the DiT; ``budget_gib``: the DiT's share
        of a whole-pipeline budget, in place of the configured one."""
        if budget_gib is None:
            return self.options
        return replace(self.options, hbm_budget_gib=budget_gib)

    def encoder_options(self) -> OffloadConfig:
        """The options a streamed text encoder runs with: rank-local (no group), through
        ``ENCODER_SLOTS`` slots, with the DiT's other options at their defaults (the host
        formats and the node cache describe the DiT's weights, not an encoder's)."""
        return OffloadConfig(enabled=True, slots=ENCODER_SLOTS, use_allgather=False)
