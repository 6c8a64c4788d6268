"""The FastAPI application: routes, error rendering and the engine lifespan.

``create_app(engine, config)`` is called by ``main`` (a real server) and by tests (with
httpx's ASGITransport and ``start_engine=False`` around an engine they started). The lifespan
starts the engine in a worker thread, so /health answers while the weights load and /ready
turns 200 after the warm-up step; on exit it stops the engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, Response

from ditserve.engine.lifecycle import EnginePhase
from ditserve.engine.server.auth import require_api_key
from ditserve.engine.server.config import ServerConfig
from ditserve.engine.server.errors import install_handlers
from ditserve.engine.server.generation import create_image
from ditserve.engine.server.metrics import ServingMetrics
from ditserve.engine.server.state import ServerState

CREATED = int(time.time())


def create_app(
    engine: Any,
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

    app = FastAPI(title="ditserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    install_handlers(app, state.metrics.count_error)

    app.add_api_route("/v1/images/generations", create_image, methods=["POST"],
                      dependencies=[Depends(require_api_key)], response_model=None)

    @app.get("/v1/models", dependencies=[Depends(require_api_key)])
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": state.model_name, "object": "model", "created": CREATED,
             "owned_by": "ditserve"}]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        return JSONResponse(readiness(state), status_code=200 if state.ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        body = await asyncio.to_thread(state.metrics.render)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def readiness(state: ServerState) -> dict[str, Any]:
    """The /ready body: state, batch occupancy and the offload path's details."""
    engine = state.engine
    body: dict[str, Any] = {"ready": state.ready, "phase": engine.phase.value,
                            "model": state.model_name, "compile": engine.config.compile}
    if engine.failure:
        body["error"] = engine.failure
    if engine.executor is not None:
        stats = engine.stats()
        offload = engine.offload_report()
        body.update({
            "device": str(getattr(engine.runner, "device", engine.config.device)),
            "dtype": engine.config.dtype,
            "max_num_seqs": engine.config.scheduler.max_num_seqs,
            "max_queue": engine.config.scheduler.max_queue,
            "running": stats.running,
            "waiting": stats.waiting,
            "pixel_multiple": engine.pixel_multiple,
            "offload": {"enabled": True, **offload} if offload else {"enabled": False},
        })
    return body
