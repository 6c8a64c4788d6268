"""Mapped backing: streamed blocks read straight from a HostWeightPlan's file mappings.

The mmap counterpart of ``slabs.SlabBacking``, with the same ``HostBacking`` surface, but no
slab and no copy: a block's tensors stay views of the shared, read-only mapping (checkpoint or
node-cache entry). Because those bytes lie where the file put them - not in the block's packed
layout - ``regions`` returns, per dtype, a ``MappedRegion``: the list of (offset in the slot
region, source view) parts that make up the region. The mapped transfers
(``movement.mapped``) turn it into copies: straight H2D per part from registered pages, or a
pack into a pinned staging slot then one H2D per dtype.

``register`` page-locks the streamed ranges of the mappings in place (``registration``: all
or none, within a budget); ``close`` unregisters them and closes the plan's mappings.

Built by the backend's builders (when the plan is mapped); regions are read by the hooks (as
opaque copy sources) and the transfer; ``release`` gives the views back on disable.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ditserve.engine.errors import OffloadError
from ditserve.engine.offload.host.backing import BackingReport, MappedFacts
from ditserve.engine.offload.host.registration import (
    CudaRegistrar,
    Registrar,
    Registration,
    RegistrationRefused,
    SourceRange,
    plan_ranges,
    register_ranges,
)
from ditserve.engine.offload.host.weight_plan import HostWeightPlan, TensorBinding
from ditserve.engine.offload.plan import BlockLayout


@dataclass(frozen=True)
class MappedRegion:
    """One dtype region of a block, as parts of the mapping: (element offset, flat source)."""

    dtype: Hashable
    numel: int  # the region's padded size (what the slot region holds)
    parts: tuple[tuple[int, torch.Tensor], ...]


class CopyRun:
    """Tensors contiguous in a slot region and in one mapped file: one copy covers them all."""

    def __init__(self, offset: int, numel: int, binding: TensorBinding, view: torch.Tensor):
        self.offset = offset  # elements into the slot region
        self.numel = numel
        self.file = str(binding.file)
        self.file_offset = binding.offset  # bytes into the file
        self.nbytes = binding.nbytes
        self.views = [view]

    def continues(self, offset: int, binding: TensorBinding) -> bool:
        return (offset == self.offset + self.numel and str(binding.file) == self.file
                and binding.offset == self.file_offset + self.nbytes)

    def add(self, numel: int, binding: TensorBinding, view: torch.Tensor) -> None:
        self.numel += numel
        self.nbytes += binding.nbytes
        self.views.append(view)

    def parts(self, files: dict[str, Any]) -> list[tuple[int, torch.Tensor]]:
        itemsize = self.views[0].element_size()
        mapping = files.get(self.file)
        if (mapping is None or len(self.views) == 1 or not hasattr(mapping, "raw")
                or self.file_offset % itemsize or self.nbytes != self.numel * itemsize):
            # One part per tensor (its own view; nothing to merge or no whole-file view).
            parts, offset = [], self.offset
            for view in self.views:
                parts.append((offset, view.reshape(-1)))
                offset += view.numel()
            return parts
        # (nbytes,) uint8 slice of the whole mapping -> (numel,) of the tensors' dtype.
        raw = mapping.raw[self.file_offset : self.file_offset + self.nbytes]
        return [(self.offset, raw.view(self.views[0].dtype))]


class MappedBacking:
    """The streamed blocks' source views, keyed by block index. Consumes the plan."""

    def __init__(self, host_plan: HostWeightPlan) -> None:
        if not host_plan.mapped:
            raise OffloadError("MappedBacking needs a mapped HostWeightPlan")
        self.plan = host_plan
        self._sources = host_plan.consume()
        self._layouts: dict[int, BlockLayout] = {}
        self._views: dict[int, list[torch.Tensor]] = {}
        self._bindings: dict[int, list[TensorBinding]] = {}
        self.registration: Registration | None = None
        self.fallback_reason: str | None = None  # why ``register`` left the mapping unregistered
        self._closed = False

    @property
    def nbytes(self) -> int:
        """Mapped (shared, not private) bytes behind the streamed blocks."""
        return sum(b.nbytes for bs in self._bindings.values() for b in bs)

    def report(self) -> BackingReport:
        reg = self.registration
        copies = tensors = None
        if not self._closed:
            # Copies per pass: file-contiguous tensors are merged into one copy each.
            copies = sum(len(region.parts) for index in self._layouts
                         for region in self.regions(index).values())
            tensors = sum(len(layout.tensors) for layout in self._layouts.values())
        return BackingReport(
            f"{self.plan.kind}-{'registered' if reg else 'staging'}", self.nbytes,
            reg.nbytes if reg else 0,
            mapped=MappedFacts(copies, tensors, reg.nbytes if reg else 0,
                               len(reg.ranges) if reg else 0, self.fallback_reason),
        )

    def add(self, layout: BlockLayout, tensors: Sequence[torch.Tensor]) -> None:
        """Record the block's sources; every tensor must be a view the plan bound."""
        views, bindings = [], []
        for placement, tensor in zip(layout.tensors, tensors, strict=True):
            name = f"{layout.name}.{placement.name}"
            source = self._sources.get(name)
            binding = self.plan.bindings.get(name)
            if source is None or binding is None:
                raise OffloadError(
                    f"{name} has no source in the {self.plan.kind} plan; the plan must cover "
                    "every streamed tensor (load with --dlo-checkpoint-mmap off to use "
                    "ordinary host memory)"
                )
            if tuple(source.shape) != tuple(tensor.shape) or source.dtype != tensor.dtype:
                raise OffloadError(
                    f"{name}: the plan binds {source.dtype} {list(source.shape)} but the model "
                    f"holds {tensor.dtype} {list(tensor.shape)}"
                )
            views.append(source)
            bindings.append(binding)
        self._layouts[layout.index] = layout
        self._views[layout.index] = views
        self._bindings[layout.index] = bindings

    def regions(self, index: int) -> dict[Hashable, MappedRegion]:
        """Per dtype, the parts to copy: tensors that lie back to back both in the slot region
        and in one file become a single part (one copy instead of one per tensor)."""
        layout = self._layouts[index]
        runs: dict[Hashable, list[CopyRun]] = {r.dtype: [] for r in layout.regions}
        members = zip(layout.tensors, self._views[index], self._bindings[index], strict=True)
        for placement, view, binding in members:
            same_region = runs[placement.dtype]
            last = same_region[-1] if same_region else None
            if last is not None and last.continues(placement.offset, binding):
                last.add(placement.numel, binding, view)
            else:
                same_region.append(CopyRun(placement.offset, placement.numel, binding, view))
        files = {str(m.path): m for m in self.plan.mappings}
        return {
            r.dtype: MappedRegion(
                r.dtype, r.numel,
                tuple(part for run in runs[r.dtype] for part in run.parts(files)),
            )
            for r in layout.regions
        }

    def tensor_views(self, index: int) -> list[torch.Tensor]:
        return list(self._views[index])

    def source_ranges(self) -> list[SourceRange]:
        """Every streamed tensor's byte range, per mapped file (for host registration)."""
        return [
            SourceRange(str(b.file), b.offset, b.nbytes)
            for bs in self._bindings.values()
            for b in bs
        ]

    def streamed_views(self) -> list[torch.Tensor]:
        return [v for vs in self._views.values() for v in vs]

    def register(
        self,
        *,
        budget_bytes: int,
        device: torch.device,
        registrar: Registrar | None = None,
        verify: Callable[[], str | None] | None = None,
    ) -> bool:
        """Page-lock the streamed ranges in place (all or none). True when registered; else
        ``fallback_reason`` says why. Call after the resident modules left these mappings:
        a registered range is page-aligned, so a resident tensor may share its edge page,
        and the driver refuses a copy that starts inside a registered range but runs past
        its end (invalid argument)."""
        if registrar is None and device.type == "cuda":
            registrar = CudaRegistrar()
        if registrar is None:
            self.fallback_reason = (
                f"host registration needs a CUDA device (offload device is {device})")
            return False
        addresses = {str(m.path): m.address for m in self.plan.mappings}
        try:
            self.registration = register_ranges(
                plan_ranges(self.source_ranges()),
                addresses=addresses,
                budget_bytes=budget_bytes,
                registrar=registrar,
                verify=verify or (lambda: _unpinned(self.streamed_views())),
            )
        except RegistrationRefused as e:
            self.fallback_reason = f"registration refused: {e}"
            return False
        return True

    def release(self, index: int, *, gather: bool = False) -> list[torch.Tensor]:
        """Forget the block; its tensors go back as the mapping views (no copy)."""
        self._layouts.pop(index)
        self._bindings.pop(index)
        return self._views.pop(index)

    def close(self) -> None:
        """Unregister every range (newest first), then close the plan's mappings. Callers
        synchronize every copy out of the mappings first."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.registration is not None:
                self.registration.unregister_all()
        finally:
            for index in list(self._layouts):
                self.release(index)
            self.plan.close()


def _unpinned(views: Sequence[torch.Tensor]) -> str | None:
    bad = sum(1 for v in views if v.numel() and not v.is_pinned())
    return f"{bad} of {len(views)} source tensors do not report pinned" if bad else None
