"""SHA-256 for the cache: fixed-size pieces of files and buffers, hashed in parallel, rate-limited.

Every digest the cache records is built from *pieces*: consecutive ``piece_bytes`` slices of a
byte range (a tensor, a model file), each hashed on its own. Pieces are independent, so one
20 GiB file keeps every core busy; the digests that name a whole range are hashes over its
piece digests (``digests.py``). Files are read through a read-only ``mmap`` (no copy into a
buffer: that copy costs about a fifth of single-core SHA-256 throughput) by a thread pool;
``hashlib`` releases the GIL on large buffers, so threads scale across cores.

Used by the publisher and the engine (buffers), verify, join, scrub and model source digests
(files).
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

PIECE_BYTES = 16 * 2**20  # small enough to spread one file over 16+ cores, large for hashlib
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # prefault: one fault per item, not per page


def default_threads() -> int:
    """The cores this process may run on (a container's CPU set, not the host's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class RateLimiter:
    """A token bucket in bytes per second shared by all hashing threads of one scrub.

    ``sleep`` and ``clock`` are injectable so tests check the pacing without waiting.
    """

    def __init__(
        self,
        bytes_per_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if bytes_per_s <= 0:
            raise ValueError("rate must be positive bytes per second")
        self.rate = bytes_per_s
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._next_free = clock()

    def acquire(self, nbytes: int) -> None:
        # Reserve the time slot for these bytes, then wait outside the lock until it starts.
        with self._lock:
            now = self._clock()
            start = max(now, self._next_free)
            self._next_free = start + nbytes / self.rate
            delay = start - now
        if delay > 0:
            self._sleep(delay)


def piece_ranges(length: int, piece_bytes: int) -> list[tuple[int, int]]:
    """(start, length) of each piece of a ``length``-byte range; none for an empty range."""
    return [(s, min(piece_bytes, length - s)) for s in range(0, length, piece_bytes)]


@dataclass(frozen=True)
class Span:
    """A byte range of a file to hash as pieces; ``tag`` names it in the result."""

    path: Path
    start: int
    length: int
    tag: str


@dataclass
class _Item:
    """Adjacent pieces of one file hashed by one worker through one mapping."""

    path: Path
    start: int
    end: int
    pieces: list[tuple[str, int, int, int]]  # (tag, index, absolute start, length)


def _items(spans: Iterable[Span], piece_bytes: int) -> list[_Item]:
    items: list[_Item] = []
    for span in sorted(spans, key=lambda s: (str(s.path), s.start)):
        for index, (rel, n) in enumerate(piece_ranges(span.length, piece_bytes)):
            begin = span.start + rel
            last = items[-1] if items else None
            if (last is not None and last.path == span.path and last.end == begin
                    and last.end - last.start < piece_bytes):
                last.pieces.append((span.tag, index, begin, n))
                last.end = begin + n
            else:
                items.append(_Item(span.path, begin, begin + n, [(span.tag, index, begin, n)]))
    return items


def _hash_item(item: _Item, limiter: RateLimiter | None) -> list[bytes]:
    if limiter is not None:
        limiter.acquire(item.end - item.start)  # before the mapping reads the bytes in
    with open(item.path, "rb") as f:
        # A file shorter than the manifest says would fault (SIGBUS) when mapped past its end.
        if os.fstat(f.fileno()).st_size < item.end:
            raise OSError(errno.ENODATA, f"{item.path.name} is shorter than expected")
        base = item.start - item.start % mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(f.fileno(), item.end - base, flags=mmap.MAP_SHARED | _POPULATE,
                            prot=mmap.PROT_READ, offset=base)
    view = memoryview(mapping)
    try:
        return [hashlib.sha256(view[start - base:start - base + n]).digest()
                for _tag, _index, start, n in item.pieces]
    finally:
        view.release()
        mapping.close()


def hash_spans(
    spans: Iterable[Span],
    *,
    piece_bytes: int = PIECE_BYTES,
    threads: int | None = None,
    limiter: RateLimiter | None = None,
) -> dict[str, list[bytes] | OSError]:
    """Piece digests of every span, in parallel: tag -> digests in order, or the OSError
    that stopped one of its pieces."""
    spans = list(spans)
    failed: dict[str, OSError] = {}
    slots: dict[str, list[bytes]] = {
        s.tag: [b""] * len(piece_ranges(s.length, piece_bytes)) for s in spans}
    items = _items(spans, piece_bytes)

    def run(item: _Item) -> tuple[_Item, list[bytes] | OSError]:
        try:
            return item, _hash_item(item, limiter)
        except OSError as e:
            return item, e

    workers = max(1, min(threads or default_threads(), len(items) or 1))
    with ThreadPoolExecutor(workers, thread_name_prefix="cachectl-hash") as pool:
        for item, got in pool.map(run, items):
            for k, (tag, index, _s, _n) in enumerate(item.pieces):
                if isinstance(got, OSError):
                    failed[tag] = got
                else:
                    slots[tag][index] = got[k]
    return {tag: failed.get(tag, pieces) for tag, pieces in slots.items()}


def hash_buffers(
    buffers: Mapping[str, memoryview],
    *,
    piece_bytes: int = PIECE_BYTES,
    threads: int | None = None,
) -> dict[str, list[bytes]]:
    """Piece digests of in-memory byte views (tensors), in parallel: name -> digests."""
    jobs = [(name, start, n) for name, view in buffers.items()
            for start, n in piece_ranges(view.nbytes, piece_bytes)]

    def run(job: tuple[str, int, int]) -> bytes:
        name, start, n = job
        return hashlib.sha256(buffers[name][start:start + n]).digest()

    out: dict[str, list[bytes]] = {name: [] for name in buffers}
    workers = max(1, min(threads or default_threads(), len(jobs) or 1))
    with ThreadPoolExecutor(workers, thread_name_prefix="cachectl-hash") as pool:
        for (name, _s, _n), digest in zip(jobs, pool.map(run, jobs), strict=True):
            out[name].append(digest)
    return out
