"""The host backing seam: what every way of holding the streamed blocks in host memory offers.

A backing is filled once per streamed block at enable time (``add``), hands the hooks one
copy source per dtype region of a block (``regions``; opaque to the hooks, understood by the
transfer chosen for that backing), reports itself (``report``) and gives the blocks back as
ordinary host tensors at disable (``release``). Three backings implement it today:
``slabs.SlabBacking`` (one pinned slab per block), ``shard_slabs.ShardBacking`` (this rank's
1/group shard of each block), ``mapped.MappedBacking`` (views of read-only file mappings,
optionally registered) and ``packed_slabs.PackedBacking`` (bf16 regions packed losslessly,
whole or as this rank's stripes), whose packed regions ``movement.decode`` decodes between
slot and compute; plan, hooks and handle do not change with the format. (FP8 blocks need no
backing of their own: their fp8 weights and fp32 scales are plain block tensors.)

Read by ``hooks`` (copy sources), ``handle`` (report, release) and the backend's builders.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ditserve.engine.offload.plan import BlockLayout


@dataclass(frozen=True)
class ShardFacts:
    """A shard backing's place in its group and its host bytes."""

    group_size: int
    group_rank: int
    shard_bytes: int  # this rank's host bytes for the streamed blocks


@dataclass(frozen=True)
class MappedFacts:
    """A mapped backing: copies per pass (file-contiguous tensors are merged into one copy)
    and what is registered in place."""

    copies_per_pass: int | None  # None once the backing is closed
    tensors_per_pass: int | None
    registered_bytes: int
    registered_ranges: int
    fallback_reason: str | None  # why the mapping is not registered (None: it is, or not asked)


@dataclass(frozen=True)
class PackedFacts:
    """A packed backing (``--dlo-compress lossless``): this rank's packed bytes of the bf16
    regions, the bf16 bytes they stand for, and the escaped values (exponents outside a group's
    table, stored verbatim)."""

    format: str
    stripes: int
    packed_bytes: int
    raw_bytes: int
    escapes: int


@dataclass(frozen=True)
class BackingReport:
    """What a backing holds: ``backing`` names the kind of host memory ("pageable",
    "pinned-registered", "pinned-registered-shards", "checkpoint_mmap-staging", ...)."""

    backing: str
    host_bytes: int
    pinned_bytes: int  # page-locked bytes this backing holds (registered ranges included)
    shard: ShardFacts | None = None
    mapped: MappedFacts | None = None
    packed: PackedFacts | None = None


class HostBacking(Protocol):
    """The streamed blocks' host bytes, keyed by block index (see module docstring)."""

    def add(self, layout: BlockLayout, tensors: Sequence[torch.Tensor]) -> None:
        """Take block ``layout.index``'s tensors (in layout order) into this backing."""
        ...

    def regions(self, index: int) -> Mapping[Hashable, Any]:
        """Per dtype, the copy source of block ``index``'s region."""
        ...

    @property
    def nbytes(self) -> int:
        """Host bytes behind the streamed blocks (mapped bytes are shared, not private)."""
        ...

    def report(self) -> BackingReport: ...

    def release(self, index: int, *, gather: bool = False) -> list[torch.Tensor]:
        """Forget block ``index``; its tensors as ordinary host tensors (layout order).

        ``gather``: a backing that holds only a shard of the block rebuilds the full tensors
        (a collective: every rank of its group calls it together); without it, it hands
        back empty tensors. Other backings ignore it.
        """
        ...

    def close(self) -> None:
        """Release what is left and everything the backing holds (idempotent)."""
        ...
