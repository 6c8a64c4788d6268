"""The OpenAPI part of the edits route: its multipart form, from the same ``RequestLimits`` the
generation parser enforces (the text fields are the generation body's, without ``null``: a
form field is present or absent) plus the image files, as many as the model takes.

``schemas(limits, images)`` goes into ``components.schemas`` on a replica whose model edits
(``openapi.build_openapi`` keeps the route only there); ``EDIT_BODY`` and ``answers`` are
the route's.
"""

from __future__ import annotations

from typing import Any

from ditserve.engine.server import openapi
from ditserve.engine.server.fields import step_cache as step_cache_field
from ditserve.engine.server.fields.adapters import FORM_LORAS_PATTERN
from ditserve.engine.server.generation.events import EDIT_EVENTS
from ditserve.engine.server.generation.openapi import (
    request_schema,
    sse_answer,
    stream_event_schemas,
)
from ditserve.engine.server.limits import RequestLimits
from ditserve.engine.server.openapi import ref

IMAGE_TYPES = "image/png, image/jpeg, image/webp"
EDIT_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {
    "schema": ref("ImageEditForm"),
    "encoding": {"image": {"contentType": IMAGE_TYPES},
                 "image[]": {"contentType": IMAGE_TYPES}}}}}}
# Generation fields a form carries in another shape than the JSON body (an object as text).
NOT_IN_FORM = ("step_cache",)


def _present(schema: dict[str, Any]) -> dict[str, Any]:
    """A generation field's schema without its ``null`` alternative."""
    options = [s for s in schema.get("anyOf", ()) if s != {"type": "null"}]
    return dict(options[0]) if len(options) == 1 else schema


def form_schema(limits: RequestLimits, images: int, *, repaints: bool = False
                ) -> dict[str, Any]:
    """The edit form under ``limits`` for a model that takes at most ``images`` images;
    ``repaints``: it denoises from its source (Z-Image), so it takes mask and strength."""
    generation = request_schema(limits)["properties"]
    properties: dict[str, Any] = {
        name: _present(schema) for name, schema in generation.items() if name not in NOT_IN_FORM}
    file = {"type": "string", "format": "binary",
            "description": f"PNG, JPEG or WebP; EXIF orientation applied ({IMAGE_TYPES})"}
    properties["image"] = {**file, "description": "the source image (" + IMAGE_TYPES + ")"}
    properties["image[]"] = {"type": "array", "items": file, "minItems": 1, "maxItems": images,
                             "description": f"the source images, 1 to {images} (how the "
                                            "OpenAI SDK sends a list)"}
    properties["size"]["description"] = (
        f"WIDTHxHEIGHT, multiples of {limits.pixel_multiple} up to {limits.max_side}; 'auto' "
        "or omitted: the first image's aspect ratio at the default size's area")
    properties["loras"] = {"type": "string", "pattern": FORM_LORAS_PATTERN,
                           "description": "name[:scale],... (or the JSON list as text, or "
                                          "loras[][name] / loras[][scale] pairs: the OpenAI "
                                          "SDK's extra_body)"}
    properties["step_cache"] = {
        **step_cache_field.form_schema(limits.step_cache_policies),
        "description": f"{step_cache_field.DESCRIPTION}; a policy name, 'every=K', the JSON "
                       "object as text, or its keys as step_cache[policy], "
                       "step_cache[threshold], step_cache[every] (the OpenAI SDK's extra_body)"}
    properties["input_fidelity"] = {"enum": ["high", "low"],
                                    "description": "OpenAI field, accepted and ignored"}
    if repaints:
        properties["mask"] = {**file, "description": "inpainting: a PNG whose fully "
                              "transparent pixels mark the region to repaint (OpenAI's), or "
                              "black and white (white repainted); one source image"}
        properties["strength"] = {"type": "number", "minimum": 0, "maximum": 1,
                                  "description": "1 starts from noise, lower keeps more of the "
                                  "source and runs fewer steps (default: 0.6, with a mask 1.0)"}
    return {
        "type": "object", "title": "ImageEditForm", "properties": properties,
        "required": ["prompt"],
        # One of the two spellings of the image field, never both.
        "oneOf": [{"required": ["image"], "not": {"required": ["image[]"]}},
                  {"required": ["image[]"], "not": {"required": ["image"]}}],
        "additionalProperties": False,
        "description": ("image-to-image from one source, inpainting with a mask" if repaints
                        else "mask is refused with 400 (the served edit models edit the whole "
                             "image as the prompt says)"),
    }


def answers() -> dict[int | str, Any]:
    """The route's ``responses``: the generations route's, with the ``image_edit.*`` events."""
    return openapi.answers(
        {**openapi.json_answer("ImagesResponse"), **sse_answer(EDIT_EVENTS, "Edit")},
        404, 408, 413, 429, 503, 504,
        ok_description="The edited images (JSON), or with `stream` an event stream: "
                       "image_edit.partial_image, .completed (OpenAI), error, and "
                       "image_edit.queued / image_edit.progress (JSON arrays; "
                       "docs/serving.md)")


def schemas(limits: RequestLimits, images: int, *, repaints: bool = False) -> dict[str, Any]:
    """Added to an editing replica's image schemas (``generation.openapi.schemas``)."""
    return {"ImageEditForm": form_schema(limits, images, repaints=repaints),
            **stream_event_schemas(EDIT_EVENTS, "Edit")}
