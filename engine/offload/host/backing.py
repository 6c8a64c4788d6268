"""The host backing seam: what every way of holding the streamed blocks in host memory offers.

A backing is filled once per streamed block at enable time (``add``), hands the hooks one
copy source per dtype region of a block (``regions``; opaque to the hooks, understood by the
transfer chosen for that backing), reports itself (``report``) and gives the blocks back as
ordinary host tensors at disable (``release``). Three backings implement it today:
``slabs.SlabBacking`` (one pinned slab per block), ``shard_slabs.ShardBacking`` (this rank's
1/group shard of each block) and ``mapped.MappedBacking`` (views of read-only file mappings,
optionally registered). A new host format (packed or FP8 weights with scales) is one more
backing whose regions hold the encoded bytes, paired with a transfer that decodes them
between slot and compute; plan, hooks and handle do not change.

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
class BackingReport:
    """What a backing holds: ``backing`` names the kind of host memory ("pageable",
    "pinned-registered", "pinned-registered-shards", "checkpoint_mmap-staging", ...)."""

    backing: str
    host_bytes: int
    pinned_bytes: int  # page-locked bytes this backing holds (registered ranges included)
    shard: ShardFacts | None = None
    mapped: MappedFacts | None = None


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
