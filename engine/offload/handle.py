"""OffloadHandle: a live offload of one model - what it reports, and how it is undone.

``disable`` synchronizes, removes the hooks, gives the streamed blocks back ordinary
(pageable, unpinned) host tensors - views of the former slabs or mappings, no copy; rebuilt
from every rank's shards with ``gather=True`` in AllGather mode - and frees the slots.
Resident modules stay on the device: call ``model.to(device)`` afterwards to run it fully
resident, or ``enable_offload`` again. Created only by ``backend.enable_offload``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch
from torch import nn

from ditserve.engine.offload.hooks import BlockStreamer
from ditserve.engine.offload.host.backing import HostBacking
from ditserve.engine.offload.movement.slot_release import SlotRelease
from ditserve.engine.offload.movement.transfer import Transfer
from ditserve.engine.offload.plan import OffloadPlan
from ditserve.engine.offload.report import OffloadProbe, OffloadReport, Traffic
from ditserve.engine.offload.slot_dequant import SlotDequant

# The live handle of each offloaded model (a model is offloaded at most once at a time).
_ACTIVE: weakref.WeakKeyDictionary[nn.Module, OffloadHandle] = weakref.WeakKeyDictionary()


class OffloadHandle:
    """A live offload of one model: ``report()`` what it does, ``disable()`` to undo it."""

    def __init__(
        self,
        model: nn.Module,
        plan: OffloadPlan,
        device: torch.device,
        *,
        transfer: Transfer,
        backing: HostBacking,
        streamer: BlockStreamer,
        slots: list[dict[Hashable, torch.Tensor]],
        collective: bool,
        host_plan: Mapping[str, Any],
        dequant: SlotDequant | None = None,
        slot_release: SlotRelease | None = None,
    ) -> None:
        """collective: every load is a collective of a group (AllGather mode).
        host_plan: the loader's HostWeightPlan facts (``describe()``), for the report.
        dequant: GGUF layers decoded into the slots (``--dlo-dequant slot``).
        slot_release: the slots given back between passes (``release_slots``)."""
        self._model = weakref.ref(model)
        self.plan = plan
        self.device = device
        self._transfer = transfer
        self._backing = backing
        self._streamer = streamer
        self._slots = slots
        self._host_plan = dict(host_plan)
        self._dequant = dequant
        self._slot_release = slot_release
        self.active = True
        # AllGather mode: every rank must run the same passes (forwards or idle passes).
        self.needs_collective_participation = collective

    @property
    def passes(self) -> int:
        """Passes over the streamed blocks so far: engine steps (``one_pass``), other
        forwards of the model, and (AllGather) idle passes."""
        return self._streamer.passes

    def one_pass(self) -> contextlib.AbstractContextManager[None]:
        """Run a step's forwards (one per shape group, block-major) as ONE pass: blocks that
        run again load nothing, and AllGather ranks stay matched whatever their group counts."""
        return self._streamer.one_pass()

    def skip_unneeded(self, demand: Callable[[nn.Module], bool] | None) -> None:
        """Load only the streamed blocks ``demand(block)`` says a row of the running step
        computes (the step cache's answer; None: every block). Ignored in AllGather mode,
        whose loads are collectives every rank joins."""
        self._streamer.demand = demand

    @property
    def skipped_bytes(self) -> int:
        """Bytes of streamed blocks not copied because no row of their step computed them."""
        return self._streamer.skipped_bytes

    def idle_pass(self) -> None:
        """Join every block's gather, in a forward's order, without running any block.

        AllGather mode: a rank with no batch calls this while another rank runs a forward, so
        the group's collectives stay matched. No-op in rank-local mode.
        """
        if self.needs_collective_participation and self.active:
            self._streamer.idle_pass()

    def snapshot(self) -> OffloadReport:
        """The split, bytes per step, memory, backing and transfer so far (typed)."""
        plan, streamer = self.plan, self._streamer
        names = [b.name for b in plan.blocks]
        return OffloadReport(
            active=self.active,
            device=str(self.device),
            blocks=len(plan.blocks),
            streamed_blocks=len(plan.streamed),
            resident_block_names=tuple(names[i] for i in plan.residency.resident),
            residency=plan.residency.mode,
            hbm_budget_bytes=plan.residency.budget_bytes,
            activation_reserve_bytes=plan.residency.activation_reserve_bytes,
            streamed_bytes=plan.streamed_bytes,
            resident_block_bytes=plan.resident_block_bytes,
            resident_module_bytes=plan.resident_module_bytes,
            # A slot's decoded region (--dlo-dequant slot) is slot memory too.
            slot_bytes=plan.slot.nbytes + (self._dequant.slot_bytes if self._dequant else 0),
            slots=len(self._slots) if plan.streamed else 0,
            host=self._backing.report(),
            transfer=self._transfer.report(),
            traffic=Traffic(streamer.bytes_transferred, streamer.loads, streamer.misses,
                            streamer.passes),
            host_plan=self._host_plan,
            dequant="slot" if self._dequant is not None else "compute",
            decoded_slot_bytes=self._dequant.slot_bytes if self._dequant else 0,
            slots_released_between_passes=self._slot_release is not None,
            slots_allocated=(self._slot_release.allocated if self._slot_release is not None
                             else bool(self._slots) and bool(plan.streamed)),
        )

    def report(self) -> dict[str, Any]:
        """``snapshot()`` as JSON-able facts (what ``/ready`` and the metrics read)."""
        return self.snapshot().to_json()

    def probe(self) -> OffloadProbe:
        """The streams, slots and shard regions this offload runs on, to read (see
        ``report.OffloadProbe``)."""
        movement = self._transfer.probe()
        shards: tuple[torch.Tensor, ...] = ()
        if self.needs_collective_participation and self.active:
            shards = tuple(region for index in self.plan.streamed
                           for region in self._backing.regions(index).values())
        return OffloadProbe(
            device=self.device, transfer=self._transfer.report().name,
            copy_stream=movement.copy_stream, comm_stream=movement.comm_stream,
            block_slots=tuple(self._slots), shard_slots=movement.shard_slots,
            shard_regions=shards,
        )

    def disable(self, *, gather: bool = False) -> None:
        """Synchronize, remove hooks, restore ordinary host tensors, free slabs and slots.

        Idempotent. Streamed blocks end up on the CPU (pageable memory, no copy); resident
        modules stay on the device.

        AllGather mode: no rank holds the full blocks. ``gather=True`` rebuilds them on the
        host - a collective, so every rank of the group must call it together; without it
        (e.g. at shutdown, when a peer may be gone) the streamed tensors are left empty and
        the model must be reloaded before it runs again.
        """
        if not self.active:
            return
        self._transfer.synchronize()
        self._streamer.detach()
        for position, index in enumerate(self.plan.streamed):
            block = self._streamer.blocks[position]
            hosts = self._backing.release(index, gather=gather)
            for tensor, host in zip(block.tensors, hosts, strict=True):
                tensor.data = host
        if self._dequant is not None:
            self._dequant.restore()  # the GGUF layers dequantize at each call again
            self._dequant.regions.clear()
        self._slots.clear()
        self._streamer.blocks.clear()
        self._transfer.close()
        self._backing.close()
        self.active = False
        model = self._model()
        if model is not None:
            _ACTIVE.pop(model, None)
