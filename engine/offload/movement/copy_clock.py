"""CopyClock: the host->device rate the offload copies actually reach, timed on the GPU.

At batch 1 a streamed step is as fast as its copies, so their achieved rate is the number that
tells whether a node's PCIe path is healthy (an H200 reads pinned memory at ~55 GB/s) and, with
AllGather, which rank of a group is the slow one. Each load's copies are bracketed by a pair of
timing events on the copy stream. The first is recorded after the stream's wait for a free slot,
so the span is copying, not waiting. Finished pairs are harvested with ``Event.query`` - never a
host wait - whenever a load is queued or a report is asked for, and their events are reused.

Reported through each transfer's report (``CopyRate``; in the offload report ``h2d_gbps`` over
the whole run, ``h2d_gbps_recent`` over the last ``window`` loads); the server exports the
recent rate per rank and logs it with the step summary. Used by every CUDA transfer path
(``copy_stream``, ``gather``, ``ce_gather``, ``mapped`` through its base transfer); the CPU
path has no clock.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

DEFAULT_WINDOW = 256  # loads: four to five Flux steps


@dataclass(frozen=True)
class CopyRate:
    """Timed H2D copies so far: bytes, copy time, and the decimal GB/s over the whole run and
    over the recent window (None before anything was timed)."""

    timed_bytes: int
    copy_seconds: float
    gbps: float | None
    gbps_recent: float | None

    def to_json(self) -> dict[str, Any]:
        return {
            "h2d_timed_bytes": self.timed_bytes,
            "h2d_copy_seconds": self.copy_seconds,
            "h2d_gbps": self.gbps,
            "h2d_gbps_recent": self.gbps_recent,
        }


class CopyClock:
    """Times bracketed copies on a stream without ever blocking the host."""

    def __init__(
        self,
        *,
        window: int = DEFAULT_WINDOW,
        make_event: Callable[[], Any] | None = None,  # tests pass fakes
    ) -> None:
        self._make_event = make_event or (lambda: torch.cuda.Event(enable_timing=True))
        self._lock = threading.Lock()  # loads (engine or staging thread) vs. reports (HTTP)
        self._pending: deque[tuple[Any, Any, int]] = deque()  # (start, end, bytes), in order
        self._spare: list[Any] = []
        self._recent: deque[tuple[float, int]] = deque(maxlen=window)  # (ms, bytes)
        self.timed_bytes = 0
        self.copy_ms = 0.0

    def start(self, stream: Any) -> Any:
        """Record the start of a load's copies on ``stream``; pass the result to ``stop``."""
        event = self._event()
        event.record(stream)
        return event

    def stop(self, stream: Any, started: Any, nbytes: int) -> None:
        """Record the end of the copies started at ``started`` (``nbytes`` in all)."""
        end = self._event()
        end.record(stream)
        with self._lock:  # one lock round per load: this runs in the block hooks
            self._pending.append((started, end, nbytes))
            self._harvest()

    def _harvest(self) -> None:
        """Account every finished span, oldest first; stop at the first one still running
        (a stream runs its work in order, so nothing after it has finished either). Holds
        the lock."""
        while self._pending and self._pending[0][1].query():
            start, end, nbytes = self._pending.popleft()
            ms = float(start.elapsed_time(end))
            self.copy_ms += ms
            self.timed_bytes += nbytes
            self._recent.append((ms, nbytes))
            self._spare.extend((start, end))

    def rate(self) -> CopyRate:
        with self._lock:
            self._harvest()
            recent_ms = sum(ms for ms, _ in self._recent)
            recent_bytes = sum(n for _, n in self._recent)
            return CopyRate(
                self.timed_bytes,
                round(self.copy_ms / 1e3, 6),
                _gbps(self.timed_bytes, self.copy_ms),
                _gbps(recent_bytes, recent_ms),
            )

    def report(self) -> dict[str, Any]:
        """``rate()`` as the offload report's ``h2d_*`` keys."""
        return self.rate().to_json()

    def _event(self) -> Any:
        # No lock: list.pop is atomic, and a harvest on another thread only adds to the list.
        try:
            return self._spare.pop()
        except IndexError:
            return self._make_event()


def _gbps(nbytes: int, ms: float) -> float | None:
    """Decimal GB/s, the unit PCIe is quoted in; None before anything was timed."""
    return round(nbytes / ms / 1e6, 2) if ms > 0 else None
