"""What every answer gets, whatever the route: the request id, the body size limit, HEAD on
GET routes, a client that leaves mid-body counted as a disconnect, and a generic 500 for a
bug. Pure ASGI middleware (no BaseHTTPMiddleware, which
would buffer streaming answers and hide the client's disconnect from the routes).

``create_app`` stacks them as: RequestIdMiddleware (outermost) -> CORS (optional) ->
GuardMiddleware -> the FastAPI app. So a CORS preflight and a 413 carry the request id too,
and a 500 carries the CORS headers.

Request ids: a client's ``X-Request-Id`` (1-128 printable ASCII characters, no spaces) is
echoed in the answer, in the events and in the log lines; without one, a fresh id is made.
An invalid one is refused with 400 (under a fresh id). The engine's own id for the request
is the request id, or ``<client's id>.<8 hex digits>`` for a client's one (``engine_id``):
clients may reuse ids, the engine must not (an aborted request's id is busy until its batch
slot frees at the next step).
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import ClientDisconnect

from ditserve.engine.server.errors import APIError, log_error

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID_PATTERN = re.compile(r"[!-~]{1,128}")  # printable ASCII: safe in headers and logs


def request_id(scope: Scope) -> str:
    """The id of the request being answered (set by RequestIdMiddleware)."""
    return str(scope.get("state", {}).get("request_id", "-"))


def is_head(request: Any) -> bool:
    """Whether the client sent HEAD (GuardMiddleware hands routes a GET)."""
    return bool(request.scope.get("state", {}).get("head"))


def engine_id(scope: Scope) -> str:
    """The engine's id for this request: unique even when a client reuses its X-Request-Id."""
    state = scope.get("state", {})
    rid = str(state.get("request_id") or uuid.uuid4().hex)
    return f"{rid}.{secrets.token_hex(4)}" if state.get("request_id_supplied") else rid


async def send_error(send: Send, error: APIError, request_id: str) -> None:
    """Answer with ``error`` directly (before the app ran, or after it failed)."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    log_error(request_id, error)
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestIdMiddleware:
    """Gives every HTTP request an id (the client's, validated, or a new one) and puts it in
    the ``X-Request-Id`` header of every answer."""

    def __init__(self, app: ASGIApp, *, count: Callable[[str], None]) -> None:
        self.app = app
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        supplied = Headers(scope=scope).get(REQUEST_ID_HEADER)
        valid = supplied is not None and REQUEST_ID_PATTERN.fullmatch(supplied) is not None
        rid = supplied if valid and supplied is not None else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"], state["request_id_supplied"] = rid, valid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = rid
            await send(message)

        if supplied is not None and not valid:
            self.count("invalid_request")
            await send_error(send_with_id, APIError(
                400, f"{REQUEST_ID_HEADER}: must be 1-128 printable ASCII characters without "
                     "spaces (or omit it and the server makes one)",
                param=REQUEST_ID_HEADER, code="invalid_request_id"), rid)
            return
        await self.app(scope, receive, send_with_id)


class BodyTooLarge(APIError):
    """A request body over ``max_body_bytes`` (raised while the route reads it)."""


def body_too_large(limit: int) -> APIError:
    return BodyTooLarge(413, f"the request body is larger than {limit} bytes",
                        code="body_too_large", reason="payload_too_large")


class GuardMiddleware:
    """Refuses bodies over ``max_body_bytes`` (413: at once by Content-Length, else while the
    body is read), answers HEAD like GET without the body, and turns an unhandled exception
    into a generic 500 (details go to the log, with the request id)."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, count: Callable[[str], None],
                 upload_paths: frozenset[str] = frozenset(), max_upload_bytes: int = 0
                 ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.count = count
        # POSTs to the routes that take image files may send up to max_upload_bytes.
        self.upload_paths = upload_paths
        self.max_upload_bytes = max_upload_bytes or max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id(scope)
        limit = self.max_body_bytes
        if scope["method"] == "POST" and scope.get("path") in self.upload_paths:
            limit = self.max_upload_bytes
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > limit:
            self.count("payload_too_large")
            await send_error(send, body_too_large(limit), rid)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # chunked, or more than Content-Length promised
                    raise body_too_large(limit)
            return message

        started = False
        head = scope["method"] == "HEAD"

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            elif head and message["type"] == "http.response.body":
                # Same status and headers (Content-Length included) as GET, no body.
                message = {"type": "http.response.body", "body": b"",
                           "more_body": message.get("more_body", False)}
            await send(message)

        if head:
            # Routes see a GET; one whose answer never ends (an event stream) reads the flag.
            scope = dict(scope, method="GET")
            scope.setdefault("state", {})["head"] = True
        try:
            await self.app(scope, limited_receive, guarded_send)
        except ClientDisconnect:
            # The client left before its body was read in full (or broke its framing, and the
            # HTTP server dropped the connection after its own 400): nobody is left to answer.
            self.count("client_disconnect")
            log.info("request %s: the client disconnected before its body arrived (%s %s)",
                     rid, scope["method"], scope.get("path"))
        except Exception:
            log.exception("request %s: unhandled error in %s %s", rid, scope["method"],
                          scope.get("path"))
            if started:
                raise  # the answer is under way; the server closes the connection
            self.count("internal")
            await send_error(send, APIError(
                500, f"internal server error (request {rid}); see the server log",
                type="server_error", code="internal_error", reason="internal"), rid)
