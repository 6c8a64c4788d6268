"""Where the routes read the engine's lifecycle.

/ready and admission (503 while not ready, with a message per phase: ``NOT_READY``,
``unavailable``) ask ``engine_phase``; it is the engine's own phase (``engine.lifecycle.EnginePhase``), the one place that changes
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


NOT_READY = {
    "draining": "the server is shutting down; retry on another replica",
    "stopped": "the engine has stopped; retry on another replica",
    "failed": "the engine failed; see the server log",
    "compiling": "the DiT blocks are still compiling (--compile); poll GET /ready",
    "loading": "the model is still loading; poll GET /ready",
}


def unavailable(state: Any, message: str) -> Any:
    """A 503 with Retry-After (an APIError)."""
    from ditserve.engine.server.errors import APIError

    return APIError(503, message, type="server_error", code="unavailable", reason="unavailable",
                    headers={"Retry-After": str(state.config.retry_after_s)})


def check_admitting(state: Any) -> None:
    """Raise the 503 of a replica that is not ready for new work."""
    phase = engine_phase(state)
    if phase != "ready":
        raise unavailable(state, NOT_READY[phase])
