"""Where the routes read the engine's lifecycle.

/ready and admission (503 while not ready, with a message per phase) ask ``engine_phase``;
it is the engine's own phase (``engine.lifecycle.EnginePhase``), the one place that changes
it being the engine. ``failure_summary`` is what a client may see of a failure: its kind,
never its internals (those are in the server log).
"""

from __future__ import annotations

from typing import Any, Literal

Phase = Literal["loading", "compiling", "ready", "draining", "failed", "stopped"]


def engine_phase(state: Any) -> Phase:
    """The phase of the replica served by ``state`` (a ServerState)."""
    phase: Phase = state.engine.phase.value
    return phase


def failure_summary(state: Any) -> str | None:
    """A failed replica's error for /ready: which stage failed, no exception text."""
    engine = state.engine
    if engine.phase.value != "failed":
        return None
    started = engine.executor is not None
    stage = "the engine loop stopped" if started else "the engine failed to start"
    return f"{stage}; see the server log"
