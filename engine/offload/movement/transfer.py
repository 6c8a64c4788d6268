"""The transfer seam: how the hooks move one block's bytes into a device slot, and its report.

A transfer turns a block's per-dtype copy pairs - (slot region, host source) with a source
of the host backing's kind - into a prepared load once per (block, slot) at enable time
(``prepare``: checks and precomputes, so no load re-checks the plan), then, per load, queues
it (``load``), makes the compute stream wait for it (``wait_ready``) and marks the point after
which the slot may be overwritten (``release``). ``synchronize`` drains it, ``close`` frees it.
Implementations: ``copy_stream`` (CPU copies; a CUDA copy stream with events), ``mapped``
(from file mappings: straight or staged), ``gather`` and ``ce_gather`` (AllGather shards).
``decode`` wraps any of them for a packed host format: its ``prepare`` pairs each packed
source with the slot's staging and the slot region it decodes into, and its ``load`` copies
(or gathers) the packed bytes, then decodes them before the slot's ready event.

Driven by ``hooks.BlockStreamer``; built by the backend's builders; read by ``handle``
(``report``, ``probe``).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ditserve.engine.offload.movement.copy_clock import CopyRate

CopyPairs = Sequence[tuple[torch.Tensor, torch.Tensor]]  # (device destination, host source)
SlotBuffers = Mapping[Hashable, torch.Tensor]  # one flat device buffer per dtype


@dataclass(frozen=True)
class GatherFacts:
    """AllGather: bytes this rank copied over PCIe, and bytes the gathers rebuilt."""

    h2d_bytes: int
    gathered_bytes: int


@dataclass(frozen=True)
class TransferReport:
    """``name`` says how bytes move ("sync-copy", "cuda-copy-stream", "h2d+allgather",
    "h2d+p2p-copy"; "+decode" after it for packed regions); ``path`` where from
    ("private-slabs", "allgather-shards", "registered", "staging")."""

    name: str
    path: str
    pinned_bytes: int = 0  # page-locked host bytes the transfer holds itself (staging slots)
    device_staging_bytes: int = 0  # device buffers beside the slots (packed staging)
    copy_rate: CopyRate | None = None  # None where copies finish at once (the CPU path)
    gather: GatherFacts | None = None


@dataclass(frozen=True)
class MovementProbe:
    """The device objects a transfer moves bytes with, for read-only inspection."""

    copy_stream: Any = None  # torch.cuda.Stream of the H2D copies (None on a CPU)
    comm_stream: Any = None  # AllGather: the stream the gathers are ordered on
    shard_slots: tuple[SlotBuffers, ...] = field(default=())  # AllGather: device shard slots


class Transfer(Protocol):
    """Moves prepared loads into device slots, ordered against compute (module docstring)."""

    @property
    def device(self) -> torch.device: ...

    def prepare(self, pairs: Sequence[tuple[torch.Tensor, Any]], slot: int) -> Any:
        """Once per (block, slot), at enable: a load of ``pairs`` into device slot ``slot``
        that ``load`` can queue (``slot`` lets a transfer pair the load with per-slot
        buffers of its own, e.g. a packed format's device staging)."""
        ...

    def load(self, prepared: Any, slot: int) -> None:
        """Queue a prepared load into device slot ``slot``."""
        ...

    def wait_ready(self, slot: int) -> None:
        """Make the compute stream wait until the last load into ``slot`` landed."""
        ...

    def release(self, slot: int) -> None:
        """Compute has queued its last read of ``slot``; a later load may overwrite it."""
        ...

    def synchronize(self) -> None:
        """Wait until nothing queued by this transfer is in flight."""
        ...

    def close(self) -> None:
        """Synchronize and free what the transfer holds (idempotent)."""
        ...

    def report(self) -> TransferReport: ...

    def probe(self) -> MovementProbe: ...


class DelegatingTransfer:
    """A transfer that wraps another (``inner``) and forwards every call it does not change.

    The wrappers - mapped sources (``mapped``), packed decoding (``decode``) - each change one
    or two steps of a load; subclasses override those and inherit the rest, so no wrapper
    forwards ``release`` or ``probe`` by hand and a new step of the protocol is forwarded once.
    """

    def __init__(self, inner: Transfer) -> None:
        self.inner = inner
        self.device = inner.device

    def prepare(self, pairs: Sequence[tuple[torch.Tensor, Any]], slot: int) -> Any:
        return self.inner.prepare(pairs, slot)

    def load(self, prepared: Any, slot: int) -> None:
        self.inner.load(prepared, slot)

    def wait_ready(self, slot: int) -> None:
        self.inner.wait_ready(slot)

    def release(self, slot: int) -> None:
        self.inner.release(slot)

    def synchronize(self) -> None:
        self.inner.synchronize()

    def close(self) -> None:
        self.inner.close()

    def report(self) -> TransferReport:
        return self.inner.report()

    def probe(self) -> MovementProbe:
        return self.inner.probe()
