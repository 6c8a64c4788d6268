"""The cache's error taxonomy. Every error a user can cause says how to fix it.

Raised by ``ditserve.cachectl.store`` and friends; the CLI turns them into exit codes (see
``cli.py``: corruption 1, usage 2, anything missing or unavailable 3) and the daemon into HTTP
statuses. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass


class CacheError(Exception):
    """Base class of every error raised on purpose by ditserve.cachectl."""


class UsageError(CacheError, ValueError):
    """The caller passed something malformed (a key that is not 64 hex digits, a bad size)."""


class InvalidIdentityError(CacheError, ValueError):
    """An entry identity field is invalid (bad dtype, rank outside its group, bad digest)."""


class CacheNotFoundError(CacheError, LookupError):
    """The root holds no cache (a mistyped --root must not look like an empty cache)."""

    def __init__(self, root: str) -> None:
        super().__init__(
            f"no cache at {root} (it has no v1/entries directory): check --root / "
            "$DITSERVE_CACHE_ROOT, or build an entry first with `cachectl build --model DIR`"
        )
        self.root = root


class ReadOnlyCacheError(CacheError, OSError):
    """A command that must write met a read-only cache root (an engine pod's mount)."""

    def __init__(self, root: str, action: str) -> None:
        super().__init__(
            f"cannot {action}: the cache root {root} is read-only here (an engine pod mounts it "
            "read-only); run this where the cache is writable: the cachectl DaemonSet "
            "(`kubectl exec`), the `cachectl ensure` init container, or the node itself"
        )
        self.root = root


class EntryNotFoundError(CacheError, LookupError):
    """No published entry has this key (it was never built, or GC removed it)."""

    def __init__(self, key: str) -> None:
        super().__init__(
            f"no cache entry {key}: build it with `cachectl build --model DIR` or "
            "`cachectl ensure --model DIR`, or check --root / $DITSERVE_CACHE_ROOT"
        )
        self.key = key


# Kinds of problem: ``corrupt`` (the bytes or the manifest are wrong), ``unreadable`` (this
# process may not read them), ``outdated`` (written by an older cachectl), ``missing``.
CORRUPT, UNREADABLE, OUTDATED, MISSING = "corrupt", "unreadable", "outdated", "missing"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an entry; ``file`` is None for entry-level problems."""

    entry: str
    file: str | None
    what: str
    kind: str = CORRUPT

    def __str__(self) -> str:
        where = f"{self.entry}/{self.file}" if self.file else self.entry
        return f"{where}: {self.what}"


def _listed(problems: list[Problem]) -> str:
    listed = "; ".join(str(p) for p in problems[:5])
    return listed + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else "")


class EntryCorruptError(CacheError):
    """A published entry failed validation; it is never repaired silently."""

    def __init__(self, key: str, problems: list[Problem]) -> None:
        super().__init__(
            f"cache entry {key} is corrupt: {_listed(problems)}. Run `cachectl verify {key}` "
            f"for the full report, then `cachectl rm {key}` and rebuild it"
        )
        self.key = key
        self.problems = problems


class EntryUnavailableError(CacheError):
    """An entry exists but cannot be used here: unreadable, or written by an older cachectl."""

    def __init__(self, key: str, problems: list[Problem]) -> None:
        super().__init__(f"cache entry {key} cannot be used: {_listed(problems)}")
        self.key = key
        self.problems = problems


def entry_error(key: str, problems: list[Problem]) -> CacheError:
    """The error a join raises for ``problems``: corruption wins over every other kind."""
    if any(p.kind == CORRUPT for p in problems):
        return EntryCorruptError(key, problems)
    return EntryUnavailableError(key, problems)


class ContentMismatchError(CacheError):
    """Tensors in hand differ from the published entry of the same identity: never joined."""

    def __init__(self, key: str, differing: list[str]) -> None:
        shown = ", ".join(differing[:5]) + (f" (+{len(differing) - 5} more)"
                                            if len(differing) > 5 else "")
        super().__init__(
            f"cache entry {key} holds other tensor content than this load produced "
            f"(differing: {shown}); keeping the loaded tensors. The loader's output changed "
            "without its version: bump LOADER_VERSION, or `cachectl rm` the entry and rebuild"
        )
        self.key = key
        self.differing = differing


class ManifestError(CacheError, ValueError):
    """A manifest is unreadable or inconsistent (including file names escaping the entry)."""

    def __init__(self, message: str, *, kind: str = CORRUPT) -> None:
        super().__init__(message)
        self.kind = kind


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
    """The cache filesystem lacks the free space (or free inodes) a publication needs."""

    def __init__(self, root: str, needed: int, free: int, *, unit: str = "bytes") -> None:
        if unit == "inodes":
            amount = f"need {needed} free inodes, {free} left"
        else:
            amount = f"need {needed / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free"
        super().__init__(
            f"not enough space under {root}: {amount}; run `cachectl gc --max-bytes N` or "
            "grow the volume"
        )
        self.needed = needed
        self.free = free
        self.unit = unit


class BuildError(CacheError):
    """Building an entry's tensors failed (loader error, missing model files)."""


class DaemonError(CacheError):
    """The node daemon answered with an error or could not be reached."""


class NodeStatusError(CacheError):
    """Reporting the node's cache status to the Kubernetes API failed."""


class ModelSourceError(CacheError):
    """Pulling a model from hf:// or s3:// failed; ``reason`` is a short CamelCase word the
    operator puts into the deployment's condition (``ModelDownloadFailed: NotFound``)."""

    reason = "SourceError"

    def __init__(self, uri: str, message: str) -> None:
        super().__init__(f"cannot pull {uri}: {message}")
        self.uri = uri


class ModelNotFoundError(ModelSourceError, LookupError):
    """The repository, revision, bucket or prefix does not exist (HTTP 404, an empty prefix)."""

    reason = "NotFound"


class ModelAccessError(ModelSourceError, PermissionError):
    """The source refused the credentials, or none were given (HTTP 401/403, a gated repo)."""

    reason = "Unauthorized"


class ModelDigestError(ModelSourceError):
    """A downloaded file differs from the digest its source published (it was deleted, so the
    next pull downloads it again; nothing was published), or the node's entry for the same key
    holds other files than the source lists (it is not joined)."""

    reason = "DigestMismatch"


class PullCancelledError(CacheError):
    """The pull was stopped (the daemon's SIGTERM, Ctrl-C) while downloading; what it fetched
    stays in its partial folder, and the next pull of the same source continues from it."""

    def __init__(self, uri: str) -> None:
        super().__init__(f"the pull of {uri} was stopped; its partial download is kept and the "
                         "next pull continues it")
        self.uri = uri
