"""The mapped transfer: block loads from shared file mappings, registered or staged.

Two paths behind the transfer interface the hooks already use (``load`` / ``wait_ready`` /
``release`` / ``synchronize`` / ``close``), chosen once at enable time by
``make_mapped_transfer``:

- ``registered`` (a positive ``--dlo-pin-limit-gib`` that covers the streamed ranges, and a
  registration that succeeded and verified): async H2Ds straight from the page-locked,
  read-only mapping, one per run of tensors that lie back to back in the file and in the slot
  (one per block for a file written in the slot's name order). No host copy at all.
- ``staging`` (pin limit 0, or registration refused: the reason is kept): two bounded,
  pinned host staging slots used in turn. A load packs the block's tensors from
  the mapping into the next staging slot (a host memcpy), then issues one H2D per dtype on the copy
  stream. On CUDA the pack runs on one worker thread (torch copies release the GIL), so the
  compute stream keeps being fed while the next block is packed; ``wait_ready`` joins the
  worker first. The worker waits (host-side) for the previous upload out of a staging slot
  before overwriting it - the only host wait, bounded by the two-slot ring.

Both paths keep the base transfer's event protocol: a copy into device slot s waits on
``free[s]`` and records ``ready[s]``. Teardown: synchronize, unregister, free staging, close
the plan's mappings.

Called by ``backend.enable_offload`` when the HostWeightPlan is mapped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ditserve.engine.offload.host.mapped import MappedRegion, MappedStorage
from ditserve.engine.offload.host.registration import (
    CudaRegistrar,
    Registrar,
    Registration,
    RegistrationRefused,
    plan_ranges,
    register_ranges,
)
from ditserve.engine.offload.host.weight_plan import HostWeightPlan
from ditserve.engine.offload.movement.copy_clock import CopyClock
from ditserve.engine.offload.plan import ALIGN_BYTES, SlotLayout

log = logging.getLogger(__name__)
GIB = 1024**3


class MappedTransfer:
    """Loads ``MappedRegion`` sources into device slots through ``base`` (see module doc)."""

    def __init__(
        self,
        base: Any,
        plan: HostWeightPlan,
        *,
        path: str,
        slot_layout: SlotLayout | None = None,
        registration: Registration | None = None,
        fallback_reason: str | None = None,
    ) -> None:
        self.base = base
        self.device = base.device
        self.name = base.name
        self.plan = plan
        self.path = path
        self.fallback_reason = fallback_reason
        self.registration = registration
        self._staging: list[dict[Hashable, torch.Tensor]] = []
        self._buffers: list[torch.Tensor] = []
        self._pending: dict[int, Future[None]] = {}
        self._uploaded: list[Any] = []
        self._next_stage = 0  # staging slots are used in turn, whatever device slot a load fills
        self._executor: ThreadPoolExecutor | None = None
        if path == "staging":
            assert slot_layout is not None
            self._make_staging(slot_layout)
        self.backing = f"{plan.kind}-{path}"
        self._closed = False

    @property
    def clock(self) -> CopyClock | None:  # the base transfer's (None on a CPU)
        return self.base.clock  # type: ignore[no-any-return]

    @property
    def pinned_bytes(self) -> int:
        if self.registration is not None:
            return self.registration.nbytes
        return int(self.base.pinned_bytes)

    def _make_staging(self, layout: SlotLayout) -> None:
        offsets, total = [], 0
        for _dtype, itemsize, numel in layout.regions:
            offsets.append(total)
            total += -(-itemsize * numel // ALIGN_BYTES) * ALIGN_BYTES
        for _ in range(2):
            buffer = self.base.allocate_host(total)  # page-locked on CUDA
            self._buffers.append(buffer)
            self._staging.append({
                dtype: buffer[off : off + itemsize * numel].view(dtype)  # type: ignore[arg-type]
                for (dtype, itemsize, numel), off in zip(layout.regions, offsets, strict=True)
            })
        if self.device.type == "cuda":
            self._uploaded = [torch.cuda.Event(), torch.cuda.Event()]
            for event in self._uploaded:
                event.record(self.base.stream)  # "nothing in flight" for the first wait
            # One worker: packs run in load order, so slot reuse follows the hooks' order.
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dlo-stage")

    # -- the transfer interface -------------------------------------------------------------
    def allocate_host(self, nbytes: int) -> torch.Tensor:
        return self.base.allocate_host(nbytes)

    def free_host(self, buffer: torch.Tensor) -> bool:
        return bool(self.base.free_host(buffer))

    def load(self, pairs: Sequence[tuple[torch.Tensor, MappedRegion]], slot: int) -> None:
        if self.path != "staging":
            # Registered (or CPU) sources: every part goes straight into its slot range.
            self.base.load(
                [(dst[off : off + src.numel()], src) for dst, region in pairs
                 for off, src in region.parts],
                slot,
            )
            return
        stage = self._next_stage
        self._next_stage = (stage + 1) % len(self._staging)
        if self._executor is None:
            self._stage(pairs, slot, stage)
        else:
            self._pending[slot] = self._executor.submit(self._stage, pairs, slot, stage)

    def _stage(
        self, pairs: Sequence[tuple[torch.Tensor, MappedRegion]], slot: int, stage_index: int
    ) -> None:
        if self._uploaded:
            # Host wait: staging slot ``stage_index`` is about to be overwritten, so its
            # previous upload must have left it. Bounded: it was issued two loads ago.
            self._uploaded[stage_index].synchronize()
        stage = self._staging[stage_index]
        uploads = []
        for dst, region in pairs:
            buf = stage[region.dtype]
            for off, src in region.parts:
                buf[off : off + src.numel()].copy_(src)
            uploads.append((dst, buf[: region.numel]))
        self.base.load(uploads, slot)
        if self._uploaded:
            self._uploaded[stage_index].record(self.base.stream)

    def wait_ready(self, slot: int) -> None:
        pending = self._pending.pop(slot, None)
        if pending is not None:
            pending.result()  # the pack and the H2D issue happened (re-raises their error)
        self.base.wait_ready(slot)

    def release(self, slot: int) -> None:
        self.base.release(slot)

    def synchronize(self) -> None:
        for slot in list(self._pending):
            self._pending.pop(slot).result()
        self.base.synchronize()

    def close(self) -> None:
        """Synchronize, unregister (newest first), free staging, close the mappings."""
        if self._closed:
            return
        self._closed = True
        try:
            self.synchronize()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            try:
                if self.registration is not None:
                    self.registration.unregister_all()
            finally:
                self._staging.clear()
                for buffer in self._buffers:
                    self.base.free_host(buffer)
                self._buffers.clear()
                self.base.close()
                self.plan.close()

    def report(self) -> dict[str, Any]:
        return {
            "transfer_path": self.path,
            "fallback_reason": self.fallback_reason,
            "registered_bytes": self.registration.nbytes if self.registration else 0,
            "registered_ranges": len(self.registration.ranges) if self.registration else 0,
        }


def _unpinned(views: Sequence[torch.Tensor]) -> str | None:
    bad = sum(1 for v in views if v.numel() and not v.is_pinned())
    return f"{bad} of {len(views)} source tensors do not report pinned" if bad else None


def make_mapped_transfer(
    base: Any,
    storage: MappedStorage,
    slot_layout: SlotLayout,
    *,
    pin_limit_gib: float,
    registrar: Registrar | None = None,
    verify: Callable[[], str | None] | None = None,
) -> MappedTransfer:
    """Registered path if the budget allows and registration succeeds, else staging."""
    plan = storage.plan
    reason: str | None = None
    if pin_limit_gib > 0:
        if registrar is None and base.device.type == "cuda":
            registrar = CudaRegistrar()
        if registrar is None:
            reason = f"host registration needs a CUDA device (offload device is {base.device})"
        else:
            ranges = plan_ranges(storage.source_ranges())
            addresses = {str(m.path): m.address for m in plan.mappings}
            try:
                registration = register_ranges(
                    ranges,
                    addresses=addresses,
                    budget_bytes=int(pin_limit_gib * GIB),
                    registrar=registrar,
                    verify=verify or (lambda: _unpinned(storage.streamed_views())),
                )
            except RegistrationRefused as e:
                reason = f"registration refused: {e}"
            else:
                return MappedTransfer(base, plan, path="registered", registration=registration)
        log.warning("DLO: %s; streaming through two pinned staging slots", reason)
    return MappedTransfer(base, plan, path="staging", slot_layout=slot_layout,
                          fallback_reason=reason)
