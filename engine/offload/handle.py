"""OffloadHandle: a live offload of one model - what it reports, and how it is undone.

``disable`` synchronizes, removes the hooks, gives the streamed blocks back ordinary
(pageable, unpinned) host tensors - views of the former slabs, no copy - and frees the slots.
Resident modules stay on the device: call ``model.to(device)`` afterwards to run it fully
resident, or ``enable_offload`` again. Created only by ``backend.enable_offload``.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from typing import Any

import torch
from torch import nn

from ditserve.engine.offload.hooks import BlockStreamer
from ditserve.engine.offload.host.mapped import MappedStorage
from ditserve.engine.offload.host.shard_slabs import ShardStorage
from ditserve.engine.offload.host.slabs import HostStorage
from ditserve.engine.offload.plan import OffloadPlan

# The live handle of each offloaded model (a model is offloaded at most once at a time).
_ACTIVE: weakref.WeakKeyDictionary[nn.Module, OffloadHandle] = weakref.WeakKeyDictionary()


class OffloadHandle:
    """A live offload of one model: ``report()`` what it does, ``disable()`` to undo it."""

    def __init__(
        self,
        model: nn.Module,
        plan: OffloadPlan,
        device: torch.device,
        transfer: Any,
        storage: HostStorage | ShardStorage | MappedStorage,
        streamer: BlockStreamer,
        slots: list[dict[Hashable, torch.Tensor]],
    ) -> None:
        self._model = weakref.ref(model)
        self.plan = plan
        self.device = device
        self._transfer = transfer
        self._storage = storage
        self._streamer = streamer
        self._slots = slots
        self.active = True
        # Where the host bytes live and how they move (HostWeightPlan kind, path, reasons).
        self.host_info: dict[str, Any] = {}
        # AllGather mode: every load is a collective of the group.
        self.needs_collective_participation = isinstance(storage, ShardStorage)

    @property
    def passes(self) -> int:
        """AllGather mode: whole passes run so far (forwards and idle passes)."""
        return self._streamer.passes

    def idle_pass(self) -> None:
        """Join every block's gather, in a forward's order, without running any block.

        AllGather mode: a rank with no batch calls this while another rank runs a forward, so
        the group's collectives stay matched. No-op in rank-local mode.
        """
        if self.needs_collective_participation and self.active:
            self._streamer.idle_pass()

    def report(self) -> dict[str, Any]:
        """JSON-able facts: the split, bytes per step, memory, backing and transfer so far."""
        plan, streamer = self.plan, self._streamer
        names = [b.name for b in plan.blocks]
        return {
            "active": self.active,
            "device": str(self.device),
            "blocks": len(plan.blocks),
            "streamed_blocks": len(plan.streamed),
            "resident_blocks": len(plan.residency.resident),
            "resident_block_names": [names[i] for i in plan.residency.resident],
            "residency": plan.residency.mode,
            "hbm_budget_bytes": plan.residency.budget_bytes,
            "activation_reserve_bytes": plan.residency.activation_reserve_bytes,
            "streamed_bytes": plan.streamed_bytes,
            "resident_block_bytes": plan.resident_block_bytes,
            "resident_module_bytes": plan.resident_module_bytes,
            "slot_bytes": plan.slot.nbytes,
            "slots": len(self._slots) if plan.streamed else 0,
            "host_bytes": self._storage.nbytes,
            "pinned_host_bytes": self._transfer.pinned_bytes,
            "backing": self._transfer.backing,
            "transfer": self._transfer.name,
            "bytes_transferred": streamer.bytes_transferred,
            "block_loads": streamer.loads,
            "load_misses": streamer.misses,
            **self.host_info,
            **self._shard_report(),
            **self._mapped_report(),
            **self._copy_rate_report(),
        }

    def _copy_rate_report(self) -> dict[str, Any]:
        clock = self._transfer.clock  # None where copies finish at once (the CPU path)
        return clock.report() if clock is not None else {}

    def _mapped_report(self) -> dict[str, Any]:
        if not isinstance(self._storage, MappedStorage) or not self.active:
            return {}
        # Copies per pass: file-contiguous tensors are merged into one copy each.
        parts = sum(len(region.parts) for index in self.plan.streamed
                    for region in self._storage.regions(index).values())
        tensors = sum(len(self.plan.blocks[index].tensors) for index in self.plan.streamed)
        return {"mapped_copies_per_pass": parts, "mapped_tensors_per_pass": tensors}

    def _shard_report(self) -> dict[str, Any]:
        storage, transfer = self._storage, self._transfer
        if not isinstance(storage, ShardStorage):
            return {"group_size": 1}
        return {
            "group_size": storage.group_size,
            "group_rank": storage.rank,
            "shard_bytes": storage.nbytes,  # this rank's host bytes for the streamed blocks
            "h2d_bytes": transfer.h2d_bytes,
            "gathered_bytes": transfer.gathered_bytes,
            "passes": self._streamer.passes,
        }

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
            if isinstance(self._storage, ShardStorage):
                hosts = self._gathered_tensors(index, block.tensors, gather)
                self._storage.release(index)
            else:
                hosts = self._storage.release(index)
            for tensor, host in zip(block.tensors, hosts, strict=True):
                tensor.data = host
        self._slots.clear()
        self._streamer.blocks.clear()
        self._transfer.close()
        self.active = False
        model = self._model()
        if model is not None:
            _ACTIVE.pop(model, None)

    def _gathered_tensors(
        self, index: int, tensors: list[torch.Tensor], gather: bool
    ) -> list[torch.Tensor]:
        assert isinstance(self._storage, ShardStorage)
        if not gather:
            return [torch.empty(0, dtype=t.dtype) for t in tensors]
        full = self._transfer.gather_full(self._storage.regions(index))
        return [
            full[p.dtype][p.offset : p.offset + p.numel].view(p.shape)
            for p in self.plan.blocks[index].tensors
        ]
