"""Validating published entries before use: the reader lease, structure, content and stamps.

``lease_entry`` takes the shared flock that keeps GC away from an entry (it works on a
read-only mount) and turns what it meets into the store's errors: missing, a symlink out of
the root, unreadable. ``Validator`` checks an entry for a join (structure always; content
unless a stamp shows nothing changed) and for ``verify`` / scrub (always the content, under
the lease, so GC cannot remove the entry mid-hash). Called by ``CacheStore``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from ditserve.cachectl import locks
from ditserve.cachectl.errors import (
    MISSING,
    CacheError,
    EntryNotFoundError,
    LockTimeoutError,
    Problem,
    entry_error,
)
from ditserve.cachectl.hashing import RateLimiter
from ditserve.cachectl.layout import Layout
from ditserve.cachectl.manifest import Manifest
from ditserve.cachectl.stamps import (
    forget_stamp,
    racy_margin_ns,
    signatures,
    stamp_matches,
    write_stamp,
)
from ditserve.cachectl.verify import VerifyReport, check_content, check_structure, load_manifest

LEASE_WAIT_S = 30.0  # GC holds a lease exclusively only while renaming an entry away


def lease_entry(layout: Layout, key: str) -> locks.HeldLock:
    """A shared flock on the entry directory. Raises EntryNotFound, entry errors, LockTimeout."""
    path = layout.entry(key)
    try:
        lease = locks.acquire(path, shared=True, directory=True, timeout_s=LEASE_WAIT_S)
    except FileNotFoundError as e:  # never published, or GC renamed it away meanwhile
        if os.path.islink(path):  # a dangling symlink
            raise entry_error(key, check_structure(path, key)[1]) from e
        raise EntryNotFoundError(key) from e
    except OSError as e:  # a symlink (ENOTDIR: never followed) or an unreadable directory
        problems = check_structure(path, key)[1] or [Problem(key, None, str(e))]
        raise entry_error(key, problems) from e
    if lease is None:
        raise LockTimeoutError(key, LEASE_WAIT_S, "garbage collection")
    return lease


class Validator:
    """Checks entries of one layout; ``threads`` caps hashing, ``clock`` is wall seconds."""

    def __init__(self, layout: Layout, *, threads: int | None,
                 clock: Callable[[], float]) -> None:
        self.layout = layout
        self.threads = threads
        self.clock = clock

    def validate(self, key: str, path: Path, *, full: bool,
                 rehash: bool) -> tuple[Manifest | None, str]:
        """(manifest, "stamp" | "hash") for a join; (None, "") when a re-hash would be
        needed and ``rehash`` is False. Raises the entry error of what is wrong."""
        manifest, problems = check_structure(path, key)
        if problems or manifest is None:
            raise entry_error(key, problems)
        if not full and stamp_matches(self.layout.stamp(key), path, manifest):
            return manifest, "stamp"
        if not rehash:
            return None, ""
        problems = self.hash_and_stamp(key, path, manifest)[0]
        if problems:
            raise entry_error(key, problems)
        return manifest, "hash"

    def hash_and_stamp(self, key: str, path: Path, manifest: Manifest,
                       limiter: RateLimiter | None = None) -> tuple[list[Problem], int]:
        before = signatures(path, manifest)
        started = int(self.clock() * 1e9)
        problems, hashed = check_content(path, manifest, threads=self.threads, limiter=limiter)
        if problems:
            forget_stamp(self.layout.stamp(key))
        else:
            write_stamp(self.layout.stamp(key), before, signatures(path, manifest), started)
        return problems, hashed

    def verify_one(self, key: str, *, named: bool,
                   limiter: RateLimiter | None = None) -> VerifyReport:
        start = time.monotonic()
        report = self._verify(key, named=named, limiter=limiter)
        report.seconds = time.monotonic() - start
        return report

    def _verify(self, key: str, *, named: bool, limiter: RateLimiter | None) -> VerifyReport:
        report = VerifyReport(key)
        path = self.layout.entry(key)
        try:
            lease = lease_entry(self.layout, key)
        except EntryNotFoundError:
            if named:
                report.problems = [Problem(key, None, "no such entry", MISSING)]
            else:
                report.skipped = "removed while verifying (garbage collection)"
            return report
        except LockTimeoutError:
            report.skipped = "held exclusively by garbage collection"
            return report
        except CacheError as e:
            report.problems = list(getattr(e, "problems", [])) or [Problem(key, None, str(e))]
            return report
        with lease:
            manifest, report.problems = check_structure(path, key)
            if manifest is not None and not report.problems:
                report.problems, report.bytes_hashed = self.hash_and_stamp(
                    key, path, manifest, limiter)
            elif manifest is not None:
                forget_stamp(self.layout.stamp(key))
        return report

    def stamp(self, key: str) -> VerifyReport:
        """Wait out the racy window of fresh files (at most ``racy_margin_ns``), then verify
        (which records the stamp)."""
        path = self.layout.entry(key)
        try:
            sigs = signatures(path, load_manifest(path))
        except (CacheError, OSError):
            return self.verify_one(key, named=True)  # let verify describe what is wrong
        ready_ns = max(sig[4] for sig in sigs.values()) + racy_margin_ns(sigs)
        wait_s = (ready_ns - self.clock() * 1e9) / 1e9
        if wait_s > 0:
            time.sleep(wait_s)  # the kernel's coarse ctime clock must move past the files' ctime
        return self.verify_one(key, named=True)
