"""POST /v1/images/generations: OpenAI's image generation request (JSON).

A request is parsed and validated (``generation.request``), admitted to the engine under its
request id, then awaited plain or as Server-Sent Events (``generation.waiting``, shared with
the edits route: admission errors, the per-request timeout, client disconnects and failures).
Before the model loaded it is not judged at all: 503 ``model_loading`` (``phase.check_loaded``).
A video replica serves it when its model makes still images (``ServerState.makes_images``:
Cosmos3's text-to-image, a one-frame video answered as a PNG); others answer 400.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ditserve.engine.server.auth import require_api_key
from ditserve.engine.server.errors import APIError, request_id_of
from ditserve.engine.server.generation.request import parse_generation_request
from ditserve.engine.server.generation.waiting import respond
from ditserve.engine.server.images.openapi import GENERATION_BODY, answers
from ditserve.engine.server.phase import check_loaded
from ditserve.engine.server.state import ServerState

router = APIRouter(dependencies=[Depends(require_api_key)])


@router.post(
    "/v1/images/generations", response_model=None, tags=["images"],
    openapi_extra=GENERATION_BODY, responses=answers(),
    summary="Generate images (OpenAI images API; JSON, or Server-Sent Events with stream)",
)
async def create_image(request: Request) -> Response:
    state: ServerState = request.app.state.server
    if not state.makes_images:
        where = ("edits the images it is sent: send them with POST /v1/images/edits"
                 if state.output == "image" else "makes videos: create them with POST /v1/videos")
        raise APIError(400, f"this server's model {state.model_name!r} {where} (one model per "
                            "replica)", param="model", code="unsupported_model")
    check_loaded(state)  # 503 while loading: no verdict by limits not read yet
    rid = request_id_of(request)  # the client's (or a new) id; the engine's is unique
    limits = state.limits()
    parsed = parse_generation_request(await request.body(), engine=state.engine, limits=limits)
    return await respond(state, request, rid, parsed.params, stream=parsed.stream,
                         pixel_multiple=limits.pixel_multiple, encoding=parsed.encoding)
