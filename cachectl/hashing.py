"""File hashing for the cache: SHA-256 of whole files or byte ranges, in parallel, rate-limited.

Used by the store (verify, join, model source digests) and the daemon's scrubber. Files are
hashed in parallel across a thread pool: ``hashlib`` releases the GIL on large buffers, so
threads scale across cores without processes.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

CHUNK = 8 * 2**20  # big enough that hashlib drops the GIL, small enough to rate-limit smoothly


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


def hash_file(
    path: Path,
    *,
    start: int = 0,
    length: int | None = None,
    limiter: RateLimiter | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> str:
    """SHA-256 hex of ``length`` bytes of ``path`` from ``start`` (to the end when None)."""
    digest = hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        remaining = length if length is not None else os.fstat(f.fileno()).st_size - start
        while remaining > 0:
            want = min(CHUNK, remaining)
            if limiter is not None:
                limiter.acquire(want)
            got = f.readinto(view[:want])
            if not got:
                break  # file shorter than expected: the caller compares digests and sizes
            digest.update(view[:got])
            remaining -= got
            if on_bytes is not None:
                on_bytes(got)
    return digest.hexdigest()


@dataclass(frozen=True)
class HashJob:
    """One file (or byte range) to hash; ``tag`` comes back with the result."""

    path: Path
    tag: str
    start: int = 0
    length: int | None = None


def hash_many(
    jobs: Iterable[HashJob],
    *,
    threads: int | None = None,
    limiter: RateLimiter | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> dict[str, str | OSError]:
    """Hash every job in parallel; maps tag -> hex digest, or the OSError that stopped it."""
    jobs = list(jobs)
    workers = max(1, min(threads or os.cpu_count() or 1, len(jobs) or 1))

    def one(job: HashJob) -> str | OSError:
        try:
            return hash_file(job.path, start=job.start, length=job.length,
                             limiter=limiter, on_bytes=on_bytes)
        except OSError as e:
            return e

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cachectl-hash") as pool:
        results = list(pool.map(one, jobs))
    return {job.tag: result for job, result in zip(jobs, results, strict=True)}
