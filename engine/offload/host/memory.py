"""Host memory for offload: exact-size buffers, page-locked in place on CUDA.

Two allocators behind one small surface (``allocate`` / ``free`` / ``kind`` / ``pinned_bytes``):

- ``PageableMemory`` (CPU, and any device without DMA from host): ordinary memory.
- ``PinnedMemory`` (CUDA): ordinary memory registered in place with ``cudaHostRegister``, so
  pinned bytes are exactly the bytes asked for - unlike the caching host allocator
  (``pin_memory=True``), which rounds every allocation up to a power of two. Falls back to
  that allocator only where registration is refused, and says so in ``kind``.

Both start buffers on a page boundary (registration needs it) and, from 2 MiB up, on a 2 MiB
boundary advised for transparent huge pages. Owners (slab and shard backings, the staging
transfer) each hold their own allocator, so each reports its own pinned bytes.

Called by ``host.slabs``, ``host.shard_slabs`` and ``movement.mapped`` (staging slots); built
by ``host_memory`` for the offload device.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
import threading
from typing import Any, Protocol

import torch

from ditserve.engine.errors import OffloadError

log = logging.getLogger(__name__)
PAGE = 4096
HUGE_PAGE = 2 * 1024 * 1024  # x86-64 and arm64 (4 KiB base pages) transparent huge page
MADV_HUGEPAGE = 14  # linux/mman.h
MADV_NOHUGEPAGE = 15


class HostMemory(Protocol):
    """Allocates the host buffers a backing or a transfer copies from."""

    @property
    def kind(self) -> str:
        """How the buffers are held: "pageable", "pinned-registered" or
        "pinned-caching-allocator"."""
        ...

    @property
    def pinned_bytes(self) -> int:
        """Page-locked bytes held now (what the allocator really takes)."""
        ...

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 host buffer of exactly ``nbytes`` bytes."""
        ...

    def free(self, buffer: torch.Tensor) -> bool:
        """Undo ``allocate``'s pinning. True: the memory stays valid as ordinary pageable
        memory; False: it stays pinned while referenced (copy out of it to keep data)."""
        ...


class PageableMemory:
    """Ordinary memory: nothing is pinned, nothing to undo."""

    kind = "pageable"
    pinned_bytes = 0

    def __init__(self, *, huge_pages: bool = True) -> None:
        self.huge_pages = huge_pages

    def allocate(self, nbytes: int) -> torch.Tensor:
        return aligned_empty(nbytes, huge_pages=self.huge_pages)

    def free(self, buffer: torch.Tensor) -> bool:
        return True


class PinnedMemory:
    """Page-locked host memory of exact size: allocated, then ``cudaHostRegister``'ed."""

    def __init__(self, *, huge_pages: bool = True) -> None:
        """huge_pages: advise buffers of 2 MiB and up for transparent huge pages (False
        advises against them: 4 KiB pages, for measurements)."""
        self.huge_pages = huge_pages
        self.kind = "pinned-registered"
        self.pinned_bytes = 0
        self._registered: dict[int, int] = {}  # data_ptr -> bytes, to unregister on free
        # Slabs are allocated from several threads at once (``builders.fill``); the
        # registration itself runs unlocked, only the bookkeeping is serialized.
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> torch.Tensor:
        """Falls back to the caching host allocator (power-of-two rounding) only where
        registration is refused, and says so in ``kind``."""
        if self.kind == "pinned-registered":
            buffer = aligned_empty(nbytes, huge_pages=self.huge_pages)
            if nbytes == 0:
                return buffer
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)
            if err == cudart.cudaError.success:
                with self._lock:
                    self._registered[buffer.data_ptr()] = nbytes
                    self.pinned_bytes += nbytes
                return buffer
            log.warning(
                "cudaHostRegister refused %d bytes (%s); falling back to the caching host "
                "allocator, which rounds each slab up to a power of two",
                nbytes,
                cudart.cudaGetErrorString(err),
            )
            self.kind = "pinned-caching-allocator"
        try:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as e:
            raise OffloadError(
                f"could not pin {nbytes} bytes of host memory for offload ({e}); free host RAM "
                "or keep more blocks resident (--dlo-hbm-budget-gib)"
            ) from e
        with self._lock:
            self.pinned_bytes += 1 << max(nbytes - 1, 0).bit_length()  # what the allocator takes
        return buffer

    def free(self, buffer: torch.Tensor) -> bool:
        """Unregister a buffer from ``allocate``. True: the memory stays valid as ordinary
        pageable memory. False: it came from the caching pinned allocator and stays pinned
        while referenced."""
        with self._lock:
            nbytes = self._registered.pop(buffer.data_ptr(), None)
            if nbytes is None and buffer.numel():
                self.pinned_bytes -= 1 << max(buffer.numel() - 1, 0).bit_length()
        if nbytes is None:
            return buffer.numel() == 0
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostUnregister(buffer.data_ptr())
        if err != cudart.cudaError.success:
            log.warning("cudaHostUnregister failed: %s", cudart.cudaGetErrorString(err))
        with self._lock:
            self.pinned_bytes -= nbytes
        return True


def host_memory(device: torch.device, *, huge_pages: bool = True) -> PageableMemory | PinnedMemory:
    """The host allocator for copies to ``device``: pinned on CUDA, pageable elsewhere."""
    if device.type == "cuda":
        return PinnedMemory(huge_pages=huge_pages)
    return PageableMemory(huge_pages=huge_pages)


def aligned_empty(nbytes: int, *, huge_pages: bool = True) -> torch.Tensor:
    """``nbytes`` of ordinary host memory starting on a page boundary (for registration).

    From 2 MiB up the buffer starts on a 2 MiB boundary and is advised for transparent huge
    pages before anything touches it. Pinning walks every page of a slab and the device maps
    each for DMA; with 2 MiB pages both have 512x fewer entries. Measured on 2x H200 with the
    AllGather shards (through torch's THP_MEM_ALLOC_ENABLE, the same advice for every large
    CPU allocation): enable 3.2-5.8 s instead of 5.2-9.0 s, and 213.9-217.2 instead of
    216.3-224.9 ms/step after the first enable (docs/benchmarks.md). Where THP is off the
    advice changes nothing. ``huge_pages=False`` advises the opposite (``MADV_NOHUGEPAGE``).
    """
    align = HUGE_PAGE if nbytes >= HUGE_PAGE else PAGE
    raw = torch.empty(nbytes + align, dtype=torch.uint8)
    start = (-raw.data_ptr()) % align
    buffer = raw[start : start + nbytes]
    if align == HUGE_PAGE:
        advise_pages(buffer.data_ptr(), nbytes, MADV_HUGEPAGE if huge_pages else MADV_NOHUGEPAGE)
    return buffer


def advise_pages(address: int, nbytes: int, advice: int) -> bool:
    """madvise(``advice``) on a page-aligned range; False where the kernel declines."""
    libc = _libc()
    if libc is None:
        return False
    return int(libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), advice)) == 0


@functools.cache
def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(None, use_errno=True)
