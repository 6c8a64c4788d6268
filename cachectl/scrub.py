"""Periodic scrub: the daemon re-verifies every entry (runtime entries and pulled models) at
a bounded read rate.

Corrupt entries are reported (log + metric) and left in place: an operator decides
(``cachectl verify``, ``cachectl rm``). Called by the daemon, in a thread of its own.
"""

from __future__ import annotations

import logging
import threading
import time

from ditserve.cachectl.hashing import RateLimiter
from ditserve.cachectl.logs import event
from ditserve.cachectl.metrics import DaemonMetrics
from ditserve.cachectl.pulled_verify import verify_pulled_models
from ditserve.cachectl.store import CacheStore
from ditserve.cachectl.verify import VerifyReport


class Scrubber:
    def __init__(self, store: CacheStore, metrics: DaemonMetrics, logger: logging.Logger, *,
                 interval_s: float, rate_bytes_per_s: float | None,
                 limiter: RateLimiter | None = None) -> None:
        self.store = store
        self.metrics = metrics
        self.logger = logger
        self.interval_s = interval_s
        self.rate = rate_bytes_per_s
        self._limiter = limiter
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def scrub_once(self) -> list[VerifyReport]:
        limiter = self._limiter or (RateLimiter(self.rate) if self.rate else None)
        start = time.monotonic()
        # Each entry is hashed under a shared lease, so GC cannot remove it mid-hash; one GC
        # removed before we leased it comes back skipped, not corrupt.
        reports = self.store.verify(limiter=limiter)
        # Pulled models too: a join checks their structure only, so a changed byte is found
        # here (or by `cachectl verify`).
        reports += verify_pulled_models(self.store.layout, limiter=limiter)
        for r in reports:
            if r.skipped:
                event(self.logger, "scrub_skipped", key=r.key, why=r.skipped)
            self.metrics.scrub_bytes.inc(r.bytes_hashed)
            if not r.ok:
                self.metrics.verify_failures.inc()
                event(self.logger, "entry_corrupt", logging.ERROR, key=r.key,
                      problems=[str(p) for p in r.problems])
        self.metrics.last_scrub.set(time.time())
        event(self.logger, "scrub_done", entries=len(reports),
              corrupt=sum(not r.ok for r in reports),
              bytes=sum(r.bytes_hashed for r in reports),
              seconds=round(time.monotonic() - start, 3))
        return reports

    def _loop(self) -> None:
        # Event.wait, not sleep: stop() ends the loop at once.
        while not self._stop.wait(self.interval_s):
            try:
                self.scrub_once()
            except Exception as e:  # a failed scrub must not kill the daemon
                event(self.logger, "scrub_failed", logging.ERROR, error=repr(e))

    def start(self) -> None:
        if self.interval_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="cachectl-scrub", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
