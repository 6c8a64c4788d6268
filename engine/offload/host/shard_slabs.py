"""Shard storage: this rank's 1/group slice of every streamed block, in one small slab each.

The AllGather counterpart of ``host.HostStorage``: same ``add`` / ``regions`` / ``release``
surface, but a block's slab holds only the rank's contiguous slice of each per-dtype region
(``shards.shard_block``), so host memory per rank is about streamed bytes / group. Slabs come
from the transfer's ``allocate_host`` (page-locked on CUDA). ``add`` copies only the pieces of
the block's tensors that fall in the slice - the full block is never assembled on the host -
and zeroes the padding, so the gathered regions are deterministic.

The full blocks exist on no single rank: ``release`` hands nothing back; rebuilding them is a
collective (``gather.GatherTransfer.gather_full``).

Called by ``backend.enable_offload`` (build, release); ``hooks`` read the shard regions as the
sources of each load.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from ditserve.engine.offload.plan import BlockLayout
from ditserve.engine.offload.shards import BlockShard, shard_block


class ShardStorage:
    """Shard slabs of the streamed blocks for one rank, keyed by block index."""

    def __init__(self, allocator, *, rank: int, group_size: int) -> None:  # allocator: a transfer
        self._allocator = allocator
        self.rank = rank
        self.group_size = group_size
        self._slabs: dict[int, torch.Tensor] = {}
        self._shards: dict[int, BlockShard] = {}

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for s in self._slabs.values())

    def shard(self, index: int) -> BlockShard:
        return self._shards[index]

    def shards(self) -> list[BlockShard]:
        return list(self._shards.values())

    def add(self, layout: BlockLayout, tensors: Sequence[torch.Tensor]) -> None:
        """Allocate the block's shard slab and copy this rank's slice of ``tensors`` into it."""
        shard = shard_block(layout, rank=self.rank, group_size=self.group_size)
        slab = self._allocator.allocate_host(shard.nbytes)
        self._slabs[layout.index] = slab
        self._shards[layout.index] = shard
        slab.zero_()  # padding between and after tensors
        regions = self.regions(layout.index)
        flat: dict[int, torch.Tensor] = {}
        for piece in shard.pieces:
            if piece.tensor not in flat:  # (a non-contiguous tensor is copied once here)
                flat[piece.tensor] = tensors[piece.tensor].detach().reshape(-1)
            src = flat[piece.tensor][piece.src : piece.src + piece.count]
            regions[piece.dtype][piece.dst : piece.dst + piece.count].copy_(src)

    def regions(self, index: int) -> dict[Hashable, torch.Tensor]:
        """The rank's slice of each dtype region of the block (copy sources of a load)."""
        slab = self._slabs[index]
        return {
            r.dtype: slab[r.host_offset : r.host_offset + r.nbytes].view(r.dtype)  # type: ignore[arg-type]
            for r in self._shards[index].regions
        }

    def release(self, index: int) -> None:
        """Unpin and drop the block's shard slab."""
        slab = self._slabs.pop(index)
        self._shards.pop(index)
        self._allocator.free_host(slab)

    def release_all(self) -> None:
        for index in list(self._slabs):
            self.release(index)
