"""StepLog: one log line every few seconds summarizing the engine's recent steps.

While the engine works, about every ``interval_s`` it logs at INFO: steps run, their time (GPU time
on CUDA; mean, min, max), mean batch in requests and rows, images finished and requests
failed. Idle periods log nothing. It is an ``EngineObserver``: the engine calls it on its loop
thread, after each step, so the summary costs no extra synchronization. Operators read step
time drifting in pod logs without scraping /metrics; the benchmarks keep the server's log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ditserve.engine.steps")

DEFAULT_INTERVAL_S = 10.0


class StepLog:
    """Accumulates ``on_step``/``on_finished``/``on_failed`` and logs a summary per interval."""

    def __init__(
        self,
        interval_s: float = DEFAULT_INTERVAL_S,
        *,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger = log,
    ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._log = logger
        self._since: float | None = None  # start of the current window
        self._last: float | None = None  # the latest event
        self._reset()

    def _reset(self) -> None:
        self._times: list[float] = []
        self._requests = 0
        self._rows = 0
        self._images = 0
        self._failed = 0

    def on_step(self, *, requests: int, rows: int, seconds: float) -> None:
        self._roll()
        self._times.append(seconds)
        self._requests += requests
        self._rows += rows

    def on_finished(self, result: Any) -> None:
        self._roll()
        self._images += int(result.num_images)

    def on_failed(self, request_id: str, reason: str) -> None:
        self._roll()
        self._failed += 1

    def _roll(self) -> None:
        """Close the window before this event if it is over; a window that went idle ends at
        its last event, so an idle gap is never averaged in."""
        now = self._clock()
        if self._since is None:
            self._since = now
        elif self._last is not None and now - self._last >= self.interval_s:
            self._emit(self._last - self._since)
            self._since = now
        elif now - self._since >= self.interval_s:
            self._emit(now - self._since)
            self._since = now
        self._last = now

    def _emit(self, elapsed: float) -> None:
        if self._times:
            steps = len(self._times)
            self._log.info(
                "%d steps in %.1f s: step %.0f ms mean (min %.0f, max %.0f), batch %.2f "
                "requests / %.2f rows, %d images finished, %d requests failed",
                steps, elapsed, 1e3 * sum(self._times) / steps, 1e3 * min(self._times),
                1e3 * max(self._times), self._requests / steps, self._rows / steps,
                self._images, self._failed,
            )
        elif self._images or self._failed:
            self._log.info("%d images finished, %d requests failed in %.1f s",
                           self._images, self._failed, elapsed)
        self._reset()
