"""Optional Bearer-token auth for the /v1 routes (health, readiness and metrics stay open,
so kubelet probes and Prometheus need no secret).

The token is compared with ``hmac.compare_digest`` so the comparison time does not reveal
how much of a guess was right.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from ditserve.engine.server.errors import APIError


def check_bearer(authorization: str | None, api_key: str | None) -> None:
    """Raise a 401 APIError unless auth is off or ``authorization`` carries the key."""
    if api_key is None:
        return
    scheme, _, token = (authorization or "").partition(" ")
    supplied = token.strip().encode() if scheme.lower() == "bearer" else b""
    # compare_digest on both branches: a missing header costs the same as a wrong one.
    if not hmac.compare_digest(supplied, api_key.encode()) or not supplied:
        raise APIError(
            401, "missing or invalid API key; send the header 'Authorization: Bearer <key>'",
            type="authentication_error", code="invalid_api_key", reason="unauthorized",
            headers={"WWW-Authenticate": "Bearer"},
        )


async def require_api_key(request: Request) -> None:
    """FastAPI dependency for the /v1 routes."""
    check_bearer(request.headers.get("authorization"), request.app.state.server.config.api_key)
