"""The job layer's errors: what the routes turn into 429 / 400 / 503, and what fails a job.

Raised by ``JobStore`` (StoreFull, NeverFits), the backends (StoreUnavailable) and
``VideoFiles`` (StorageError); caught by videos/routes.py, app.py and ``JobWorker``.
"""

from __future__ import annotations

from ditserve.engine.errors import DitServeError


class StoreFull(DitServeError):
    """No room for another job; ``retry_after_s``: when room is known to come, else None."""

    def __init__(self, message: str, retry_after_s: float | None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NeverFits(DitServeError):
    """A job that reserves more bytes than the whole store holds: no wait makes room."""

    def __init__(self, reserved: int, max_bytes: int) -> None:
        super().__init__(
            f"this video reserves {reserved} bytes (frames x height x width x 3 + 64 KiB, the "
            f"bound of its MP4 until it is encoded), more than the video store's whole {max_bytes} "
            "bytes (--video-max-bytes): it can never fit; ask for fewer frames or a smaller "
            "size, or raise --video-max-bytes")
        self.reserved = reserved
        self.max_bytes = max_bytes


class StoreUnavailable(DitServeError):
    """The job backend cannot be reached now (Redis down, a network split): new jobs and
    reads answer 503 with Retry-After; running jobs go on and write their results later."""


class StorageError(DitServeError):
    """A video could not be stored. ``no_space``: the filesystem is full (or over quota)."""

    def __init__(self, message: str, *, no_space: bool) -> None:
        super().__init__(message)
        self.no_space = no_space
