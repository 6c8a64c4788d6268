"""Mapped transfers: block loads from shared file mappings, registered or staged.

Two transfers over a ``host.mapped.MappedBacking``'s ``MappedRegion`` sources, wrapped around
a copy-stream transfer (whose copy stream, events and clock they use), chosen once at enable
time by ``make_mapped_transfer``:

- ``DirectMappedTransfer`` (the backing registered its streamed ranges - a positive
  ``--dlo-pin-limit-gib`` that covers them, and a registration that succeeded and verified):
  async H2Ds straight from the page-locked, read-only mapping, one per run of tensors that lie
  back to back in the file and in the slot (one per block for a file written in the slot's
  name order). No host copy at all.
- ``StagedTransfer`` (pin limit 0, or registration refused: the backing keeps the reason):
  two bounded, pinned host staging slots used in turn. A load packs the block's tensors from
  the mapping into the next staging slot (a host memcpy), then issues one H2D per dtype on the
  copy stream. On CUDA (``ThreadedStagedTransfer``) the pack runs on one worker thread (torch
  copies release the GIL), so the compute stream keeps being fed while the next block is
  packed; ``wait_ready`` joins the worker first. The worker waits (host-side) for the previous
  upload out of a staging slot before overwriting it - the only host wait, bounded by the
  two-slot ring.

Both keep the base transfer's event protocol: a copy into device slot s waits on ``free[s]``
and records ``ready[s]``. Teardown: synchronize, free staging; the backing then unregisters
and closes the plan's mappings.

Called by the backend's builders when the HostWeightPlan is mapped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ditserve.engine.offload.host.mapped import MappedBacking, MappedRegion
from ditserve.engine.offload.host.memory import HostMemory
from ditserve.engine.offload.host.registration import Registrar
from ditserve.engine.offload.movement.copy_stream import CudaStreamTransfer, SyncTransfer
from ditserve.engine.offload.movement.transfer import (
    CopyPairs,
    DelegatingTransfer,
    TransferReport,
)
from ditserve.engine.offload.plan import ALIGN_BYTES, SlotLayout, round_up

log = logging.getLogger(__name__)
GIB = 1024**3
MappedPairs = Sequence[tuple[torch.Tensor, MappedRegion]]  # (slot region, its mapped parts)


class DirectMappedTransfer(DelegatingTransfer):
    """Registered (or CPU) sources: every part goes straight into its slot range."""

    inner: SyncTransfer | CudaStreamTransfer

    def __init__(self, base: SyncTransfer | CudaStreamTransfer) -> None:
        super().__init__(base)

    def prepare(self, pairs: MappedPairs, slot: int) -> CopyPairs:
        # Each part's slot range, sliced once here rather than on every load.
        return [(dst[off : off + src.numel()], src) for dst, region in pairs
                for off, src in region.parts]

    def report(self) -> TransferReport:
        return TransferReport(self.inner.name, "registered",
                              copy_rate=self.inner.report().copy_rate)


class StagedTransfer(DelegatingTransfer):
    """Packs each load into one of two pinned staging slots, then loads through ``base``;
    on the calling thread (the CPU path)."""

    inner: SyncTransfer | CudaStreamTransfer

    def __init__(
        self, base: SyncTransfer | CudaStreamTransfer, slot_layout: SlotLayout, memory: HostMemory
    ) -> None:
        super().__init__(base)
        self._memory = memory
        self._staging: list[dict[Hashable, torch.Tensor]] = []
        self._buffers: list[torch.Tensor] = []
        self._next_stage = 0  # staging slots are used in turn, whatever device slot a load fills
        self._closed = False
        self._make_staging(slot_layout)

    def _make_staging(self, layout: SlotLayout) -> None:
        offsets, total = [], 0
        for _dtype, itemsize, numel in layout.regions:
            offsets.append(total)
            total += round_up(itemsize * numel, ALIGN_BYTES)
        for _ in range(2):
            buffer = self._memory.allocate(total)  # page-locked on CUDA
            self._buffers.append(buffer)
            self._staging.append({
                dtype: buffer[off : off + itemsize * numel].view(dtype)  # type: ignore[arg-type]
                for (dtype, itemsize, numel), off in zip(layout.regions, offsets, strict=True)
            })

    def prepare(self, pairs: MappedPairs, slot: int) -> MappedPairs:
        return list(pairs)

    def load(self, prepared: MappedPairs, slot: int) -> None:
        self._stage(prepared, slot, self._take_stage())

    def _take_stage(self) -> int:
        stage = self._next_stage
        self._next_stage = (stage + 1) % len(self._staging)
        return stage

    def _stage(self, pairs: MappedPairs, slot: int, stage_index: int) -> None:
        """Pack ``pairs`` into staging slot ``stage_index``; one H2D per dtype from it."""
        stage = self._staging[stage_index]
        uploads = []
        for dst, region in pairs:
            buf = stage[region.dtype]
            for off, src in region.parts:
                buf[off : off + src.numel()].copy_(src)
            uploads.append((dst, buf[: region.numel]))
        self.inner.load(uploads, slot)

    def close(self) -> None:
        """Synchronize, free the staging slots, close the base transfer."""
        if self._closed:
            return
        self._closed = True
        try:
            self.synchronize()
        finally:
            self._shutdown()
            self._staging.clear()
            for buffer in self._buffers:
                self._memory.free(buffer)
            self._buffers.clear()
            self.inner.close()

    def _shutdown(self) -> None:
        """Stop whatever packs in the background (nothing on the calling thread)."""

    def report(self) -> TransferReport:
        return TransferReport(self.inner.name, "staging", pinned_bytes=self._memory.pinned_bytes,
                              copy_rate=self.inner.report().copy_rate)


class ThreadedStagedTransfer(StagedTransfer):
    """CUDA: packs on one worker thread while the compute stream runs (module docstring)."""

    def __init__(
        self, base: CudaStreamTransfer, slot_layout: SlotLayout, memory: HostMemory
    ) -> None:
        super().__init__(base, slot_layout, memory)
        self._stream_base = base
        self._pending: dict[int, Future[None]] = {}
        self._uploaded = [torch.cuda.Event(), torch.cuda.Event()]
        for event in self._uploaded:
            event.record(base.stream)  # "nothing in flight" for the first wait
        # One worker: packs run in load order, so slot reuse follows the hooks' order.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dlo-stage")

    def load(self, prepared: MappedPairs, slot: int) -> None:
        self._pending[slot] = self._executor.submit(self._stage, prepared, slot,
                                                    self._take_stage())

    def _stage(self, pairs: MappedPairs, slot: int, stage_index: int) -> None:
        # Host wait: staging slot ``stage_index`` is about to be overwritten, so its previous
        # upload must have left it. Bounded: it was issued two loads ago.
        self._uploaded[stage_index].synchronize()
        super()._stage(pairs, slot, stage_index)
        self._uploaded[stage_index].record(self._stream_base.stream)

    def wait_ready(self, slot: int) -> None:
        pending = self._pending.pop(slot, None)
        if pending is not None:
            pending.result()  # the pack and the H2D issue happened (re-raises their error)
        self.inner.wait_ready(slot)

    def synchronize(self) -> None:
        for slot in list(self._pending):
            self._pending.pop(slot).result()
        self.inner.synchronize()

    def _shutdown(self) -> None:
        self._executor.shutdown(wait=True)


def make_mapped_transfer(
    base: SyncTransfer | CudaStreamTransfer,
    backing: MappedBacking,
    slot_layout: SlotLayout,
    *,
    pin_limit_gib: float,
    memory: HostMemory,
    registrar: Registrar | None = None,
    verify: Callable[[], str | None] | None = None,
) -> DirectMappedTransfer | StagedTransfer:
    """Registered path if the budget allows and the backing's registration succeeds, else
    staging (``memory`` holds the staging slots). Call after the resident modules were
    copied off the mappings (see ``MappedBacking.register``)."""
    if pin_limit_gib > 0:
        if backing.register(budget_bytes=int(pin_limit_gib * GIB), device=base.device,
                            registrar=registrar, verify=verify):
            return DirectMappedTransfer(base)
        log.warning("DLO: %s; streaming through two pinned staging slots",
                    backing.fallback_reason)
    if isinstance(base, CudaStreamTransfer):
        return ThreadedStagedTransfer(base, slot_layout, memory)
    return StagedTransfer(base, slot_layout, memory)
