"""The OpenAPI parts the image routes share: the generation body (from the same
``RequestLimits`` the parser enforces: size pattern, prompt length, step bound, model id; the
edit form is derived from it), the images answer, its ``usage``, and the schema of each stream
event (OpenAI's objects, and ditserve's progress arrays, ``streaming.progress``; the names are
``generation.events``').

``schemas(limits)`` goes into ``components.schemas`` (``openapi.build_openapi``, on an image
replica); ``sse_answer`` is part of each image route's answers (``images.openapi``,
``edits.openapi``).
"""

from __future__ import annotations

from typing import Any

from ditserve.engine.request import MAX_IMAGES, MAX_PARTIAL_IMAGES
from ditserve.engine.server.fields import step_cache as step_cache_field
from ditserve.engine.server.generation.events import ERROR, GENERATION_EVENTS, ImageEvents
from ditserve.engine.server.generation.request import FIELD_VALUES, FIELDS, IGNORED_FIELDS
from ditserve.engine.server.limits import RequestLimits
from ditserve.engine.server.openapi import (
    LORAS_SCHEMA,
    NOT_ONLY_SPACES,
    error_schema,
    nullable,
    ref,
    scheduling_fields,
    size_pattern,
)


def request_schema(limits: RequestLimits) -> dict[str, Any]:
    """The JSON Schema of the generation body under ``limits`` (what the parser accepts)."""
    text = {"type": "string"}
    prompt: dict[str, Any] = {"type": "string", "minLength": 1, "pattern": NOT_ONLY_SPACES,
                              "description": "what to draw (not only spaces)"}
    if limits.max_prompt_chars is not None:
        prompt["maxLength"] = limits.max_prompt_chars
    width, height = limits.default_size

    def integer(low: int, high: int, description: str) -> dict[str, Any]:
        return nullable({"type": "integer", "minimum": low, "maximum": high,
                          "description": description})

    def number(description: str) -> dict[str, Any]:
        return nullable({"type": "number", "minimum": 0, "maximum": 100,
                          "description": description})

    properties: dict[str, Any] = {
        "prompt": prompt,
        "model": nullable({"const": limits.model_name, "description": "the served model; "
                           "a LoRA adapter's name from GET /v1/models also selects it (at "
                           "scale 1) on top of the base model"}),
        "n": integer(1, MAX_IMAGES, "images to generate (default 1)"),
        "size": nullable({"type": "string", "pattern": size_pattern(limits),
                           "description": f"WIDTHxHEIGHT, multiples of {limits.pixel_multiple}"
                                          f" up to {limits.max_side} (the model's and the "
                                          f"server's bound); 'auto' or omitted: "
                                          f"{width}x{height}"}),
        "response_format": nullable({"const": "b64_json"}),
        "user": nullable(text),
        "stream": nullable({"type": "boolean", "description": "answer with Server-Sent "
                             "Events (progress, partial images, then the images)"}),
        "partial_images": integer(0, MAX_PARTIAL_IMAGES, "previews to stream at evenly spaced "
                                  "steps (with stream)"),
        **{name: nullable(text) for name in IGNORED_FIELDS},
        **{name: nullable({"enum": list(values)}) for name, values in FIELD_VALUES.items()},
        "output_compression": integer(0, 100, "JPEG's and WebP's quality (default 100); PNG "
                                      "is lossless and ignores it"),
        "negative_prompt": nullable(text),
        "num_inference_steps": integer(1, limits.max_steps,
                                       f"denoise steps (default {limits.default_steps})"),
        "guidance_scale": number(f"distilled guidance of Flux-dev (default "
                                 f"{limits.default_guidance:g})"),
        "true_cfg_scale": number("classifier-free guidance against negative_prompt (the "
                                 "empty one too) when > 1; off without a negative_prompt "
                                 f"(default {limits.default_true_cfg:g}, the pipeline's)"),
        "seed": integer(0, 2**63 - 1, "omitted: random, reported in the answer"),
        "max_sequence_length": integer(1, limits.max_text_tokens, "text tokens per prompt "
                                       "(default: the pipeline's own, 512 as in diffusers)"),
        "loras": nullable(LORAS_SCHEMA),
        **scheduling_fields(nullable),
        "step_cache": nullable(step_cache_field.openapi_schema(limits.step_cache_policies)),
    }
    for name in IGNORED_FIELDS:
        properties[name]["description"] = "OpenAI field, accepted and ignored"
    # 'transparent' is OpenAI's value, refused here: the document lists what is accepted.
    properties["background"] = nullable({"enum": ["auto", "opaque"], "description": "OpenAI "
                                         "field: images are opaque RGB ('transparent' is "
                                         "refused with 400)"})
    properties["output_format"]["description"] = "the images' format (default png)"
    assert set(properties) == set(FIELDS), "the schema and the parser disagree on the fields"
    return {
        "type": "object", "title": "ImageGenerationRequest", "required": ["prompt"],
        "properties": properties, "additionalProperties": False,
    }


