"""Shard backing: this rank's 1/group slice of every streamed block, in one small slab each.

The AllGather counterpart of ``slabs.SlabBacking``: same ``HostBacking`` surface, but a
block's slab holds only the rank's contiguous slice of each per-dtype region
(``shards.shard_block``), so host memory per rank is about streamed bytes / group. Slabs come
from a ``memory.HostMemory`` (page-locked on CUDA). ``add`` copies only the pieces of the
block's tensors that fall in the slice - the full block is never assembled on the host - and
zeroes the padding, so the gathered regions are deterministic.

The full blocks exist on no single rank: ``release(gather=True)`` rebuilds them with the
``rebuild`` collective it was given (``movement.gather.gather_full``); without it the
tensors come back empty.

Built by the backend's builders (AllGather mode); ``hooks`` read the shard regions as the
sources of each load.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence

import torch

from ditserve.engine.offload.host.backing import BackingReport, ShardFacts
from ditserve.engine.offload.host.memory import HostMemory
from ditserve.engine.offload.plan import BlockLayout
from ditserve.engine.offload.shards import BlockShard, shard_block

# Every rank's shards of one block -> the full per-dtype regions, on the host (a collective).
Rebuild = Callable[[Mapping[Hashable, torch.Tensor]], Mapping[Hashable, torch.Tensor]]


class ShardBacking:
    """Shard slabs of the streamed blocks for one rank, keyed by block index."""

    def __init__(
        self, memory: HostMemory, *, rank: int, group_size: int, rebuild: Rebuild
    ) -> None:
        self._memory = memory
        self.rank = rank
        self.group_size = group_size
        self._rebuild = rebuild
        self._slabs: dict[int, torch.Tensor] = {}
        self._shards: dict[int, BlockShard] = {}
        self._layouts: dict[int, BlockLayout] = {}

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for s in self._slabs.values())

    def report(self) -> BackingReport:
        return BackingReport(
            f"{self._memory.kind}-shards", self.nbytes, self._memory.pinned_bytes,
            shard=ShardFacts(self.group_size, self.rank, self.nbytes),
        )

    def add(self, layout: BlockLayout, tensors: Sequence[torch.Tensor]) -> None:
        """Allocate the block's shard slab and copy this rank's slice of ``tensors`` into it."""
        shard = shard_block(layout, rank=self.rank, group_size=self.group_size)
        slab = self._memory.allocate(shard.nbytes)
        self._slabs[layout.index] = slab
        self._shards[layout.index] = shard
        self._layouts[layout.index] = layout
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

    def release(self, index: int, *, gather: bool = False) -> list[torch.Tensor]:
        """Unpin and drop the block's shard slab; the block's tensors rebuilt from every
        rank's shards with ``gather`` (a collective), else empty tensors."""
        layout = self._layouts[index]
        if gather:
            full = self._rebuild(self.regions(index))
            tensors = [full[p.dtype][p.offset : p.offset + p.numel].view(p.shape)
                       for p in layout.tensors]
        else:
            tensors = [torch.empty(0, dtype=p.dtype) for p in layout.tensors]  # type: ignore[arg-type]
        slab = self._slabs.pop(index)
        self._shards.pop(index)
        self._layouts.pop(index)
        self._memory.free(slab)
        return tensors

    def close(self) -> None:
        for index in list(self._slabs):
            self.release(index)
