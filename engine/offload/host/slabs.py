"""Slab backing: one contiguous host slab per streamed block, filled once from the model.

Each slab follows the block's ``BlockLayout`` (per-dtype flat regions), so one block load is
one copy per dtype - a single large DMA for a one-dtype DiT. Slabs come from a
``memory.HostMemory`` (page-locked in place on CUDA), so pinned host memory is the streamed
bytes plus alignment padding, not the power-of-two rounding of per-tensor pinned copies.

Built by the backend's builders (rank-local offload of ordinary host tensors); read by
``hooks`` (copy sources); released by ``handle``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from ditserve.engine.offload.host.backing import BackingReport
from ditserve.engine.offload.host.memory import HostMemory
from ditserve.engine.offload.plan import BlockLayout


class SlabBacking:
    """Slabs of the streamed blocks, keyed by block index (a ``HostBacking``)."""

    # ``add`` of different blocks may run on several threads at once (``builders.fill``):
    # each block has its own slab, and the allocator's bookkeeping is locked.
    concurrent_add = True

    def __init__(self, memory: HostMemory) -> None:
        self._memory = memory
        self._slabs: dict[int, torch.Tensor] = {}
        self._layouts: dict[int, BlockLayout] = {}

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for s in self._slabs.values())

    def report(self) -> BackingReport:
        return BackingReport(self._memory.kind, self.nbytes, self._memory.pinned_bytes)

    def add(self, layout: BlockLayout, tensors: Sequence[torch.Tensor]) -> None:
        """Allocate the block's slab and copy ``tensors`` (in layout order) into it."""
        slab = self._memory.allocate(layout.nbytes)
        self._slabs[layout.index] = slab
        self._layouts[layout.index] = layout
        for view, tensor in zip(self.tensor_views(layout.index), tensors, strict=True):
            view.copy_(tensor.detach())

    def regions(self, index: int) -> dict[Hashable, torch.Tensor]:
        """The block's flat per-dtype regions (copy sources, padding included)."""
        slab = self._slabs[index]
        return {
            r.dtype: slab[r.host_offset : r.host_offset + r.nbytes].view(r.dtype)  # type: ignore[arg-type]
            for r in self._layouts[index].regions
        }

    def tensor_views(self, index: int) -> list[torch.Tensor]:
        """One view per tensor of the block, shaped like the original (layout order)."""
        flat = self.regions(index)
        return [
            flat[t.dtype][t.offset : t.offset + t.numel].view(t.shape)
            for t in self._layouts[index].tensors
        ]

    def release(self, index: int, *, gather: bool = False) -> list[torch.Tensor]:
        """Unpin the block's slab, drop it, and return its tensors as ordinary host tensors.

        Registered (or never pinned) memory simply becomes pageable again, so the returned
        views keep it alive without a copy; memory from the caching pinned allocator cannot
        be unpinned, so those tensors are cloned out of it. (``gather``: the slab holds the
        whole block; nothing to rebuild.)
        """
        views = self.tensor_views(index)
        slab = self._slabs.pop(index)
        self._layouts.pop(index)
        if not self._memory.free(slab):
            views = [v.clone() for v in views]
        return views

    def close(self) -> None:
        for index in list(self._slabs):
            self.release(index)
