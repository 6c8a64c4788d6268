"""Re-hashing pulled models, each under its reader lease: ``cachectl verify`` and the daemon's
scrub (rate-limited there), as runtime entries are verified.

The lease is the shared flock a serving engine holds (``model_lease``): ``gc`` and ``rm``
cannot remove an entry while it is being hashed, and one they removed before the lease was
taken is reported as skipped (or, when it was asked for by key, missing) - never as corrupt.
"""

from __future__ import annotations

import time

from ditserve.cachectl import locks
from ditserve.cachectl.errors import MISSING, Problem
from ditserve.cachectl.hashing import RateLimiter
from ditserve.cachectl.layout import Layout
from ditserve.cachectl.model_lease import LEASE_WAIT_S
from ditserve.cachectl.pulled import check_model_entry, model_keys
from ditserve.cachectl.verify import VerifyReport


def verify_pulled(layout: Layout, key: str, *, named: bool,
                  limiter: RateLimiter | None = None,
                  lease_wait_s: float = LEASE_WAIT_S) -> VerifyReport:
    """One pulled entry: structure and every file's SHA-256 against its manifest."""
    start = time.monotonic()
    report = VerifyReport(key)
    entry = layout.model(key)
    try:
        lease = locks.acquire(entry, shared=True, directory=True, timeout_s=lease_wait_s)
    except FileNotFoundError:
        if named:
            report.problems = [Problem(key, None, "no such entry", MISSING)]
        else:
            report.skipped = "removed while verifying (garbage collection)"
        return report
    if lease is None:
        report.skipped = "held exclusively by garbage collection"
        return report
    with lease:
        if not entry.is_dir():  # renamed away between our look and the lease
            report.skipped = "removed while verifying (garbage collection)"
            return report
        hashed: list[int] = []
        report.problems = check_model_entry(entry, full=True, limiter=limiter,
                                            on_hashed=hashed.append)
        report.bytes_hashed = sum(hashed)
    report.seconds = time.monotonic() - start
    return report


def verify_pulled_models(layout: Layout, keys: list[str] | None = None, *,
                         limiter: RateLimiter | None = None) -> list[VerifyReport]:
    """Every pulled entry (``keys`` None), or those of ``keys`` that are pulled entries."""
    wanted = [k for k in model_keys(layout) if keys is None or k in keys]
    return [verify_pulled(layout, k, named=keys is not None, limiter=limiter) for k in wanted]
