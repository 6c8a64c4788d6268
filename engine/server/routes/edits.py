"""POST /v1/images/edits: OpenAI's image edit request (multipart) on an edit model.

The body is OpenAI's: ``image`` one or several files (``image[]`` as the SDK sends a list),
``prompt``, ``n``, ``size``, ``response_format``, ``stream`` and ``partial_images``, the
fields OpenAI's edit models read and a DiT does not (accepted and ignored), and ditserve's
own (``negative_prompt``, ``num_inference_steps``, ``guidance_scale``, ``true_cfg_scale``,
``seed``). ``mask`` (inpainting: a PNG whose fully transparent pixels mark the region to
repaint, as OpenAI's; or black and white, white repainted) and ``strength`` are taken by a
model that denoises from its source image (Z-Image: image-to-image, and inpainting with a
mask; ``ModelLimits.image_strength``); the other edit models edit the whole image from the
prompt and refuse both with a 400. Images are checked and decoded by ``uploads``; the text fields go
through the generation request's parser (same types, limits and messages), then the images
join the ``SamplingParams`` and the engine judges the whole (how many images the model takes).

``size`` absent or "auto": the first image's aspect ratio at the area of the server's default
size, rounded down to the model's pixel multiple. Waiting, streaming (``image_edit.*``
events), timeouts and disconnects are the generations route's (``routes.waiting``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.request import ConditionImage
from ditserve.engine.server import edit_openapi, responses, streaming
from ditserve.engine.server.auth import require_api_key
from ditserve.engine.server.edge import engine_id
from ditserve.engine.server.errors import APIError, invalid, request_id_of
from ditserve.engine.server.extension_fields import form_value
from ditserve.engine.server.form_fields import fold_nested
from ditserve.engine.server.phase import check_loaded
from ditserve.engine.server.routes.waiting import admit, answer, event_stream
from ditserve.engine.server.schemas import RequestLimits, parse_generation_fields, request_error
from ditserve.engine.server.state import ServerState
from ditserve.engine.server.uploads import is_file, read_image, read_mask, read_multipart

router = APIRouter(dependencies=[Depends(require_api_key)])

IMAGE_FIELDS = ("image", "image[]")
# OpenAI's edit-only fields that mean nothing to a DiT: accepted and ignored.
IGNORED_EDIT_FIELDS = ("input_fidelity",)
# The form's own number and flag fields (the extensions' are ``extension_fields``').
_INTEGERS = ("n", "partial_images", "output_compression", "num_inference_steps", "seed")
_NUMBERS = ("guidance_scale", "true_cfg_scale", "strength")
_BOOLEANS = ("stream",)


def _auto_size(image: ConditionImage, limits: RequestLimits) -> str:
    """The source's aspect ratio at the default size's area, on the pixel grid."""
    area = limits.default_size[0] * limits.default_size[1]
    aspect = image.width / image.height
    m = limits.pixel_multiple
    width = max(m, min(limits.max_side, int(math.sqrt(area * aspect)) // m * m))
    height = max(m, min(limits.max_side, int(math.sqrt(area / aspect)) // m * m))
    return f"{width}x{height}"


@dataclasses.dataclass(frozen=True)
class _Edit:
    """What an edit form carries besides the generation fields."""

    images: list[ConditionImage]
    mask: ConditionImage | None
    strength: float | None


async def _read_edit(request: Request, state: ServerState) -> tuple[dict[str, Any], _Edit]:
    upload = state.upload_limits()
    form = await read_multipart(request, upload)
    repaints = state.model_limits().image_strength is not None
    try:
        for name in ("mask", "strength"):
            if name in form and not repaints:
                raise invalid(name, f"{name}: masked edits (inpainting) and strength are not "
                                    f"supported by {state.model_name!r}; it edits the whole "
                                    f"image as the prompt says: send the image without {name}",
                              code="unsupported_value")
        masks = form.getlist("mask")
        if len(masks) > 1:
            raise invalid("mask", f"mask: is given {len(masks)} times; give it once")
        mask = await read_mask(masks[0], limits=upload) if masks else None
        files = [v for name in IMAGE_FIELDS for v in form.getlist(name)]
        if not files:
            raise invalid("image", "image: is required (one or more image files)",
                          code="missing_field")
        images = [await read_image(f, field="image", limits=upload) for f in files]
        plain, fields = fold_nested(form.multi_items())  # the SDK's step_cache[policy], ...
        for name in dict.fromkeys(name for name, _ in plain):
            if name in IMAGE_FIELDS or name in IGNORED_EDIT_FIELDS or name == "mask":
                continue
            values = form.getlist(name)
            if len(values) > 1:
                raise invalid(name, f"{name}: is given {len(values)} times; give it once")
            if is_file(values[0]):
                raise invalid(name, f"{name}: must be a text field, not a file")
            fields[name] = form_value(name, str(values[0]), integers=_INTEGERS,
                                      numbers=_NUMBERS, booleans=_BOOLEANS)
    finally:
        await form.close()
    strength = fields.pop("strength", None)
    return fields, _Edit(images, mask, strength)


# In /openapi.json on a replica whose model edits (tag "edits", ``openapi.build_openapi``):
# the multipart form of ``edit_openapi``, the answers of the generations route.
@router.post("/v1/images/edits", response_model=None, tags=["edits"],
             openapi_extra=edit_openapi.EDIT_BODY, responses=edit_openapi.answers(),
             summary="Edit images (OpenAI images API, multipart; JSON, or Server-Sent Events "
                     "with stream)")
async def edit_image(request: Request) -> Response:
    state: ServerState = request.app.state.server
    if state.output != "image":
        raise APIError(400, f"this server serves the video model {state.model_name!r}: "
                            "animate an image with POST /v1/videos and input_reference",
                       param="model", code="unsupported_model")
    check_loaded(state)  # before the model loaded, it seems to edit nothing
    if state.model_limits().condition_images[1] == 0:
        raise APIError(400, f"{state.model_name!r} generates images from text only and edits "
                            "none: serve an edit model (FLUX.1 Kontext, Qwen-Image-Edit), or "
                            "use POST /v1/images/generations", param="image",
                       code="unsupported_model")
    rid = request_id_of(request)
    limits = state.limits()
    fields, edit = await _read_edit(request, state)
    if fields.get("size") in (None, "auto"):
        fields["size"] = _auto_size(edit.images[0], limits)
    # The text fields are parsed by every rule but the engine's: its judgement needs the
    # images, which join the params first.
    parsed = parse_generation_fields(fields, engine=state.engine, limits=limits)
    p = dataclasses.replace(parsed.params, images=tuple(edit.images), mask=edit.mask,
                            strength=edit.strength)
    try:
        p = state.engine.validate_params(p)
    except InvalidRequestError as e:
        raise request_error(e) from e
    size = f"{p.width}x{p.height}"
    tokens = responses.image_tokens(p.width, p.height, limits.pixel_multiple)
    if parsed.stream:
        bridge = streaming.EventBridge(asyncio.get_running_loop())
        handle = admit(state, engine_id(request.scope), p, on_event=bridge.push)
        return StreamingResponse(
            event_stream(state, rid, handle, bridge, size=size, tokens=tokens,
                          names=streaming.EDIT_EVENTS),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    handle = admit(state, engine_id(request.scope), p)
    return await answer(state, request, rid, handle, size=size, tokens=tokens)
