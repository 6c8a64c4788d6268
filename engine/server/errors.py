"""HTTP errors of the API, rendered as OpenAI-style JSON.

Every error response has the body ``{"error": {"message", "type", "param", "code"}}`` and
counts once in ``ditserve:request_errors_total`` under its ``reason``. Route code raises
``APIError``; ``install_handlers`` renders it, and turns the framework's own errors (unknown
route, wrong method, its validation) into the same shape. Unexpected exceptions become a
generic 500 in ``edge`` (a bug is never reported with its internals, and never for bad
input). Client values quoted in a message go through ``shown``, which caps them, and every
message is made encodable (a lone surrogate in a client's value cannot break the answer).
"""

from __future__ import annotations

import logging
import re
import reprlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

log = logging.getLogger(__name__)

# The OpenAI SDKs retry 408, 409, 429 and 5xx (twice by default) unless the answer says
# ``x-should-retry: false``: a missed deadline must not "succeed" on a retry after it.
NO_RETRY = {"x-should-retry": "false"}
MAX_SHOWN_CHARS = 80  # a client's value quoted in an error message is cut to about this
MAX_MESSAGE_CHARS = 1000

_repr = reprlib.Repr()
_repr.maxstring = MAX_SHOWN_CHARS
_repr.maxother = MAX_SHOWN_CHARS
_repr.maxlong = 40
_repr.maxlevel = 2
_repr.maxlist = _repr.maxdict = _repr.maxtuple = 4


def shown(value: Any) -> str:
    """A client's value for an error message: ``repr`` cut to a few dozen characters (a 1 MB
    field is not echoed back), depth-limited (so deep nesting cannot recurse)."""
    return _repr.repr(value)


def encodable(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` as valid UTF-8 (lone surrogates escaped) and at most ``limit`` characters."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(eq=False)  # eq would make the exception unhashable
class APIError(Exception):
    """An error the API reports to the client; ``reason`` labels the errors metric."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    reason: str = "invalid_request"
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, object]:
        param = encodable(self.param, MAX_SHOWN_CHARS) if self.param is not None else None
        return {"error": {"message": encodable(self.message), "type": self.type,
                          "param": param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


def invalid(param: str | None, message: str, *, status: int = 400,
            code: str | None = "invalid_value") -> APIError:
    """A 400 for a client's bad input; ``param`` names the field."""
    return APIError(status, message, param=param, code=code)


def request_id_of(request: Request) -> str:
    return str(getattr(request.state, "request_id", "-"))


def log_error(request_id: str, error: APIError) -> None:
    """One log line per error answer, with the request id the client got in X-Request-Id."""
    level = logging.WARNING if error.status >= 500 else logging.INFO
    log.log(level, "request %s: %d %s: %s", request_id, error.status, error.code,
            encodable(error.message, 300))


def method_not_allowed(exc: StarletteHTTPException, request: Request | None = None
                       ) -> APIError:
    allowed = [m.strip() for m in (exc.headers or {}).get("Allow", "").split(",") if m.strip()]
    if request is not None:
        # Starlette names the methods of the first route on the path; several routes may
        # share it (GET and DELETE /v1/videos/{id}), so ask the router about each method.
        for method in ("GET", "POST", "PUT", "PATCH", "DELETE"):
            scope = {**request.scope, "method": method}
            if method not in allowed and any(route.matches(scope)[0] is Match.FULL
                                             for route in request.app.router.routes):
                allowed.append(method)
    if "GET" in allowed and "HEAD" not in allowed:
        allowed.append("HEAD")  # edge answers HEAD on every GET route
    return APIError(405, f"method not allowed; this route accepts {', '.join(allowed)}",
                    code="method_not_allowed", reason="method_not_allowed",
                    headers={"Allow": ", ".join(allowed)})


def _meant(request: Request) -> str:
    """"; did you mean '/v1/models'?" for a path that names a route but for its last "/"."""
    path = request.url.path
    if not path.endswith("/") or path == "/":
        return ""
    scope = {**request.scope, "path": path.rstrip("/")}
    routes = request.app.router.routes
    if any(route.matches(scope)[0] is not Match.NONE for route in routes):
        return f"; did you mean {shown(path.rstrip('/'))}?"
    return ""


# OpenAI routes ditserve does not offer, answered as such: a bare 404 reads, in the SDK, as
# "that video does not exist" (NotFoundError).
_UNSUPPORTED_ROUTES = (
    ("POST", re.compile(r"/v1/videos/[^/]+/remix"), "video_id",
     "remixing a finished video is not supported by ditserve; create a new video with "
     "POST /v1/videos (the same prompt and seed reproduce it)"),
    ("POST", re.compile(r"/v1/images/variations"), "image",
     "image variations are not supported by ditserve; edit the image with "
     "POST /v1/images/edits (a prompt says what to change)"),
)


def unsupported_openai_route(method: str, path: str) -> APIError | None:
    """A 400 ``unsupported_value`` for an OpenAI route ditserve leaves out (None: another)."""
    for route_method, pattern, param, message in _UNSUPPORTED_ROUTES:
        if method == route_method and pattern.fullmatch(path.rstrip("/")):
            return invalid(param, message, code="unsupported_value")
    return None


def install_handlers(app: FastAPI, count: Callable[[str], None], *,
                     authorize: Callable[[Request], None] | None = None) -> None:
    """Render APIError and the framework's HTTP and validation errors as OpenAI JSON;
    ``count(reason)`` is called once per error response (the errors metric).
    ``authorize(request)`` (raising a 401 APIError) runs before a 404 or 405 under ``/v1/``
    is answered: without the key, a client learns nothing of which routes exist."""

    def render(request: Request, error: APIError) -> JSONResponse:
        count(error.reason)
        log_error(request_id_of(request), error)
        return error.response()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return render(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if authorize is not None and exc.status_code in (404, 405) and (
                request.url.path.startswith("/v1/")):
            try:
                authorize(request)
            except APIError as unauthorized:
                return render(request, unauthorized)
        if exc.status_code == 405:
            return render(request, method_not_allowed(exc, request))
        if exc.status_code == 404:
            missing = unsupported_openai_route(request.method, request.url.path)
            return render(request, missing or APIError(
                404, f"no route {request.method} {shown(request.url.path)}"
                     f"{_meant(request)}; see /docs or /openapi.json", code="not_found",
                reason="not_found"))
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        reason = "invalid_request" if exc.status_code < 500 else "internal"
        return render(request, APIError(exc.status_code, str(exc.detail), type=kind,
                                        reason=reason, headers=dict(exc.headers or {})))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Only reached by routes that let FastAPI parse their input (path parameters); the
        # generation route validates its body itself to control the messages.
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return render(request, invalid(param, f"{param}: {first.get('msg', 'is invalid')}"))
