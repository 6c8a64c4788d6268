"""Copy-stream transfers: block bytes from host regions into device slots, ordered by events.

Two implementations of the ``transfer.Transfer`` surface:

- ``SyncTransfer`` (CPU, and any device without streams): copies run synchronously when a
  load is issued, so every ordering rule holds trivially. CI runs the offload logic on it.
- ``CudaStreamTransfer``: one copy stream and an event pair per device slot. A load waits (on the
  copy stream) for the compute stream to release the slot (write-after-read), copies
  asynchronously from pinned memory, and records ``ready``; the compute stream waits on
  ``ready`` before the block runs. Only stream waits - no host synchronization per block.

Host memory (pinned slabs) is ``host.memory``'s; the AllGather and mapped transfers wrap one
of these and reuse its copy stream, events and clock.

Called by ``hooks.BlockStreamer`` (loads and waits) and the backend (synchronize, close).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ditserve.engine.errors import OffloadError
from ditserve.engine.offload.movement.copy_clock import CopyClock
from ditserve.engine.offload.movement.transfer import CopyPairs, MovementProbe, TransferReport


class SyncTransfer:
    """Synchronous copies on the calling thread; events are not needed."""

    name = "sync-copy"
    clock = None  # nothing to time: a copy is done when load returns (reports no rate)

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def prepare(self, pairs: Sequence[tuple[torch.Tensor, Any]], slot: int) -> CopyPairs:
        return list(pairs)

    def report(self) -> TransferReport:
        return TransferReport(self.name, "private-slabs")

    def probe(self) -> MovementProbe:
        return MovementProbe()

    def load(self, pairs: CopyPairs, slot: int) -> None:
        for dst, src in pairs:
            dst.copy_(src)

    def wait_ready(self, slot: int) -> None:
        """The copy already finished when ``load`` returned."""

    def release(self, slot: int) -> None:
        """Compute already finished reading the slot when the block returned."""

    def synchronize(self) -> None:
        """Nothing is in flight."""

    def close(self) -> None:
        """No streams or events to free."""


class CudaStreamTransfer:
    """Asynchronous H2D copies on a dedicated copy stream, ordered by events."""

    name = "cuda-copy-stream"

    def __init__(self, device: torch.device, slots: int = 2) -> None:
        if device.index is None:  # "cuda" means the current device; pin it down once
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        # ready[s]: the copy into slot s finished; free[s]: compute stopped reading slot s.
        self.ready = [torch.cuda.Event() for _ in range(slots)]
        self.free = [torch.cuda.Event() for _ in range(slots)]
        self.clock = CopyClock()  # achieved H2D rate, for the report

    def prepare(self, pairs: Sequence[tuple[torch.Tensor, Any]], slot: int) -> CopyPairs:
        return list(pairs)

    def report(self) -> TransferReport:
        return TransferReport(self.name, "private-slabs", copy_rate=self.clock.rate())

    def probe(self) -> MovementProbe:
        return MovementProbe(copy_stream=self.stream)

    def load(self, pairs: CopyPairs, slot: int) -> None:
        with torch.cuda.stream(self.stream):
            # Write-after-read: the block that last used this slot may still be running on
            # the compute stream; the copy stream waits for it, the host does not.
            self.stream.wait_event(self.free[slot])
            self.copy_timed(pairs)
            self.ready[slot].record(self.stream)

    def copy_timed(self, pairs: CopyPairs) -> None:
        """Queue ``pairs`` on the copy stream, bracketed by the copy clock. Every copy path
        (slot loads here, shard loads in ``gather``/``ce_gather``) goes through it, so the
        achieved rate covers all H2D bytes the offload moves."""
        started = self.clock.start(self.stream)
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
        self.clock.stop(self.stream, started, sum(src.nbytes for _, src in pairs))

    def wait_ready(self, slot: int) -> None:
        # Read-after-write: the block's kernels (on the current stream) start only after its
        # bytes landed. A stream wait; the host runs on to queue the block's kernels.
        torch.cuda.current_stream(self.device).wait_event(self.ready[slot])

    def release(self, slot: int) -> None:
        # Marks the point on the compute stream after which the slot may be overwritten.
        self.free[slot].record(torch.cuda.current_stream(self.device))

    def synchronize(self) -> None:
        self.stream.synchronize()
        torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        self.synchronize()


def make_transfer(device: torch.device, slots: int = 2) -> SyncTransfer | CudaStreamTransfer:
    """The transfer path for ``device`` with ``slots`` device slots: copy stream on CUDA,
    synchronous copies elsewhere."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise OffloadError(
                f"offload device {device} is not available in this process; pass a CUDA "
                "device that exists or use --device cpu"
            )
        return CudaStreamTransfer(device, slots)
    return SyncTransfer(device)
