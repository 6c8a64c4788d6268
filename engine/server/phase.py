"""Where the routes read the engine's lifecycle.

/ready and admission (503 while not ready, with a message per phase: ``NOT_READY``,
``unavailable``) read the engine's own phase (``EnginePhase``, through the
``EngineClient``); the engine is the one place that changes it. ``failure_summary`` is what
a client may see of a failure: its kind, never its internals (those are in the server log).
"""

from __future__ import annotations

from typing import Any

from ditserve.engine.errors import (
    DeadlineError,
    EngineStoppedError,
    InvalidRequestError,
    QueueFullError,
)
from ditserve.engine.loop.client import EnginePhase
from ditserve.engine.server.errors import NO_RETRY, APIError
from ditserve.engine.server.fields.body import request_error

# What the engine refuses to admit: each maps to one API error (``admission_error``).
ADMISSION_ERRORS = (QueueFullError, EngineStoppedError, InvalidRequestError, DeadlineError)
QUEUE_FULL = "every batch slot is taken and the queue is full; retry later"



def engine_phase(state: Any) -> EnginePhase:
    """The phase of the replica served by ``state`` (a ServerState)."""
    phase: EnginePhase = state.engine.phase
    return phase


def failure_summary(state: Any) -> str | None:
    """A failed replica's error for /ready: which stage failed, no exception text."""
    engine = state.engine
    if engine.phase is not EnginePhase.FAILED:
        return None
    started = engine.facts() is not None  # the model loaded: the loop died later
    stage = "the engine loop stopped" if started else "the engine failed to start"
    return f"{stage}; see the server log"


NOT_READY = {
    EnginePhase.DRAINING: "the server is shutting down; retry on another replica",
    EnginePhase.STOPPED: "the engine has stopped; retry on another replica",
    EnginePhase.FAILED: "the engine failed; see the server log",
    EnginePhase.COMPILING: "the DiT blocks are still compiling (--compile); poll GET /ready",
    EnginePhase.LOADING: "the model is still loading; poll GET /ready",
}


def unavailable(state: Any, message: str, *, code: str = "unavailable") -> APIError:
    """A 503 with Retry-After."""
    return APIError(503, message, type="server_error", code=code, reason="unavailable",
                    headers={"Retry-After": str(state.config.retry_after_s)})


def too_many(state: Any, message: str = QUEUE_FULL, retry_after: float | None = None, *,
             code: str = "queue_full", reason: str = "queue_full") -> APIError:
    """A 429 with Retry-After (``retry_after`` s, default the server's). Past a minute it
    also says ``x-should-retry: false``: the OpenAI SDK ignores a Retry-After that long and
    would retry within seconds, to no purpose."""
    seconds = state.config.retry_after_s if retry_after is None else int(retry_after)
    headers = {"Retry-After": str(seconds), **(NO_RETRY if seconds > 60 else {})}
    return APIError(429, message, type="rate_limit_error", code=code, reason=reason,
                    headers=headers)


def deadline_unmeetable(message: str) -> APIError:
    """A 429 for a deadline the replica cannot meet: without Retry-After and with
    ``x-should-retry: false``, so an OpenAI SDK does not retry it (its deadline_s would
    restart with the retry and the answer come after the deadline the client meant)."""
    return APIError(429, message, type="rate_limit_error", code="deadline_unmeetable",
                    reason="deadline", headers=dict(NO_RETRY))


def admission_error(state: Any, exc: QueueFullError | EngineStoppedError | InvalidRequestError
                    | DeadlineError) -> APIError:
    """The API error for an engine's refusal to admit a request (images and video jobs)."""
    if isinstance(exc, QueueFullError):
        return too_many(state)
    if isinstance(exc, DeadlineError):
        return deadline_unmeetable(str(exc))
    if isinstance(exc, EngineStoppedError):
        return unavailable(state, "the engine is not accepting requests; retry later")
    return request_error(exc)


def check_admitting(state: Any) -> None:
    """Raise the 503 of a replica that is not ready for new work (code ``model_loading``
    while the model loads: the client retries after Retry-After)."""
    phase = engine_phase(state)
    if phase is not EnginePhase.READY:
        code = "model_loading" if phase is EnginePhase.LOADING else "unavailable"
        raise unavailable(state, NOT_READY[phase], code=code)


def check_loaded(state: Any) -> None:
    """Raise the 503 of ``check_admitting`` while the model has not loaded. Called by every
    generation route before it parses a request: until the model loaded, the engine knows
    neither its limits (it would judge by the defaults), nor its adapters, nor whether it
    edits or animates images, so any verdict on the request would be a 4xx the client does
    not retry, where a retry after the load succeeds."""
    if state.engine.facts() is None:
        check_admitting(state)
