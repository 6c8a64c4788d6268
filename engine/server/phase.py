"""The one place the HTTP layer reads the engine's lifecycle.

/ready, admission (503 while not ready) and the error messages all ask ``engine_phase``; it
reads the engine's current lifecycle attributes (``ready``, ``compiling``, ``executor``) and
the server's own (draining, a failed start, stopped). When the engine exposes one phase enum,
only this function changes.
"""

from __future__ import annotations

from typing import Any, Literal

Phase = Literal["loading", "compiling", "ready", "draining", "failed", "stopped"]


def engine_phase(state: Any) -> Phase:
    """The phase of the replica served by ``state`` (a ServerState)."""
    engine = state.engine
    if state.startup_error:
        return "failed"
    if state.draining:
        return "draining"
    if state.ready:
        return "ready"
    if engine.compiling:
        return "compiling"  # weights loaded; the warm-up compiles the blocks (--compile)
    return "loading" if engine.executor is None or not engine.ready else "stopped"
