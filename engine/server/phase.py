"""Where the routes read the engine's lifecycle.

/ready and admission (503 while not ready, with a message per phase) ask ``engine_phase``; it
reads the engine's current lifecycle attributes (``ready``, ``compiling``, ``executor``) and
the server's own (draining, a failed start, stopped). When the engine exposes one phase enum,
this function maps it; the only other readers are ``ServerState.ready`` and the
``ditserve:engine_ready`` gauge (metrics.py).
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
