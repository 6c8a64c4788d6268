"""The FastAPI application: middleware, routers, error rendering, the OpenAPI document and
the engine lifespan.

``create_app(engine, config)`` is called by ``main`` (a real server) and by tests (with
httpx's ASGITransport and ``start_engine=False`` around an engine they started). The lifespan
starts the engine in a worker thread, so /health answers while the weights load and /ready
turns 200 after the warm-up step; on exit it stops the engine. Routes live in one package
per endpoint family (``images``, ``edits``, ``videos``, ``adapters``, ``models``,
``probes``), each with its ``routes.router``; a new family is a package and one more
``include_router``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from starlette.middleware.cors import CORSMiddleware

from ditserve.engine.loop.client import EngineClient, EnginePhase
from ditserve.engine.server.adapters import routes as adapters
from ditserve.engine.server.auth import check_bearer
from ditserve.engine.server.config import UPLOAD_PATHS, ServerConfig
from ditserve.engine.server.edge import REQUEST_ID_HEADER, GuardMiddleware, RequestIdMiddleware
from ditserve.engine.server.edits import openapi as edit_openapi
from ditserve.engine.server.edits import routes as edits
from ditserve.engine.server.edits.form import edit_images, repaints
from ditserve.engine.server.errors import install_handlers
from ditserve.engine.server.generation import openapi as image_openapi
from ditserve.engine.server.images import routes as images
from ditserve.engine.server.jobs.errors import StoreUnavailable
from ditserve.engine.server.metrics import ServingMetrics
from ditserve.engine.server.models import routes as models
from ditserve.engine.server.openapi import build_openapi
from ditserve.engine.server.phase import unavailable
from ditserve.engine.server.probes import routes as probes
from ditserve.engine.server.state import ServerState
from ditserve.engine.server.videos import openapi as video_openapi
from ditserve.engine.server.videos import routes as videos


def create_app(
    engine: EngineClient,
    config: ServerConfig,
    *,
    start_engine: bool = True,
    serving_metrics: ServingMetrics | None = None,
    on_start_failed: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """serving_metrics: the ServingMetrics the engine observes (``state.engine_options``)."""
    state = ServerState.build(engine, config, metrics=serving_metrics,
                              on_start_failed=on_start_failed)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        starting = None
        if start_engine and engine.phase is EnginePhase.LOADING:
            starting = asyncio.create_task(asyncio.to_thread(state.start_engine))
        try:
            yield
        finally:
            if starting is not None and not starting.done():
                await starting  # a loading thread cannot be interrupted; let it finish
            await asyncio.to_thread(state.stop, 0.0)

    # No trailing-slash redirects: their Location is built from the client's Host header;
    # a path with a stray "/" is a 404 that names the route meant (errors.py).
    app = FastAPI(title="ditserve", lifespan=lifespan, redoc_url=None, redirect_slashes=False,
                  docs_url="/docs" if config.docs else None)
    app.state.server = state
    count = state.metrics.count_error
    install_handlers(app, count, authorize=lambda request: check_bearer(
        request.headers.get("authorization"), config.api_key))

    @app.exception_handler(StoreUnavailable)
    async def _job_store_down(request: Request, exc: StoreUnavailable) -> Response:
        # New jobs and reads wait for the store; jobs already running go on (jobs.worker).
        error = unavailable(state, f"{exc}; retry later")
        error.code = "job_store_unavailable"
        count(error.reason)
        return error.response()
    for group in (images, edits, models, probes, videos):
        app.include_router(group.router)
    if adapters.runtime_updates_allowed():  # reads host files: only when the operator opts in
        app.include_router(adapters.router)
    else:
        app.include_router(adapters.disabled_router)  # 404s that name the variable

    # Added innermost first: RequestId -> CORS -> Guard -> routes (see edge.py).
    app.add_middleware(GuardMiddleware, max_body_bytes=config.max_body_bytes, count=count,
                       upload_paths=UPLOAD_PATHS, max_upload_bytes=config.max_upload_bytes)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(config.allowed_origins),
            allow_methods=["GET", "HEAD", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type", REQUEST_ID_HEADER],
            expose_headers=[REQUEST_ID_HEADER, "Retry-After", "x-should-retry"], max_age=600,
        )
    app.add_middleware(RequestIdMiddleware, count=count)

    documents: dict[Any, dict[str, Any]] = {}

    def openapi() -> dict[str, Any]:
        # The body's rules depend on the loaded model (pixel multiple, prompt limit, frames).
        key = (state.limits(), state.video_limits() if state.videos is not None else None,
               edit_images(state), repaints(state))
        if key not in documents:
            video = key[1] is not None
            kind = (video_openapi.schemas(key[1]) if key[1] is not None
                    else image_openapi.schemas(key[0]))
            if video and state.makes_images:  # a video model's still images (Cosmos3)
                kind |= image_openapi.schemas(key[0])
            if key[2]:
                kind |= edit_openapi.schemas(key[0], key[2], repaints=key[3])
            documents[key] = build_openapi(app, api_key=config.api_key is not None,
                                           kind_schemas=kind, video=video, edits=key[2] > 0,
                                           images=state.makes_images)
        return documents[key]

    app.openapi = openapi  # type: ignore[method-assign]
    return app
