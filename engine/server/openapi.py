"""The OpenAPI document: every route's request body, answers (each 4xx/5xx with the error
schema), headers and media types, so clients and fuzzers (schemathesis, in CI) can rely on it.

Routes declare their answers with ``answers(...)``; ``build_openapi`` adds what depends on
the running replica: the schemas of the kind of model it serves (``generation.openapi`` or
``videos.openapi``: the bodies' rules from the same limits the parsers enforce, the answers and
events), the ``X-Request-Id`` header on every operation, and Bearer security when an API key
is set.
"""

from __future__ import annotations

from typing import Any, Protocol

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from ditserve.engine.request import (
    MAX_DEADLINE_S,
    MAX_LORA_SCALE,
    MAX_LORAS_PER_REQUEST,
    MAX_PRIORITY,
)
from ditserve.engine.server.edge import REQUEST_ID_HEADER

ERROR_DESCRIPTIONS = {
    400: "Invalid request: malformed JSON, a wrong or unknown field, a value out of range "
         "for this model, or an invalid X-Request-Id; `param` names the field",
    401: "Missing or wrong API key (`Authorization: Bearer <key>`)",
    404: "`model` (or the model id in the path) is not the served model",
    409: "The video has no content (yet): it is queued or in progress, or it failed or was "
         "cancelled",
    408: "The request's own deadline_s passed before it finished (code deadline_exceeded): it "
         "was stopped at a step boundary",
    413: "The request body is larger than the server's limit",
    416: "The Range asks for bytes past the end of the file (Content-Range says its size)",
    429: "Every batch slot is taken and the queue is full (retry after Retry-After seconds), "
         "or deadline_s cannot be met (code deadline_unmeetable: no Retry-After, and "
         "x-should-retry: false)",
    500: "The engine failed this request, or an internal error (details in the server log)",
    503: "Loading, draining or stopped; retry after Retry-After seconds",
    504: "Not finished within the server's request timeout (the request was aborted)",
}
RETRY_HEADERS = {"Retry-After": {"$ref": "#/components/headers/Retry-After"}}
NO_RETRY_HEADERS = {"x-should-retry": {"$ref": "#/components/headers/x-should-retry"}}
# A 429 for a deadline the replica cannot meet carries no Retry-After (errors.NO_RETRY).
MAYBE_RETRY_HEADERS = {"Retry-After": {"$ref": "#/components/headers/Retry-After-Optional"},
                       "x-should-retry": {"$ref": "#/components/headers/x-should-retry"}}


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
        extra = (RETRY_HEADERS if status == 503 else MAYBE_RETRY_HEADERS if status == 429
                 else NO_RETRY_HEADERS if status == 408 else None)
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


LORAS_SCHEMA: dict[str, Any] = {
    "type": "array", "maxItems": MAX_LORAS_PER_REQUEST,
    "description": "LoRA adapters to apply, stacked (their deltas add up): names from GET "
                   "/v1/models; an unknown name is a 404 (adapter_not_found)",
    "items": {"type": "object", "additionalProperties": False, "required": ["name"],
              "properties": {"name": {"type": "string"},
                             "scale": {"type": ["number", "null"], "minimum": -MAX_LORA_SCALE,
                                       "maximum": MAX_LORA_SCALE,
                                       "description": "default 1"}}}}


def error_schema() -> dict[str, Any]:
    string, nullable_string = {"type": "string"}, {"type": ["string", "null"]}
    return {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": string, "type": string, "param": nullable_string,
                       "code": nullable_string}}}}


def _static_schemas() -> dict[str, Any]:
    string, integer = {"type": "string"}, {"type": "integer"}
    nullable_string = {"type": ["string", "null"]}
    nullable_int = {"type": ["integer", "null"]}
    served = {"type": "object", "required": ["output", "loaded", "limits", "defaults",
                                             "adapters"],
              "description": "what the replica makes, the loaded model's limits within the "
                             "server's flags, and the defaults (docs/serving.md)",
              "properties": {"output": {"enum": ["image", "video"]},
                             "images": {"type": "boolean"},
                             "loaded": {"type": "boolean"},
                             "limits": {"type": "object", "properties": {
                                 "pixel_multiple": integer, "max_width": integer,
                                 "max_height": integer, "max_steps": integer,
                                 "max_prompt_chars": nullable_int, "positions": nullable_int,
                                 "frame_step": integer, "min_frames": integer,
                                 "max_frames": integer,
                                 "max_seconds": {"type": "number"}}},
                             "defaults": {"type": "object"},
                             "adapters": {"type": "array", "items": string}}}
    model = {"type": "object", "required": ["id", "object", "created", "owned_by"],
             "properties": {"id": string, "object": {"const": "model"}, "created": integer,
                            "owned_by": string, "ditserve": served}}
    return {
        "Error": error_schema(),
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


def build_openapi(app: FastAPI, *, api_key: bool, kind_schemas: dict[str, Any],
                  video: bool, edits: bool = False, images: bool = True) -> dict[str, Any]:
    """The whole document for this replica (``app.openapi`` caches it per limits).

    One model per replica: a video replica's document (``video``, with
    ``videos.openapi.schemas``) holds the video routes (tag ``videos``) and not the image
    route (tag ``images``); an image replica's (``generation.openapi.schemas``) the reverse. The
    other kind's routes answer 400 and are left out, and so is the edits route (tag
    ``edits``) unless the model edits (``edits``, with ``edits.openapi.schemas``). A video
    replica whose model makes still images (``images``: Cosmos3) holds the image route too;
    an image replica whose model needs an input image (``images`` False: an edit-only model
    such as Qwen-Image-Edit) holds only the edits route.
    """
    doc = get_openapi(title="ditserve", version="0.1.0", routes=app.routes,
                      description="OpenAI-style image and video generation on a diffusion "
                                  "transformer (one model per replica). Errors are OpenAI's "
                                  "error object; see docs/serving.md.")
    served = {"videos"} if video else {"edits"} if edits else set()
    if images:
        served.add("images")
    others = {"images", "videos", "edits"} - served
    for path in list(doc.get("paths", {})):
        operations = doc["paths"][path]
        for method in [m for m, op in operations.items() if others & set(op.get("tags", ()))]:
            del operations[method]
        for operation in operations.values():
            if served & set(operation.get("tags", ())):
                operation.pop("tags")
        if not operations:
            del doc["paths"][path]
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422; never answered
        schemas.pop(name, None)
    schemas.update(_static_schemas())
    schemas.update(kind_schemas)
    components["headers"] = {
        REQUEST_ID_HEADER: {"required": True, "schema": {"type": "string"},
                            "description": "the client's X-Request-Id, or the one the server "
                                           "made; also in the server's log lines"},
        "Retry-After": {"required": True, "schema": {"type": "string", "pattern": "^[0-9]+$"},
                        "description": "seconds to wait before retrying"},
        "Retry-After-Optional": {"required": False,
                                 "schema": {"type": "string", "pattern": "^[0-9]+$"},
                                 "description": "seconds to wait before retrying; absent "
                                                "when a retry cannot help"},
        "x-should-retry": {"required": False, "schema": {"const": "false"},
                           "description": "false: the OpenAI SDKs do not retry this answer "
                                          "(a missed deadline)"},
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
