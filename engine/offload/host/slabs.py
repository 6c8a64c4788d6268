"""Host storage: one contiguous slab per streamed block, filled once from the model.

Each slab follows the block's ``BlockLayout`` (per-dtype flat regions), so one block load is
one copy per dtype - a single large DMA for a one-dtype DiT. Slabs come from the transfer's
``allocate_host`` (page-locked in place on CUDA), so pinned host memory is the streamed bytes
plus alignment padding, not the power-of-two rounding of per-tensor pinned copies.

Later backings (checkpoint mmap, runtime-cache mmap) will provide the same ``regions`` /
``tensor_views`` surface over mapped files instead of allocated slabs.

Called by ``backend.enable_offload`` (build, release) and read by ``hooks`` (copy sources).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from ditserve.engine.offload.plan import BlockLayout


class HostStorage:
    """Slabs of the streamed blocks, keyed by block index."""

    def __init__(self, allocator) -> None:  # allocator: a transfer (allocate_host/free_host)
        self._allocator = allocator
        self._slabs: dict[int, torch.Tensor] = {}
        self._layouts: dict[int, BlockLayout] = {}

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for s in self._slabs.values())

    def add(self, layout: BlockLayout, tensors: Sequence[torch.Tensor]) -> None:
        """Allocate the block's slab and copy ``tensors`` (in layout order) into it."""
        slab = self._allocator.allocate_host(layout.nbytes)
        self._slabs[layout.index] = slab
        self._layouts[layout.index] = layout
        for view, tensor in zip(self.tensor_views(layout.index), tensors, strict=True):
            view.copy_(tensor.detach())

    def regions(self, index: int) -> dict[Hashable, torch.Tensor]:
        """The block's flat per-dtype regions (copy sources, padding included)."""
        slab = self._slabs[index]
        return {
            r.dtype: slab[r.host_offset : r.host_offset + r.nbytes].view(r.dtype)
            for r in self._layouts[index].regions
        }

    def tensor_views(self, index: int) -> list[torch.Tensor]:
        """One view per tensor of the block, shaped like the original (layout order)."""
        flat = self.regions(index)
        return [
            flat[t.dtype][t.offset : t.offset + t.numel].view(t.shape)
            for t in self._layouts[index].tensors
        ]

    def release(self, index: int) -> list[torch.Tensor]:
        """Unpin the block's slab, drop it, and return its tensors as ordinary host tensors.

        Registered (or never pinned) memory simply becomes pageable again, so the returned
        views keep it alive without a copy; memory from the caching pinned allocator cannot
        be unpinned, so those tensors are cloned out of it.
        """
        views = self.tensor_views(index)
        slab = self._slabs.pop(index)
        self._layouts.pop(index)
        if not self._allocator.free_host(slab):
            views = [v.clone() for v in views]
        return views

    def release_all(self) -> None:
        for index in list(self._slabs):
            self.release(index)
