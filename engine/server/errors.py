"""HTTP errors of the API, rendered as OpenAI-style JSON.

Every error response has the body ``{"error": {"message", "type", "param", "code"}}``. Route
code raises ``APIError``; ``install_handlers`` renders it, and also turns FastAPI's own
validation errors and unexpected exceptions into the same shape (a bug is a 500 with a
generic message, never a stack trace, and never for bad input).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


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
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)


def invalid(param: str | None, message: str, *, status: int = 422,
            code: str | None = "invalid_value") -> APIError:
    return APIError(status, message, param=param, code=code)


def install_handlers(app: FastAPI, count: Callable[[str], None]) -> None:
    """Render APIError, framework HTTP errors and unexpected exceptions as OpenAI JSON;
    ``count(reason)`` is called once per error response (the errors metric)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        count(exc.reason)
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), type=kind, code=code).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Only reached by routes that let FastAPI parse their input; the generation route
        # validates its body itself to control the messages.
        return APIError(422, str(exc), code="invalid_value").response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        count("internal")
        return APIError(500, "internal server error; see the server log", type="server_error",
                        code="internal_error", reason="internal").response()
