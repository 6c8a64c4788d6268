"""Shard layout: which contiguous 1/group slice of each streamed block a rank keeps.

Pure (no torch), like ``plan``: built from a ``BlockLayout`` laid out with
``shard_multiple=group``, so every per-dtype flat region already has a length divisible by
the group size. Rank r keeps elements ``[r * n/g, (r + 1) * n/g)`` of each region - the slice
``all_gather_into_tensor`` puts back at exactly that place - so the regions gathered from all
ranks are byte for byte the regions of the single-device host slab (same placements, same
alignment, same zero padding).

A rank's shard of one block is stored as one small slab: the shard of each dtype region, back
to back, each ``ALIGN_BYTES``-aligned (a region's length is a multiple of ``align * group``,
so a shard's length is a multiple of ``align``).

Called by ``host.shard_slabs`` (fills shard slabs) and the backend's builders (size the device
shard slots).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from ditserve.engine.errors import OffloadError
from ditserve.engine.offload.plan import BlockLayout


@dataclass(frozen=True)
class RegionShard:
    """One rank's slice of one dtype region: ``numel`` elements from element ``start``."""

    dtype: Hashable
    itemsize: int
    region_numel: int  # the whole (padded) region: numel * group
    start: int  # first element of the slice within the region
    numel: int
    host_offset: int  # bytes into the rank's shard slab

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class CopyPiece:
    """Part of one tensor that falls in a shard: tensor elements ``[src, src + count)`` go to
    shard elements ``[dst, dst + count)`` of the dtype's region shard."""

    tensor: int  # index into the block's tensors (layout order)
    dtype: Hashable
    src: int
    dst: int
    count: int


@dataclass(frozen=True)
class BlockShard:
    """A rank's shard of one block: per-dtype slices and the tensor pieces that fill them."""

    index: int
    name: str
    rank: int
    group_size: int
    regions: tuple[RegionShard, ...]
    pieces: tuple[CopyPiece, ...]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.regions)


def shard_block(layout: BlockLayout, *, rank: int, group_size: int) -> BlockShard:
    """Rank ``rank``'s contiguous 1/``group_size`` slice of every dtype region of ``layout``."""
    if group_size < 1 or not 0 <= rank < group_size:
        raise OffloadError(f"rank {rank} is outside a group of {group_size}")
    regions: list[RegionShard] = []
    host_offset = 0
    for r in layout.regions:
        if r.numel % group_size:
            raise OffloadError(
                f"block {layout.name}: a {r.numel}-element region cannot be split over "
                f"{group_size} ranks; lay it out with shard_multiple={group_size}"
            )
        n = r.numel // group_size
        regions.append(RegionShard(r.dtype, r.itemsize, r.numel, rank * n, n, host_offset))
        host_offset += n * r.itemsize
    by_dtype = {s.dtype: s for s in regions}
    pieces: list[CopyPiece] = []
    for i, t in enumerate(layout.tensors):
        s = by_dtype[t.dtype]
        lo = max(t.offset, s.start)
        hi = min(t.offset + t.numel, s.start + s.numel)
        if lo < hi:  # this tensor overlaps the rank's slice
            pieces.append(CopyPiece(i, t.dtype, lo - t.offset, lo - s.start, hi - lo))
    return BlockShard(layout.index, layout.name, rank, group_size, tuple(regions), tuple(pieces))


def shard_slot_numel(shards: Sequence[BlockShard]) -> dict[Hashable, tuple[int, int]]:
    """Per dtype, (itemsize, largest shard numel): the size of one device shard slot."""
    sizes: dict[Hashable, tuple[int, int]] = {}
    for shard in shards:
        for r in shard.regions:
            _, numel = sizes.get(r.dtype, (r.itemsize, 0))
            sizes[r.dtype] = (r.itemsize, max(numel, r.numel))
    return sizes
