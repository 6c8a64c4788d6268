"""Transfer: moves block bytes from host slabs into device slots. The only CUDA-specific module.

Two implementations behind one small interface:

- ``SyncTransfer`` (CPU, and any device without streams): copies run synchronously when a
  load is issued, so every ordering rule holds trivially. CI runs the offload logic on it.
- ``CudaStreamTransfer``: one copy stream and an event pair per device slot. A load waits (on the
  copy stream) for the compute stream to release the slot (write-after-read), copies
  asynchronously from pinned memory, and records ``ready``; the compute stream waits on
  ``ready`` before the block runs. Only stream waits - no host synchronization per block.

Host allocation lives here too, because pinning is CUDA-specific: ``allocate_host`` returns
page-locked memory registered in place with ``cudaHostRegister`` (exact size, unlike the
caching host allocator, which rounds every pinned allocation up to a power of two).

Called by ``host.HostStorage`` (allocation), ``hooks.BlockStreamer`` (loads and waits) and
``backend`` (synchronize, close).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
from collections.abc import Sequence
from typing import Any

import torch

from ditserve.engine.errors import OffloadError
from ditserve.engine.offload.movement.copy_clock import CopyClock

log = logging.getLogger(__name__)
PAGE = 4096
HUGE_PAGE = 2 * 1024 * 1024  # x86-64 and arm64 (4 KiB base pages) transparent huge page
MADV_HUGEPAGE = 14  # linux/mman.h
CopyPairs = Sequence[tuple[torch.Tensor, torch.Tensor]]  # (device destination, host source)


class SyncTransfer:
    """Synchronous copies on the calling thread; events are not needed."""

    name = "sync-copy"
    backing = "pageable"
    clock = None  # nothing to time: a copy is done when load returns

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned_bytes = 0

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 host buffer of exactly ``nbytes`` bytes (page-aligned start)."""
        return _aligned_empty(nbytes)

    def free_host(self, buffer: torch.Tensor) -> bool:
        """Nothing to undo for ordinary memory: it stays valid (True) until unreferenced."""
        return True

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
        self.pinned_bytes = 0
        self.backing = "pinned-registered"
        self._registered: dict[int, int] = {}  # data_ptr -> bytes, to unregister on release
        self.clock = CopyClock()  # achieved H2D rate, for the report

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        """Page-locked host memory of exactly ``nbytes``: malloc'd, then cudaHostRegister'ed.

        Falls back to the caching host allocator (``pin_memory=True``, power-of-two rounding)
        only where registration is refused, and says so in ``backing``.
        """
        if self.backing == "pinned-registered":
            buffer = _aligned_empty(nbytes)
            if nbytes == 0:
                return buffer
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)
            if err == cudart.cudaError.success:
                self._registered[buffer.data_ptr()] = nbytes
                self.pinned_bytes += nbytes
                return buffer
            log.warning(
                "cudaHostRegister refused %d bytes (%s); falling back to the caching host "
                "allocator, which rounds each slab up to a power of two",
                nbytes,
                cudart.cudaGetErrorString(err),
            )
            self.backing = "pinned-caching-allocator"
        try:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as e:
            raise OffloadError(
                f"could not pin {nbytes} bytes of host memory for offload ({e}); free host RAM "
                "or keep more blocks resident (--dlo-hbm-budget-gib)"
            ) from e
        self.pinned_bytes += 1 << max(nbytes - 1, 0).bit_length()  # what the allocator takes
        return buffer

    def free_host(self, buffer: torch.Tensor) -> bool:
        """Unregister a buffer from ``allocate_host``.

        True: the memory stays valid as ordinary pageable memory. False: it came from the
        caching pinned allocator and stays pinned while referenced.
        """
        nbytes = self._registered.pop(buffer.data_ptr(), None)
        if nbytes is None:
            if buffer.numel():
                self.pinned_bytes -= 1 << max(buffer.numel() - 1, 0).bit_length()
            return buffer.numel() == 0
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostUnregister(buffer.data_ptr())
        if err != cudart.cudaError.success:
            log.warning("cudaHostUnregister failed: %s", cudart.cudaGetErrorString(err))
        self.pinned_bytes -= nbytes
        return True

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


def _aligned_empty(nbytes: int) -> torch.Tensor:
    """``nbytes`` of ordinary host memory starting on a page boundary (for registration).

    From 2 MiB up the buffer starts on a 2 MiB boundary and is advised for transparent huge
    pages before anything touches it. Pinning walks every page of a slab and the device maps
    each for DMA; with 2 MiB pages both have 512x fewer entries. Measured on 2x H200 with the
    AllGather shards (through torch's THP_MEM_ALLOC_ENABLE, the same advice for every large
    CPU allocation): enable 3.2-5.8 s instead of 5.2-9.0 s, and 213.9-217.2 instead of
    216.3-224.9 ms/step after the first enable (docs/benchmarks.md). Where THP is off the
    advice changes nothing.
    """
    align = HUGE_PAGE if nbytes >= HUGE_PAGE else PAGE
    raw = torch.empty(nbytes + align, dtype=torch.uint8)
    start = (-raw.data_ptr()) % align
    buffer = raw[start : start + nbytes]
    if align == HUGE_PAGE:
        advise_huge_pages(buffer.data_ptr(), nbytes)
    return buffer


def advise_huge_pages(address: int, nbytes: int) -> bool:
    """madvise(MADV_HUGEPAGE) on a page-aligned range; False where the kernel declines."""
    libc = _libc()
    if libc is None:
        return False
    return int(libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes),
                            MADV_HUGEPAGE)) == 0


@functools.cache
def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(None, use_errno=True)
