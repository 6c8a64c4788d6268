"""Admission and waiting for an image request, shared by the generations and edits routes.

``respond`` is what both routes end with: ``admit`` hands a parsed request to the engine (429
when every batch slot is taken and the queue is full, 503 while loading or draining), then
``answer`` waits for a plain request's images or ``event_stream`` streams a ``stream``
request's events. Whatever ends the wait - the
result, the timeout, the client hanging up, an engine failure - the request leaves the engine:
an abandoned request is aborted so its batch slot frees at the next step boundary.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ditserve.engine.errors import (
    DeadlineError,
    DitServeError,
    EngineStoppedError,
    RequestAborted,
)
from ditserve.engine.request import SamplingParams
from ditserve.engine.server import streaming
from ditserve.engine.server.edge import engine_id
from ditserve.engine.server.errors import NO_RETRY, APIError, log_error
from ditserve.engine.server.generation import responses
from ditserve.engine.server.generation.events import ERROR, GENERATION_EVENTS, ImageEvents
from ditserve.engine.server.phase import (
    ADMISSION_ERRORS,
    admission_error,
    check_admitting,
    deadline_unmeetable,
    unavailable,
)
from ditserve.engine.server.state import ServerState

if TYPE_CHECKING:
    from ditserve.engine.loop.results import RequestEvent, RequestHandle

log = logging.getLogger(__name__)

# Status for a client that hung up (nginx's convention); nobody reads the response.
CLIENT_CLOSED = 499


def admit(state: ServerState, engine_request_id: str, params: SamplingParams,
          on_event: Callable[[RequestEvent], None] | None = None) -> RequestHandle:
    """Hand ``params`` to the engine under ``engine_request_id``: 503 while it is not admitting,
    429 with a full queue (``phase.admission_error``)."""
    check_admitting(state)
    try:
        return state.engine.add_request(params, request_id=engine_request_id,
                                        on_event=on_event)
    except ADMISSION_ERRORS as e:
        raise admission_error(state, e) from e


async def respond(state: ServerState, request: Request, rid: str, params: SamplingParams, *,
                  stream: bool, pixel_multiple: int,
                  names: ImageEvents = GENERATION_EVENTS,
                  encoding: responses.ImageEncoding = responses.PNG) -> Response:
    """Admit a judged request and answer it: its images (JSON), or with ``stream`` its events
    (``names``: the route's event names), the images written as ``encoding`` says."""
    size = f"{params.width}x{params.height}"
    tokens = responses.image_tokens(params.width, params.height, pixel_multiple)
    if stream:
        bridge = streaming.EventBridge(asyncio.get_running_loop())
        handle = admit(state, engine_id(request.scope), params, on_event=bridge.push)
        return StreamingResponse(
            event_stream(state, rid, handle, bridge, size=size, tokens=tokens, names=names,
                         encoding=encoding),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    handle = admit(state, engine_id(request.scope), params)
    return await answer(state, request, rid, handle, size=size, tokens=tokens,
                        encoding=encoding)


def failure(state: ServerState, request_id: str, exc: BaseException) -> APIError:
    """The API error for a request whose engine future failed (the cause goes to the log)."""
    log.warning("request %s failed: %s", request_id, exc)
    if isinstance(exc, (RequestAborted, EngineStoppedError)):
        return unavailable(state, "the request was aborted: the engine is shutting down or "
                                   "stopped; retry on another replica")
    if isinstance(exc, DeadlineError) and not exc.started:
        # Stopped while it waited: as a refusal at admission (another replica may make it).
        return deadline_unmeetable(f"{exc} (request {request_id})")
    if isinstance(exc, DeadlineError):
        # The client's own deadline_s passed mid-run: a 4xx (its choice, not a server fault),
        # and not 504, which reads as the server's request timeout.
        return APIError(408, f"{exc} (request {request_id})", type="invalid_request_error",
                        code="deadline_exceeded", reason="deadline", headers=dict(NO_RETRY))
    return APIError(500, f"the engine failed to generate this request (request {request_id}); "
                         "see the server log", type="server_error", code="engine_error",
                    reason="engine_error")


def timeout_error(state: ServerState) -> APIError:
    return APIError(504, f"the request did not finish within {state.config.request_timeout_s:g}s "
                         "and was aborted", type="server_error", code="timeout", reason="timeout")


async def wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect (or never comes).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def silence(future: asyncio.Future[Any]) -> None:
    # An abandoned future's exception is expected; retrieve it so asyncio does not log it.
    future.add_done_callback(lambda f: f.cancelled() or f.exception())


async def answer(state: ServerState, request: Request, rid: str, handle: RequestHandle, *,
                 size: str, tokens: int,
                 encoding: responses.ImageEncoding = responses.PNG) -> Response:
    """Wait for a plain request's images, its timeout or its client's disconnect."""
    result_future = asyncio.wrap_future(handle.future)
    silence(result_future)
    disconnect = asyncio.ensure_future(wait_for_disconnect(request))
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
            raise timeout_error(state)
        state.metrics.count_error("client_disconnect")
        log.info("request %s: client disconnected", rid)
        return Response(status_code=CLIENT_CLOSED)
    exc = result_future.exception()
    if exc is not None:
        raise failure(state, rid, exc) from exc
    result = result_future.result()
    body = await asyncio.to_thread(responses.generation_response, result, request_id=rid,
                                   size=size, tokens_per_image=tokens, encoding=encoding)
    state.metrics.count_success()
    log.debug("request %s: %d image(s) %s, %d steps in %.2fs", rid, result.num_images, size,
              result.num_inference_steps, result.latency_seconds)
    return JSONResponse(body)


async def event_stream(state: ServerState, rid: str, handle: RequestHandle,
                       bridge: streaming.EventBridge, *, size: str, tokens: int,
                       names: ImageEvents = GENERATION_EVENTS,
                       encoding: responses.ImageEncoding = responses.PNG,
                       ) -> AsyncIterator[bytes]:
    """queued* -> (progress | partial_image)* -> completed (one per image) | error.
    Leaving early (disconnect) aborts the request."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + state.config.request_timeout_s
    done = False
    last_position: int | None = -1
    previews = 0
    try:
        while True:
            try:
                event = await asyncio.wait_for(bridge.queue.get(), deadline - loop.time())
            except TimeoutError:
                state.engine.abort(handle.request_id, "timed out")
                done = True
                yield error_event(state, rid, timeout_error(state))
                return
            if event.kind == "queued":
                if event.queue_position != last_position:  # the engine repeats it every step
                    last_position = event.queue_position
                    yield streaming.progress(names.queued, "queued",
                                             event.queue_position, event.total_steps)
            elif event.kind == "step":
                yield streaming.progress(names.progress, "step", event.step,
                                         event.total_steps)
            elif event.kind == "paused":
                continue  # preempted for a higher priority: it resumes on its own
            elif event.kind == "preview":
                payloads = await asyncio.to_thread(
                    responses.partial_image_payloads, event.pixels, index=previews,
                    step=event.step, size=size, request_id=rid, encoding=encoding)
                previews += 1
                for payload in payloads:
                    yield streaming.sse(names.partial_image, payload)
            elif event.kind == "finished":
                # The engine emits "finished" just before it resolves the future.
                result = await asyncio.wrap_future(handle.future)
                payloads = await asyncio.to_thread(responses.completed_payloads, result,
                                                   request_id=rid, size=size,
                                                   tokens_per_image=tokens,
                                                   encoding=encoding)
                state.metrics.count_success()
                done = True
                for payload in payloads:
                    yield streaming.sse(names.completed, payload)
                return
            else:  # failed | aborted
                done = True
                exc = handle.future.exception() if handle.future.done() else None
                yield error_event(state, rid,
                                   failure(state, rid, exc or DitServeError(event.error or "")))
                return
    finally:
        if not done:  # the client went away (the response task was cancelled)
            if state.engine.abort(handle.request_id, "client disconnected"):
                state.metrics.count_error("client_disconnect")
            log.info("request %s: client disconnected after %.2fs", rid,
                     time.monotonic() - handle.submitted_at)


def error_event(state: ServerState, rid: str, error: APIError) -> bytes:
    state.metrics.count_error(error.reason)
    log_error(rid, error)
    return streaming.sse(ERROR, error.body())
