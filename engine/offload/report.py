"""What a live offload tells the outside: a typed report and a read-only probe.

``OffloadReport`` (``OffloadHandle.snapshot()``) is the split, bytes per step, memory, and what
the host backing and the transfer report of themselves; ``to_json()`` flattens it into the
keys ``/ready``, ``/metrics``, the step log and the data-parallel ranks exchange
(``OffloadHandle.report()``). ``OffloadProbe`` (``OffloadHandle.probe()``) hands out the device
objects the offload runs on - streams, block slots, shard slots, this rank's host shard
regions - for benchmarks and diagnostics to read (time a copy on the copy stream, read
addresses). Writing into them, or queuing work on the streams while the model runs, breaks
the offload; nothing in the engine reads either object.

Built by ``handle``; the parts come from ``host.backing.BackingReport`` and
``movement.transfer.TransferReport``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ditserve.engine.offload.host.backing import BackingReport
from ditserve.engine.offload.movement.transfer import SlotBuffers, TransferReport


@dataclass(frozen=True)
class Traffic:
    """What the hooks moved so far. ``passes``: passes over the streamed blocks (one per
    engine step, whatever its shape groups; AllGather idle passes included)."""

    bytes_transferred: int
    block_loads: int
    load_misses: int
    passes: int | None = None


@dataclass(frozen=True)
class OffloadReport:
    """A snapshot of one offload (see module docstring); byte counts are per step where
    they say so, else totals."""

    active: bool
    device: str
    blocks: int
    streamed_blocks: int
    resident_block_names: tuple[str, ...]
    residency: str  # "none" | "resident_layers" | "hbm_budget"
    hbm_budget_bytes: int | None
    activation_reserve_bytes: int | None
    streamed_bytes: int  # per step
    resident_block_bytes: int
    resident_module_bytes: int
    slot_bytes: int  # one slot
    slots: int
    host: BackingReport
    transfer: TransferReport
    traffic: Traffic
    host_plan: Mapping[str, Any] = field(default_factory=dict)  # the loader's plan, as it said
    dequant: str = "compute"  # where GGUF layers dequantize: "compute" | "slot"
    decoded_slot_bytes: int = 0  # of slot_bytes: the decoded region (dequant "slot")
    # ``enable_offload(release_slots=True)``: the slots' storages go back between passes
    # (``movement.slot_release``); ``slots_allocated`` says whether they are held now.
    slots_released_between_passes: bool = False
    slots_allocated: bool = True

    @property
    def resident_blocks(self) -> int:
        return len(self.resident_block_names)

    @property
    def pinned_host_bytes(self) -> int:
        """Page-locked host bytes: the backing's (slabs, shards, registered ranges) and the
        transfer's own (staging slots)."""
        return self.host.pinned_bytes + self.transfer.pinned_bytes

    @property
    def group_size(self) -> int:
        return self.host.shard.group_size if self.host.shard is not None else 1

    def to_json(self) -> dict[str, Any]:
        """The flat JSON-able form (the keys docs/offload.md lists)."""
        out: dict[str, Any] = {
            "active": self.active,
            "device": self.device,
            "blocks": self.blocks,
            "streamed_blocks": self.streamed_blocks,
            "resident_blocks": self.resident_blocks,
            "resident_block_names": list(self.resident_block_names),
            "residency": self.residency,
            "hbm_budget_bytes": self.hbm_budget_bytes,
            "activation_reserve_bytes": self.activation_reserve_bytes,
            "streamed_bytes": self.streamed_bytes,
            "resident_block_bytes": self.resident_block_bytes,
            "resident_module_bytes": self.resident_module_bytes,
            "slot_bytes": self.slot_bytes,
            "slots": self.slots,
            "dequant": self.dequant,
            "decoded_slot_bytes": self.decoded_slot_bytes,
            "slots_released_between_passes": self.slots_released_between_passes,
            "slots_allocated": self.slots_allocated,
            "host_bytes": self.host.host_bytes,
            "pinned_host_bytes": self.pinned_host_bytes,
            "backing": self.host.backing,
            "transfer": self.transfer.name,
            "bytes_transferred": self.traffic.bytes_transferred,
            "block_loads": self.traffic.block_loads,
            "load_misses": self.traffic.load_misses,
            "passes": self.traffic.passes,
            **self.host_plan,
        }
        return out | self._path_json() | self._shard_json() | self._mapped_json() | (
            self._packed_json()) | (
            self.transfer.copy_rate.to_json() if self.transfer.copy_rate is not None else {})

    def _path_json(self) -> dict[str, Any]:
        mapped = self.host.mapped
        out: dict[str, Any] = {
            "transfer_path": self.transfer.path,
            "fallback_reason": mapped.fallback_reason if mapped is not None else None,
        }
        if mapped is not None:
            out |= {"registered_bytes": mapped.registered_bytes,
                    "registered_ranges": mapped.registered_ranges}
        return out

    def _shard_json(self) -> dict[str, Any]:
        shard, gather = self.host.shard, self.transfer.gather
        if shard is None:
            return {"group_size": 1}
        return {
            "group_size": shard.group_size,
            "group_rank": shard.group_rank,
            "shard_bytes": shard.shard_bytes,
            "h2d_bytes": gather.h2d_bytes if gather is not None else 0,
            "gathered_bytes": gather.gathered_bytes if gather is not None else 0,
            "passes": self.traffic.passes,
        }

    def _packed_json(self) -> dict[str, Any]:
        packed = self.host.packed
        out: dict[str, Any] = {"compress": "none" if packed is None else "lossless",
                               "device_staging_bytes": self.transfer.device_staging_bytes}
        if packed is not None:
            out |= {"packed_format": packed.format, "packed_stripes": packed.stripes,
                    "packed_host_bytes": packed.packed_bytes,
                    "packed_raw_bytes": packed.raw_bytes,
                    "packed_ratio": packed.packed_bytes / max(1, packed.raw_bytes),
                    "packed_escapes": packed.escapes}
        return out

    def _mapped_json(self) -> dict[str, Any]:
        mapped = self.host.mapped
        if mapped is None or mapped.copies_per_pass is None:
            return {}
        return {"mapped_copies_per_pass": mapped.copies_per_pass,
                "mapped_tensors_per_pass": mapped.tensors_per_pass}


@dataclass(frozen=True)
class OffloadProbe:
    """The device objects of a live offload, to read (see module docstring)."""

    device: torch.device
    transfer: str  # the transfer's name, as in the report
    copy_stream: Any  # torch.cuda.Stream of the H2D copies; None on a CPU
    comm_stream: Any  # AllGather on CUDA: the stream the gathers are ordered on; else None
    block_slots: tuple[SlotBuffers, ...]  # the device slots, one flat buffer per dtype
    shard_slots: tuple[SlotBuffers, ...]  # AllGather: device shard slots; else ()
    shard_regions: tuple[torch.Tensor, ...]  # AllGather: this rank's host shards, load order
