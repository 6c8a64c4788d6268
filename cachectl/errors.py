"""The cache's error taxonomy. Every error a user can cause says how to fix it.

Raised by ``ditserve.cachectl.store`` and friends; the CLI turns them into exit codes and the
daemon into HTTP statuses. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass


class CacheError(Exception):
    """Base class of every error raised on purpose by ditserve.cachectl."""


class InvalidIdentityError(CacheError, ValueError):
    """An entry identity field is invalid (bad dtype, rank outside its group, bad digest)."""


class EntryNotFoundError(CacheError, LookupError):
    """No published entry has this key (it was never built, or GC removed it)."""

    def __init__(self, key: str) -> None:
        super().__init__(
            f"no cache entry {key}: build it with `cachectl build --model DIR` or "
            "`cachectl ensure --model DIR`, or check --root / $DITSERVE_CACHE_ROOT"
        )
        self.key = key


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an entry; ``file`` is None for entry-level problems."""

    entry: str
    file: str | None
    what: str

    def __str__(self) -> str:
        where = f"{self.entry}/{self.file}" if self.file else self.entry
        return f"{where}: {self.what}"


class EntryCorruptError(CacheError):
    """A published entry failed validation; it is never repaired silently."""

    def __init__(self, key: str, problems: list[Problem]) -> None:
        listed = "; ".join(str(p) for p in problems[:5])
        more = f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
        super().__init__(
            f"cache entry {key} is corrupt: {listed}{more}. Run `cachectl verify {key}` for the "
            f"full report, then `cachectl rm {key}` and rebuild it"
        )
        self.key = key
        self.problems = problems


class ManifestError(CacheError, ValueError):
    """A manifest is unreadable or inconsistent (including file names escaping the entry)."""


class LockTimeoutError(CacheError, TimeoutError):
    """Another process held the key's build lock for longer than the timeout."""

    def __init__(self, key: str, timeout_s: float, holder: str | None) -> None:
        who = f" (held by {holder})" if holder else ""
        super().__init__(
            f"timed out after {timeout_s:.0f}s waiting for the build lock of entry {key}{who}: "
            "another process is still building it; wait longer (--timeout) or check that process"
        )
        self.key = key


class InsufficientSpaceError(CacheError, OSError):
    """The cache filesystem lacks the free space a publication needs."""

    def __init__(self, root: str, needed: int, free: int) -> None:
        super().__init__(
            f"not enough space under {root}: need {needed / 2**30:.2f} GiB, "
            f"{free / 2**30:.2f} GiB free; run `cachectl gc --max-bytes N` or grow the volume"
        )
        self.needed = needed
        self.free = free


class BuildError(CacheError):
    """Building an entry's tensors failed (loader error, missing model files)."""


class DaemonError(CacheError):
    """The node daemon answered with an error or could not be reached."""


class NodeStatusError(CacheError):
    """Reporting the node's cache status to the Kubernetes API failed."""
