"""The engine's lifecycle: one phase enum, and the one place that changes it.

Pure Python. ``DiffusionEngine`` owns a ``Lifecycle`` and is the only caller of ``move``;
everything else - the HTTP server's ``/ready`` and request admission, the metrics, the step
loops deciding whether to go on - only reads ``phase`` (and ``error``).

    LOADING -> COMPILING -> READY -> DRAINING -> STOPPED
    any phase but STOPPED -> FAILED

Phases only move forward, and STOPPED and FAILED are final, so a late move loses: a drain
that begins while the model loads keeps the engine from turning READY, and the shutdown of an
engine whose loop died leaves it FAILED (the more useful answer to "why is it down").
COMPILING is skipped without ``--compile``.
"""

from __future__ import annotations

import enum
import threading


class EnginePhase(enum.Enum):
    """Where an engine replica is in its life; the value is what ``/ready`` reports."""

    LOADING = "loading"  # weights loading and the first warm-up step
    COMPILING = "compiling"  # loaded; the warm-up compiles the DiT blocks (--compile)
    READY = "ready"  # admitting requests
    DRAINING = "draining"  # refusing new requests; admitted ones run to the end
    STOPPED = "stopped"  # shut down (or shutting down: loops and workers are being joined)
    FAILED = "failed"  # could not start, or the step loop died; ``Lifecycle.error`` says why

    @property
    def is_final(self) -> bool:
        return self in (EnginePhase.STOPPED, EnginePhase.FAILED)

    @property
    def order(self) -> int:
        return _ORDER[self]


_ORDER = {phase: i for i, phase in enumerate(EnginePhase)}


class Lifecycle:
    """The current phase and, once FAILED, why. Thread-safe; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._phase = EnginePhase.LOADING
        self._error: str | None = None

    @property
    def phase(self) -> EnginePhase:
        return self._phase

    @property
    def error(self) -> str | None:
        """Why the engine FAILED (a sentence for operators), else None."""
        return self._error

    def move(self, to: EnginePhase, error: str | None = None) -> bool:
        """Enter ``to`` if it lies ahead of the current phase; False (and no change) if not.

        ``error`` is required for FAILED and refused otherwise.
        """
        if (to is EnginePhase.FAILED) != (error is not None):
            raise ValueError("an error message goes with FAILED, and only with FAILED")
        with self._lock:
            if self._phase.is_final or to.order <= self._phase.order:
                return False
            self._phase = to
            self._error = error
            return True
