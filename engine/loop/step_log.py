"""StepLog: one log line every few seconds summarizing the engine's recent steps.

While the engine works, about every ``interval_s`` it logs at INFO: steps run, their time (GPU time
on CUDA; mean, min, max), the mean step in requests, rows, shape groups (one forward each)
and tokens (rows x latent tokens: the step's work), images finished and requests failed, and
with layerwise offload each rank's recent host->device copy rate. Idle periods
log nothing. It is an ``EngineObserver``: the engine calls it on its loop
thread, after each step, so the summary costs no extra synchronization. Operators read step
time drifting in pod logs without scraping /metrics; the benchmarks keep the server's log.

At DEBUG (``ditserve -v serve``) it also logs every step, pause, resume and finished request
as it happens, each step with its forward time and the wall time since the step before: a
window's summary says how much of it went outside the forwards, these lines say in which steps
and next to which pauses, resumes and admissions (issue 47's priority run lost ~2 s there).
Given a ``ThreadSamples``, a step that came more than ``STALL_S`` after the step before beyond
its own forward also logs where every busy thread was sampled in between (``thread_samples``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ditserve.engine.loop.thread_samples import ThreadSamples

log = logging.getLogger("ditserve.engine.steps")

DEFAULT_INTERVAL_S = 10.0
# Wall time between two steps beyond the later one's forward that is worth naming (DEBUG).
STALL_S = 0.15


class StepLog:
    """Accumulates ``on_step``/``on_finished``/``on_failed`` and logs a summary per interval."""

    def __init__(
        self,
        interval_s: float = DEFAULT_INTERVAL_S,
        *,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger = log,
        copy_rates: Callable[[], list[float | None]] | None = None,
        samples: ThreadSamples | None = None,
    ) -> None:
        """copy_rates: each rank's recent H2D rate in GB/s (``copy_rates_of`` an offload
        report), appended to the line when offload copies were timed. samples: where the
        process's threads were (a stall's DEBUG line names them), sampled on the same clock."""
        self.interval_s = interval_s
        self._clock = clock
        self._log = logger
        self._copy_rates = copy_rates
        self._samples = samples
        self._since: float | None = None  # start of the current window
        self._last: float | None = None  # the latest event
        self._last_step: float | None = None  # the latest step (the per-step DEBUG lines)
        self._reset()

    def _reset(self) -> None:
        self._times: list[float] = []
        self._requests = 0
        self._rows = 0
        self._groups = 0
        self._tokens = 0
        self._images = 0
        self._failed = 0

    def on_step(self, *, requests: int, rows: int, seconds: float, groups: int = 1,
                tokens: int = 0) -> None:
        self._roll(began=self._clock() - seconds)  # the step's time belongs to its window
        self._times.append(seconds)
        self._requests += requests
        self._rows += rows
        self._groups += groups
        self._tokens += tokens
        now, previous = self._clock(), self._last_step
        self._last_step = now
        if self._log.isEnabledFor(logging.DEBUG):
            if self._samples is not None:
                self._samples.keep_running()
            since = "-" if previous is None else f"{1e3 * (now - previous):.1f}"
            self._log.debug("step: %d requests / %d rows / %d shape groups / %d tokens, "
                            "forward %.1f ms, %s ms since the last step", requests, rows,
                            groups, tokens, 1e3 * seconds, since)
            beyond = None if previous is None else now - previous - seconds
            if self._samples is not None and beyond is not None and beyond > STALL_S:
                self._log.debug("between the last two steps, %.0f ms beyond the forward: %s",
                                1e3 * beyond, self._samples.describe(previous, now))

    def on_finished(self, result: Any) -> None:
        self._roll()
        self._images += int(result.num_images)
        self._log.debug("finished %s (queued %.3f s)", result.request_id, result.queue_seconds)

    def on_preempted(self, request_id: str) -> None:
        self._log.debug("paused %s", request_id)

    def on_resumed(self, request_id: str, seconds: float) -> None:
        self._log.debug("resumed %s after %.3f s", request_id, seconds)

    def on_failed(self, request_id: str, reason: str) -> None:
        self._roll()
        self._failed += 1

    def _roll(self, began: float | None = None) -> None:
        """Close the window before this event if it is over; a window that went idle ends at
        its last event, so an idle gap is never averaged in. A new window starts when the
        event ``began`` (a step: when its forward started, so a window of one long step
        reports that step's time, not 0 s), else now."""
        now = self._clock()
        start = now if began is None else began
        if self._since is None:
            self._since = start
        elif self._last is not None and now - self._last >= self.interval_s:
            self._emit(self._last - self._since)
            self._since = start
        elif now - self._since >= self.interval_s:
            self._emit(start - self._since)
            self._since = start
        self._last = now

    def _emit(self, elapsed: float) -> None:
        if self._times:
            steps = len(self._times)
            self._log.info(
                "%d steps in %.1f s: step %.0f ms mean (min %.0f, max %.0f), batch %.2f "
                "requests / %.2f rows / %.2f shape groups / %.0f tokens, %d images finished, "
                "%d requests failed%s",
                steps, elapsed, 1e3 * sum(self._times) / steps, 1e3 * min(self._times),
                1e3 * max(self._times), self._requests / steps, self._rows / steps,
                self._groups / steps, self._tokens / steps, self._images, self._failed,
                self._copy_rate_text(),
            )
        elif self._images or self._failed:
            self._log.info("%d images finished, %d requests failed in %.1f s",
                           self._images, self._failed, elapsed)
        self._reset()

    def _copy_rate_text(self) -> str:
        try:
            rates = self._copy_rates() if self._copy_rates is not None else []
        except Exception:  # a log line must never take the engine loop down
            log.debug("no copy rates for the step summary", exc_info=True)
            return ""
        if not rates or all(r is None for r in rates):
            return ""
        shown = "/".join("-" if r is None else f"{r:.1f}" for r in rates)
        ranks = f" (ranks {'/'.join(str(i) for i in range(len(rates)))})" if len(rates) > 1 else ""
        return f", H2D {shown} GB/s{ranks}"


def copy_rates_of(report: dict[str, Any] | None) -> list[float | None]:
    """Each rank's recent host->device rate from an engine offload report, or from the
    ``offload`` object of a ``/ready`` body ([] without DLO)."""
    if not report or report.get("enabled") is False:
        return []
    return [(r or {}).get("h2d_gbps_recent") for r in report.get("ranks") or [report]]