def _usage_schema() -> dict[str, Any]:
    def details(*names: str) -> dict[str, Any]:
        return {"type": "object", "required": list(names),
                "properties": {n: {"type": "integer"} for n in names}}

    return {"type": "object", "required": ["input_tokens", "input_tokens_details",
                                           "output_tokens", "total_tokens"],
            "description": "image tokens the DiT denoised (see docs/serving.md)",
            "properties": {"input_tokens": {"type": "integer"},
                           "input_tokens_details": details("text_tokens", "image_tokens"),
                           "output_tokens": {"type": "integer"},
                           "output_tokens_details": details("image_tokens", "text_tokens"),
                           "total_tokens": {"type": "integer"}}}


def stream_event_schemas(events: ImageEvents = GENERATION_EVENTS,
                         prefix: str = "") -> dict[str, Any]:
    """The JSON of each event's ``data:`` line, by ``type`` (the SSE event name); ``events``:
    the route's names (generations' or edits'), ``prefix``: of the schemas' names."""
    string, integer = {"type": "string"}, {"type": "integer"}

    def progress(kind: str, second: str) -> dict[str, Any]:
        """ditserve's progress data: [kind, int, total_steps] (an array: streaming.py)."""
        return {"type": "array", "minItems": 3, "maxItems": 3,
                "description": f"[{kind!r}, {second}, total_steps]",
                "prefixItems": [{"const": kind}, {"type": ["integer", "null"]}, integer]}

    def event(kind: str, required: list[str], **properties: Any) -> dict[str, Any]:
        return {"type": "object", "required": ["type", *required],
                "properties": {"type": {"const": kind}, **properties}}

    image = {"b64_json": string, "background": string, "created_at": integer,
             "output_format": {"enum": list(FIELD_VALUES["output_format"])}, "quality": string,
             "size": string,
             "image_index": integer, "request_id": string}
    image_required = ["b64_json", "created_at", "output_format", "size"]
    return {
        f"{prefix}QueuedEvent": progress("queued",
                                         "queue_position (0: next; null: already running)"),
        f"{prefix}ProgressEvent": progress("step", "denoise steps done"),
        f"{prefix}PartialImageEvent": event(events.partial_image,
                                            [*image_required, "partial_image_index"], **image,
                                            partial_image_index=integer, step=integer),
        f"{prefix}CompletedEvent": event(events.completed, [*image_required, "usage"],
                                         **image, usage=ref("Usage")),
        f"{prefix}ErrorEvent": event(ERROR, ["error"],
                                     error=error_schema()["properties"]["error"]),
    }


def sse_answer(events: ImageEvents = GENERATION_EVENTS,
               prefix: str = "") -> dict[str, Any]:
    """text/event-stream: the schema of one event (Open API 3.1: ``schema`` is per event)."""
    names = [f"{prefix}{n}" for n in ("QueuedEvent", "ProgressEvent", "PartialImageEvent",
                                      "CompletedEvent", "ErrorEvent")]
    kinds = [events.queued, events.progress, events.partial_image, events.completed,
             ERROR]
    return {"text/event-stream": {
        "type": "object", "required": ["event", "data"],
        "properties": {"event": {"enum": kinds},
                       "data": {"type": "string", "contentMediaType": "application/json",
                                "contentSchema": {"oneOf": [ref(n) for n in names]}}}}}


def schemas(limits: RequestLimits) -> dict[str, Any]:
    string, integer = {"type": "string"}, {"type": "integer"}
    return {
        "ImageGenerationRequest": request_schema(limits),
        **stream_event_schemas(),
        "Usage": _usage_schema(),
        "ImagesResponse": {
            "type": "object", "required": ["created", "data", "usage"],
            "properties": {
                "created": integer,
                "data": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["b64_json"],
                    "properties": {"b64_json": {"type": "string", "description":
                                                "the image, as output_format says"}}}},
                "background": {"const": "opaque"},
                "output_format": {"enum": list(FIELD_VALUES["output_format"])},
                "size": string, "usage": ref("Usage"),
                "ditserve": {"type": "object", "description": "seed and timings",
                             "required": ["request_id", "seed", "num_inference_steps"],
                             "properties": {"request_id": string, "seed": integer,
                                            "num_inference_steps": integer,
                                            "queue_seconds": {"type": "number"},
                                            "latency_seconds": {"type": "number"}}}}},
    }
