"""POST /v1/images/generations: admission, waiting (plain or SSE) and the per-request
timeout, client-disconnect and failure handling.

A request is parsed and validated (schemas), admitted to the engine (429 when the queue is
full, 503 while loading or draining), then awaited. Whatever ends the wait - the result, the
timeout, the client hanging up, an engine failure - the request leaves the engine: an
abandoned request is aborted so its batch slot frees at the next step boundary.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ditserve.engine.errors import (
    DitServeError,
    EngineStoppedError,
    InvalidRequestError,
    QueueFullError,
    RequestAborted,
)
from ditserve.engine.lifecycle import EnginePhase
from ditserve.engine.server import streaming
from ditserve.engine.server.errors import APIError
from ditserve.engine.server.schemas import (
    generation_response,
    parse_generation_request,
    request_error,
)
from ditserve.engine.server.state import ServerState

log = logging.getLogger(__name__)

# Status for a client that hung up (nginx's convention); nobody reads the response.
CLIENT_CLOSED = 499


def _unavailable(state: ServerState, message: str) -> APIError:
    return APIError(503, message, type="server_error", code="unavailable", reason="unavailable",
                    headers={"Retry-After": str(state.config.retry_after_s)})


def _admit(state: ServerState, params: Any, on_event: Any = None) -> Any:
    phase = state.engine.phase
    if phase in (EnginePhase.DRAINING, EnginePhase.STOPPED):
        raise _unavailable(state, "the server is shutting down; retry on another replica")
    if phase is not EnginePhase.READY:
        loading = ("the DiT blocks are still compiling (--compile)"
                   if phase is EnginePhase.COMPILING else "the model is still loading")
        detail = state.engine.failure or f"{loading}; poll GET /ready"
        raise _unavailable(state, detail)
    try:
        return state.engine.add_request(params, on_event=on_event)
    except QueueFullError as e:
        raise APIError(429, f"the queue is full ({e}); retry later", type="rate_limit_error",
                       code="queue_full", reason="queue_full",
                       headers={"Retry-After": str(state.config.retry_after_s)}) from e
    except EngineStoppedError as e:
        raise _unavailable(state, str(e)) from e
    except InvalidRequestError as e:
        raise request_error(e) from e


def _failure(state: ServerState, exc: BaseException) -> APIError:
    """The API error for a request whose engine future failed."""
    if isinstance(exc, (RequestAborted, EngineStoppedError)):
        return _unavailable(state, f"the request was aborted: {exc}")
    return APIError(500, f"generation failed: {exc}", type="server_error", code="engine_error",
                    reason="engine_error")


def _timeout(state: ServerState) -> APIError:
    return APIError(504, f"the request did not finish within {state.config.request_timeout_s:g}s "
                         "and was aborted", type="server_error", code="timeout", reason="timeout")


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect (or never comes).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _silence(future: asyncio.Future[Any]) -> None:
    # An abandoned future's exception is expected; retrieve it so asyncio does not log it.
    future.add_done_callback(lambda f: f.cancelled() or f.exception())


async def create_image(request: Request) -> Response:
    state: ServerState = request.app.state.server
    parsed = parse_generation_request(
        await request.body(), engine=state.engine, model_name=state.model_name,
        default_size=state.default_size, default_steps=state.default_steps,
    )
    if parsed.body.stream:
        loop = asyncio.get_running_loop()
        bridge = streaming.EventBridge(loop)
        handle = _admit(state, parsed.params, on_event=bridge.push)
        return StreamingResponse(
            _event_stream(state, handle, bridge), media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                     "X-Request-Id": handle.request_id},
        )
    handle = _admit(state, parsed.params)
    result_future = asyncio.wrap_future(handle.future)
    _silence(result_future)
    disconnect = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({result_future, disconnect},
                                     timeout=state.config.request_timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
    if result_future not in done:
        gone = disconnect in done
        state.engine.abort(handle.request_id, "client disconnected" if gone else "timed out")
        if not gone:
            raise _timeout(state)
        state.metrics.count_error("client_disconnect")
        return Response(status_code=CLIENT_CLOSED)
    exc = result_future.exception()
    if exc is not None:
        raise _failure(state, exc) from exc
    body = await asyncio.to_thread(generation_response, result_future.result())
    state.metrics.count_success()
    return JSONResponse(body, headers={"X-Request-Id": handle.request_id})


async def _event_stream(state: ServerState, handle: Any, bridge: streaming.EventBridge
                        ) -> AsyncIterator[bytes]:
    """queued* -> progress* -> completed | error. Leaving early (disconnect) aborts."""
    rid = handle.request_id
    loop = asyncio.get_running_loop()
    deadline = loop.time() + state.config.request_timeout_s
    done = False
    last_position: int | None = -1
    try:
        while True:
            try:
                event = await asyncio.wait_for(bridge.queue.get(), deadline - loop.time())
            except TimeoutError:
                state.engine.abort(rid, "timed out")
                error = _timeout(state)
                state.metrics.count_error(error.reason)
                done = True
                yield streaming.sse(streaming.ERROR, error.body())
                return
            if event.kind == "queued":
                if event.queue_position != last_position:  # the engine repeats it every step
                    last_position = event.queue_position
                    yield streaming.sse(streaming.QUEUED, {
                        "request_id": rid, "queue_position": event.queue_position,
                        "total_steps": event.total_steps})
            elif event.kind == "step":
                yield streaming.sse(streaming.PROGRESS, {
                    "request_id": rid, "step": event.step, "total_steps": event.total_steps})
            elif event.kind == "finished":
                # The engine emits "finished" just before it resolves the future.
                result = await asyncio.wrap_future(handle.future)
                body = await asyncio.to_thread(generation_response, result)
                state.metrics.count_success()
                done = True
                yield streaming.sse(streaming.COMPLETED, {"request_id": rid, **body})
                return
            else:  # failed | aborted
                done = True
                exc = handle.future.exception() if handle.future.done() else None
                error = _failure(state, exc or DitServeError(event.error or event.kind))
                state.metrics.count_error(error.reason)
                yield streaming.sse(streaming.ERROR, error.body())
                return
    finally:
        if not done:  # the client went away (the response task was cancelled)
            if state.engine.abort(rid, "client disconnected"):
                state.metrics.count_error("client_disconnect")
            log.info("request %s: client disconnected after %.2fs", rid,
                     time.monotonic() - handle.submitted_at)
