"""The OpenAPI document: every route's request body, answers (each 4xx/5xx with the error
schema), headers and media types, so clients and fuzzers (schemathesis, in CI) can rely on it.

Routes declare their answers with ``answers(...)``; ``build_openapi`` adds what depends on
the running replica: the generation body's rules (``request_schema``, from the same
``RequestLimits`` the parser enforces: size pattern, prompt length, step bound, model id),
the ``X-Request-Id`` header on every operation, and Bearer security when an API key is set.
"""

from __future__ import annotations

from typing import Any, Protocol

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from ditserve.engine.request import MAX_DEADLINE_S, MAX_IMAGES, MAX_PARTIAL_IMAGES, MAX_PRIORITY
from ditserve.engine.server import step_cache_field, streaming
from ditserve.engine.server.edge import REQUEST_ID_HEADER
from ditserve.engine.server.schemas import FIELDS, IGNORED_FIELDS, RequestLimits

ERROR_DESCRIPTIONS = {
    400: "Invalid request: malformed JSON, a wrong or unknown field, a value out of range "
         "for this model, or an invalid X-Request-Id; `param` names the field",
    401: "Missing or wrong API key (`Authorization: Bearer <key>`)",
    404: "`model` (or the model id in the path) is not the served model",
    409: "The video has no content (yet): it is queued or in progress, or it failed or was "
         "cancelled",
    413: "The request body is larger than the server's limit",
    416: "The Range asks for bytes past the end of the file (Content-Range says its size)",
    429: "Every batch slot is taken and the queue is full; retry after Retry-After seconds",
    500: "The engine failed this request, or an internal error (details in the server log)",
    503: "Loading, draining or stopped; retry after Retry-After seconds",
    504: "Not finished within the server's request timeout (the request was aborted)",
}
RETRY_HEADERS = {"Retry-After": {"$ref": "#/components/headers/Retry-After"}}


def ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def headers(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The headers every answer carries (X-Request-Id), and ``extra``."""
    return {REQUEST_ID_HEADER: {"$ref": f"#/components/headers/{REQUEST_ID_HEADER}"},
            **(extra or {})}


def answers(ok: dict[str, Any], *errors: int, ok_description: str = "OK",
            descriptions: dict[int, str] | None = None) -> dict[int | str, Any]:
    """A route's ``responses``: 200 with ``ok`` (media type -> schema), then each error
    status with the error body; 400 and 500 are added to every route. ``descriptions``
    replaces the generic text of some statuses."""
    out: dict[int | str, Any] = {200: {"description": ok_description, "headers": headers(),
                                       "content": {t: {"schema": s} for t, s in ok.items()}}}
    for status in sorted({400, 500, *errors}):
        extra = RETRY_HEADERS if status in (429, 503) else None
        text = (descriptions or {}).get(status, ERROR_DESCRIPTIONS[status])
        out[status] = {"description": text, "headers": headers(extra),
                       "content": {"application/json": {"schema": ref("Error")}}}
    return out



def json_answer(name: str) -> dict[str, Any]:
    return {"application/json": ref(name)}


def readiness_answers() -> dict[int | str, Any]:
    """/ready: the readiness body with 200 when ready, and with 503 otherwise."""
    out = answers(json_answer("Readiness"))
    out[503] = {"description": "Not ready: loading, compiling, draining, failed or stopped",
                "headers": headers(), "content": {"application/json": {
                    "schema": ref("Readiness")}}}
    return out


GENERATION_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": ref("ImageGenerationRequest")}}}}


# A character str.strip() keeps. Spelled out: JSON Schema's regex dialect (ECMA-262) and
# Python's disagree on \s (\x1c-\x1f, \x85, \ufeff), and the engine strips with Python.
NOT_ONLY_SPACES = "[^" + "".join(f"\\u{c:04x}" for c in range(0x3001) if chr(c).isspace()) + "]"


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


class Sides(Protocol):
    @property
    def max_side(self) -> int: ...
    @property
    def pixel_multiple(self) -> int: ...


def size_pattern(limits: Sides, *, auto: bool = True) -> str:
    """Exactly the sizes this model accepts: multiples of the pixel multiple up to max_side."""
    sides = "|".join(str(s) for s in range(limits.max_side, 0, -1)
                     if s % limits.pixel_multiple == 0)
    return f"^(?:{'auto|' if auto else ''}(?:{sides})x(?:{sides}))$"


def scheduling_fields(wrap: Any) -> dict[str, Any]:
    """``priority`` and ``deadline_s``, shared by the image and the video body (``wrap``: how
    an optional field is written there)."""
    return {
        "priority": wrap({"type": "integer", "minimum": -MAX_PRIORITY, "maximum": MAX_PRIORITY,
                          "description": "scheduling class, lower is sooner (default 0); "
                                         "honoured under --scheduling-policy priority"}),
        "deadline_s": wrap({"type": "number", "exclusiveMinimum": 0,
                            "maximum": MAX_DEADLINE_S,
                            "description": "seconds from arrival by which the result is "
                                           "wanted: refused at once (429 deadline_unmeetable) "
                                           "or stopped (deadline_exceeded) when the "
                                           "scheduler's estimate cannot make it"}),
    }


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
        "model": nullable({"const": limits.model_name}),
        "n": integer(1, MAX_IMAGES, "images to generate (default 1)"),
        "size": nullable({"type": "string", "pattern": size_pattern(limits),
                           "description": f"WIDTHxHEIGHT, multiples of {limits.pixel_multiple}"
                                          f"; 'auto' or omitted: {width}x{height}"}),
        "response_format": nullable({"const": "b64_json"}),
        "user": nullable(text),
        "stream": nullable({"type": "boolean", "description": "answer with Server-Sent "
                             "Events (progress, partial images, then the images)"}),
        "partial_images": integer(0, MAX_PARTIAL_IMAGES, "previews to stream at evenly spaced "
                                  "steps (with stream)"),
        **{name: nullable(text) for name in IGNORED_FIELDS if name != "output_compression"},
        "output_compression": integer(0, 100, "accepted and ignored (PNG is lossless)"),
        "negative_prompt": nullable(text),
        "num_inference_steps": integer(1, limits.max_steps,
                                       f"denoise steps (default {limits.default_steps})"),
        "guidance_scale": number(f"distilled guidance of Flux-dev (default "
                                 f"{limits.default_guidance:g})"),
        "true_cfg_scale": number("classifier-free guidance with negative_prompt; > 1 needs "
                                 "a non-empty negative_prompt (default 1: off)"),
        "seed": integer(0, 2**63 - 1, "omitted: random, reported in the answer"),
        **scheduling_fields(nullable),
        "step_cache": nullable(step_cache_field.openapi_schema(limits.step_cache_policies)),
    }
    for name in IGNORED_FIELDS:
        properties[name]["description"] = "OpenAI field, accepted and ignored"
    assert set(properties) == set(FIELDS), "the schema and the parser disagree on the fields"
    return {
        "type": "object", "title": "ImageGenerationRequest", "required": ["prompt"],
        "properties": properties, "additionalProperties": False,
        "if": {"required": ["true_cfg_scale"],
               "properties": {"true_cfg_scale": {"type": "number", "exclusiveMinimum": 1}}},
        "then": {"required": ["negative_prompt"],
                 "properties": {"negative_prompt": {"type": "string", "minLength": 1}}},
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


def _stream_event_schemas() -> dict[str, Any]:
    """The JSON of each event's ``data:`` line, by ``type`` (the SSE event name)."""
    string, integer = {"type": "string"}, {"type": "integer"}

    def event(kind: str, required: list[str], **properties: Any) -> dict[str, Any]:
        return {"type": "object", "required": ["type", *required],
                "properties": {"type": {"const": kind}, **properties}}

    image = {"b64_json": string, "background": string, "created_at": integer,
             "output_format": {"const": "png"}, "quality": string, "size": string,
             "image_index": integer, "request_id": string}
    image_required = ["b64_json", "created_at", "output_format", "size"]
    return {
        "QueuedEvent": event(streaming.QUEUED, ["request_id", "queue_position", "total_steps"],
                             request_id=string, queue_position=integer, total_steps=integer),
        "ProgressEvent": event(streaming.PROGRESS, ["request_id", "step", "total_steps"],
                               request_id=string, step=integer, total_steps=integer),
        "PartialImageEvent": event(streaming.PARTIAL_IMAGE,
                                   [*image_required, "partial_image_index"], **image,
                                   partial_image_index=integer, step=integer),
        "CompletedEvent": event(streaming.COMPLETED, [*image_required, "usage"], **image,
                                usage=ref("Usage")),
        "ErrorEvent": event(streaming.ERROR, ["error"],
                            error=_static_error()["properties"]["error"]),
    }


def sse_answer() -> dict[str, Any]:
    """text/event-stream: the schema of one event (Open API 3.1: ``schema`` is per event)."""
    names = ("QueuedEvent", "ProgressEvent", "PartialImageEvent", "CompletedEvent", "ErrorEvent")
    return {"text/event-stream": {
        "type": "object", "required": ["event", "data"],
        "properties": {"event": {"enum": list(streaming.EVENT_TYPES)},
                       "data": {"type": "string", "contentMediaType": "application/json",
                                "contentSchema": {"oneOf": [ref(n) for n in names]}}}}}


def _static_error() -> dict[str, Any]:
    string, nullable_string = {"type": "string"}, {"type": ["string", "null"]}
    return {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": string, "type": string, "param": nullable_string,
                       "code": nullable_string}}}}


