"""POST /v1/images/edits: OpenAI's image edit request (multipart) on an edit model.

The body is OpenAI's: ``image`` one or several files (``image[]`` as the SDK sends a list),
``prompt``, ``n``, ``size``, ``response_format``, ``stream`` and ``partial_images``, the
fields OpenAI's edit models read and a DiT does not (accepted and ignored), and ditserve's
own (``negative_prompt``, ``num_inference_steps``, ``guidance_scale``, ``true_cfg_scale``,
``seed``). ``mask`` (inpainting: a PNG whose fully transparent pixels mark the region to
repaint, as OpenAI's; or black and white, white repainted) and ``strength`` are taken by a
model that denoises from its source image (Z-Image: image-to-image, and inpainting with a
mask; ``ModelLimits.image_strength``); the other edit models edit the whole image from the
prompt and refuse both with a 400. The form is read by ``edits.form`` (images checked and
decoded by ``fields.uploads``); the text fields go through the generation request's parser
(``generation.request``: same types, limits and messages), then the images join the
``SamplingParams`` and the engine judges the whole (how many images the model takes). Before
the model loaded nothing is judged: 503 ``model_loading`` (``phase.check_loaded``).

``size`` absent or "auto": the first image's aspect ratio at the area of the server's default
size, rounded down to the model's pixel multiple. Waiting, streaming (``image_edit.*``
events), timeouts and disconnects are the generations route's (``generation.waiting``).
"""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.server.auth import require_api_key
from ditserve.engine.server.edits.form import auto_size, edit_images, read_edit
from ditserve.engine.server.edits.openapi import EDIT_BODY, answers
from ditserve.engine.server.errors import APIError, request_id_of
from ditserve.engine.server.fields.body import request_error
from ditserve.engine.server.generation.events import EDIT_EVENTS
from ditserve.engine.server.generation.request import parse_generation_fields
from ditserve.engine.server.generation.waiting import respond
from ditserve.engine.server.phase import check_loaded
from ditserve.engine.server.state import ServerState

router = APIRouter(dependencies=[Depends(require_api_key)])


# In /openapi.json on a replica whose model edits (tag "edits", ``openapi.build_openapi``):
# the multipart form of ``edits.openapi``, the answers of the generations route.
@router.post("/v1/images/edits", response_model=None, tags=["edits"],
             openapi_extra=EDIT_BODY, responses=answers(),
             summary="Edit images (OpenAI images API, multipart; JSON, or Server-Sent Events "
                     "with stream)")
async def edit_image(request: Request) -> Response:
    state: ServerState = request.app.state.server
    if state.output != "image":
        raise APIError(400, f"this server serves the video model {state.model_name!r}: "
                            "animate an image with POST /v1/videos and input_reference",
                       param="model", code="unsupported_model")
    check_loaded(state)  # before the model loaded, it seems to edit nothing
    if edit_images(state) == 0:
        raise APIError(400, f"{state.model_name!r} generates images from text only and edits "
                            "none: serve an edit model (FLUX.1 Kontext, Qwen-Image-Edit), or "
                            "use POST /v1/images/generations", param="image",
                       code="unsupported_model")
    rid = request_id_of(request)
    limits = state.limits()
    fields, edit = await read_edit(request, state)
    if fields.get("size") in (None, "auto"):
        fields["size"] = auto_size(edit.images[0], limits)
    # The text fields are parsed by every rule but the engine's: its judgement needs the
    # images, which join the params first.
    parsed = parse_generation_fields(fields, engine=state.engine, limits=limits)
    p = dataclasses.replace(parsed.params, images=tuple(edit.images), mask=edit.mask,
                            strength=edit.strength)
    try:
        p = state.engine.validate_params(p)
    except InvalidRequestError as e:
        raise request_error(e) from e
    return await respond(state, request, rid, p, stream=parsed.stream,
                         pixel_multiple=limits.pixel_multiple, names=EDIT_EVENTS,
                         encoding=parsed.encoding)
