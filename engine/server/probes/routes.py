"""Probes and metrics, open without auth (kubelet and Prometheus need no secret):
GET /health (the process is alive), GET /ready (200 when loaded, warmed up and admitting,
else 503, with the phase and the batch, queue and offload details) and GET /metrics."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from ditserve.engine.loop.client import EnginePhase
from ditserve.engine.server import openapi
from ditserve.engine.server.phase import engine_phase, failure_summary
from ditserve.engine.server.state import ServerState

router = APIRouter()

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


@router.get("/health", response_model=None, summary="Liveness",
            responses=openapi.answers(openapi.json_answer("Health")))
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready", response_model=None, summary="Readiness (503 until ready)",
            responses=openapi.readiness_answers())
async def ready(request: Request) -> JSONResponse:
    state: ServerState = request.app.state.server
    body = readiness(state)
    return JSONResponse(body, status_code=200 if body["phase"] == "ready" else 503)


@router.get("/metrics", response_model=None, summary="Prometheus metrics",
            response_class=PlainTextResponse,
            responses=openapi.answers({"text/plain": {"type": "string"}},
                                      ok_description="Prometheus text exposition"))
async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await asyncio.to_thread(state.metrics.render)
    return Response(body, media_type=PROMETHEUS_TEXT)


def readiness(state: ServerState) -> dict[str, Any]:
    """The /ready body: the phase, batch occupancy and the offload path's details."""
    engine = state.engine
    phase = engine_phase(state)
    body: dict[str, Any] = {"ready": phase is EnginePhase.READY, "phase": phase.value,
                            "model": state.model_name, "compile": engine.config.compile}
    error = failure_summary(state)
    if error:
        body["error"] = error
    facts = engine.facts()
    if facts is not None:
        stats = engine.stats()
        offload = engine.offload_report()
        pipeline = engine.pipeline_report()
        body.update({
            "device": facts.device,
            "dtype": facts.dtype,
            "max_num_seqs": engine.config.scheduler.max_num_seqs,
            "max_queue": engine.config.scheduler.max_queue,
            "running": stats.running,
            "waiting": stats.waiting,
            # A step is never cut short: requests aborted during it (a client gone) are
            # no longer "running" but still computed until it ends.
            "step_in_flight": None if stats.step_in_flight_s is None else {
                "seconds": round(stats.step_in_flight_s, 3),
                "requests": stats.requests_in_flight},
            "max_request_tokens": getattr(engine, "max_request_tokens", None),
            "pixel_multiple": facts.limits.pixel_multiple,
            "offload": {"enabled": True, **offload} if offload else {"enabled": False},
            "pipeline": pipeline,
        })
    return body