def _static_schemas() -> dict[str, Any]:
    string, integer = {"type": "string"}, {"type": "integer"}
    nullable_string = {"type": ["string", "null"]}
    model = {"type": "object", "required": ["id", "object", "created", "owned_by"],
             "properties": {"id": string, "object": {"const": "model"}, "created": integer,
                            "owned_by": string}}
    return {
        "Error": _static_error(),
        **_stream_event_schemas(),
        "Usage": _usage_schema(),
        "ImagesResponse": {
            "type": "object", "required": ["created", "data", "usage"],
            "properties": {
                "created": integer,
                "data": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["b64_json"],
                    "properties": {"b64_json": {"type": "string", "description": "PNG"}}}},
                "background": string, "output_format": {"const": "png"}, "quality": string,
                "size": string, "usage": ref("Usage"),
                "ditserve": {"type": "object", "description": "seed and timings",
                             "required": ["request_id", "seed", "num_inference_steps"],
                             "properties": {"request_id": string, "seed": integer,
                                            "num_inference_steps": integer,
                                            "queue_seconds": {"type": "number"},
                                            "latency_seconds": {"type": "number"}}}}},
        "Model": model,
        "ModelList": {"type": "object", "required": ["object", "data"],
                      "properties": {"object": {"const": "list"},
                                     "data": {"type": "array", "items": ref("Model")}}},
        "Health": {"type": "object", "required": ["status"],
                   "properties": {"status": {"const": "ok"}}},
        "Readiness": {"type": "object", "required": ["ready", "phase", "model"],
                      "properties": {"ready": {"type": "boolean"},
                                     "phase": {"enum": ["loading", "compiling", "ready",
                                                        "draining", "failed", "stopped"]},
                                     "model": string, "compile": nullable_string},
                      "description": "batch, queue and offload details once loaded "
                                     "(docs/serving.md)"},
    }


def build_openapi(app: FastAPI, limits: RequestLimits, *, api_key: bool,
                  video_schemas: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole document for this replica (``app.openapi`` caches it per limits).

    One model per replica: with ``video_schemas`` (``video_openapi.schemas``, a video
    replica) the document holds the video routes (tag ``videos``) and not the image route
    (tag ``images``), else the reverse; the other kind's routes answer 400 and are left out.
    """
    video = video_schemas
    doc = get_openapi(title="ditserve", version="0.1.0", routes=app.routes,
                      description="OpenAI-style image and video generation on a diffusion "
                                  "transformer (one model per replica). Errors are OpenAI's "
                                  "error object; see docs/serving.md.")
    served = "videos" if video is not None else "images"
    other = "images" if video is not None else "videos"
    for path in list(doc.get("paths", {})):
        operations = doc["paths"][path]
        for method in [m for m, op in operations.items() if other in op.get("tags", ())]:
            del operations[method]
        for operation in operations.values():
            if served in operation.get("tags", ()):
                operation.pop("tags")
        if not operations:
            del doc["paths"][path]
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422; never answered
        schemas.pop(name, None)
    schemas.update(_static_schemas())
    if video is not None:
        schemas.update(video)
        for name in ("ImageGenerationRequest", "ImagesResponse", "QueuedEvent",
                     "ProgressEvent", "PartialImageEvent", "CompletedEvent", "ErrorEvent",
                     "Usage"):
            schemas.pop(name, None)
    else:
        schemas["ImageGenerationRequest"] = request_schema(limits)
    components["headers"] = {
        REQUEST_ID_HEADER: {"required": True, "schema": {"type": "string"},
                            "description": "the client's X-Request-Id, or the one the server "
                                           "made; also in the server's log lines"},
        "Retry-After": {"required": True, "schema": {"type": "string", "pattern": "^[0-9]+$"},
                        "description": "seconds to wait before retrying"},
    }
    components["parameters"] = {REQUEST_ID_HEADER: {
        "name": REQUEST_ID_HEADER, "in": "header", "required": False,
        "description": "an id for this request (made by the server when omitted)",
        "schema": {"type": "string", "pattern": "^[!-~]{1,128}$"}}}
    if api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in doc.get("paths", {}).items():
        for operation in operations.values():
            operation["responses"].pop("422", None)
            operation.setdefault("parameters", []).append(
                {"$ref": f"#/components/parameters/{REQUEST_ID_HEADER}"})
            if api_key and path.startswith("/v1/"):
                operation["security"] = [{"bearer": []}]
                operation["responses"]["401"] = {
                    "description": ERROR_DESCRIPTIONS[401],
                    "headers": headers({"WWW-Authenticate": {"schema": {"const": "Bearer"}}}),
                    "content": {"application/json": {"schema": ref("Error")}}}
    return doc
