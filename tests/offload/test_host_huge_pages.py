"""Host slabs from 2 MiB up are 2 MiB-aligned and advised for transparent huge pages."""

from __future__ import annotations

from pathlib import Path

import pytest

from ditserve.engine.offload.host.memory import HUGE_PAGE, PAGE, PageableMemory

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
HOST = PageableMemory()  # the same allocation as CUDA's, minus the pinning


def vma_field(address: int, field: str) -> str | None:
    """``field`` of the /proc/self/smaps entry whose range holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    return None


def test_small_slab_is_page_aligned_and_exact() -> None:
    buffer = HOST.allocate(3 * PAGE + 5)
    assert buffer.numel() == 3 * PAGE + 5 and buffer.data_ptr() % PAGE == 0


def test_large_slab_is_huge_page_aligned_exact_and_writable() -> None:
    nbytes = 3 * HUGE_PAGE + 123
    buffer = HOST.allocate(nbytes)
    assert buffer.numel() == nbytes and buffer.data_ptr() % HUGE_PAGE == 0
    buffer.fill_(7)
    assert int(buffer[-1]) == 7


@pytest.mark.skipif(not THP_MODE.exists() or "[never]" in THP_MODE.read_text(),
                    reason="transparent huge pages are off on this kernel")
def test_large_slab_is_advised_for_huge_pages() -> None:
    buffer = HOST.allocate(4 * HUGE_PAGE)
    buffer.fill_(1)
    assert vma_field(buffer.data_ptr(), "THPeligible") == "1"


@pytest.mark.skipif(not THP_MODE.exists() or "[never]" in THP_MODE.read_text(),
                    reason="transparent huge pages are off on this kernel")
def test_small_pages_on_request_are_not_huge_page_eligible() -> None:
    # bench/h2d_pages.py --small-pages measures slabs in 4 KiB pages this way.
    buffer = PageableMemory(huge_pages=False).allocate(4 * HUGE_PAGE)
    buffer.fill_(1)
    assert buffer.data_ptr() % HUGE_PAGE == 0
    assert vma_field(buffer.data_ptr(), "THPeligible") == "0"
