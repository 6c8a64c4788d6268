"""POST /v1/images/generations: OpenAI's image generation request (JSON).

A request is parsed and validated (``schemas``), admitted to the engine under its request id,
then awaited plain or as Server-Sent Events (``routes.waiting``, shared with the edits route:
admission errors, the per-request timeout, client disconnects and failures).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from ditserve.engine.server import image_openapi, openapi, responses, streaming
from ditserve.engine.server.auth import require_api_key
from ditserve.engine.server.edge import engine_id
from ditserve.engine.server.errors import APIError, request_id_of
from ditserve.engine.server.phase import check_loaded
from ditserve.engine.server.routes.waiting import admit, answer, event_stream
from ditserve.engine.server.schemas import parse_generation_request
from ditserve.engine.server.state import ServerState

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post(
    "/v1/images/generations", response_model=None, tags=["images"], openapi_extra=image_openapi.GENERATION_BODY,
    summary="Generate images (OpenAI images API; JSON, or Server-Sent Events with stream)",
    responses=openapi.answers(
        {**openapi.json_answer("ImagesResponse"), **image_openapi.sse_answer()},
        404, 408, 413, 429, 503, 504,
        ok_description="The images (JSON), or with `stream` an event stream: "
                       "image_generation.partial_image, .completed (OpenAI), error, and "
                       "ditserve.queued / ditserve.progress (JSON arrays; docs/serving.md)"),
)
async def create_image(request: Request) -> Response:
    state: ServerState = request.app.state.server
    if state.output != "image":
        raise APIError(400, f"this server serves the video model {state.model_name!r}: "
                            "create videos with POST /v1/videos (one model per replica)",
                       param="model", code="unsupported_model")
    check_loaded(state)  # 503 while loading: no verdict by limits not read yet
    rid = request_id_of(request)  # the client's (or a new) id; the engine's is unique
    limits = state.limits()
    parsed = parse_generation_request(await request.body(), engine=state.engine, limits=limits)
    p = parsed.params
    size = f"{p.width}x{p.height}"
    tokens = responses.image_tokens(p.width, p.height, limits.pixel_multiple)
    if parsed.stream:
        bridge = streaming.EventBridge(asyncio.get_running_loop())
        handle = admit(state, engine_id(request.scope), p, on_event=bridge.push)
        return StreamingResponse(
            event_stream(state, rid, handle, bridge, size=size, tokens=tokens),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    handle = admit(state, engine_id(request.scope), p)
    return await answer(state, request, rid, handle, size=size, tokens=tokens)
