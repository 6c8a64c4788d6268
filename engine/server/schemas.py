"""The generation API's request and response bodies, and their mapping to SamplingParams.

``parse_generation_request`` is the one place a raw body becomes a ``SamplingParams``: JSON
syntax (400), field types and unknown fields (pydantic, 422), the OpenAI ``size`` string, then
the engine's model-specific rules (``engine.validate_params``: pixel multiple, prompt length).
Every 422 names the offending field in ``param`` and in the message.
"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Strict, StrictBool, StrictInt, StrictStr
from pydantic import ValidationError as PydanticValidationError

from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.images import png_bytes
from ditserve.engine.request import SamplingParams
from ditserve.engine.server.config import parse_size
from ditserve.engine.server.errors import APIError, invalid

Number = Annotated[float, Strict()]  # strict: 3 and 3.5 are numbers, "3" and true are not


class ImageGenerationRequest(BaseModel):
    """POST /v1/images/generations. OpenAI fields first, then ditserve's extensions."""

    model_config = ConfigDict(extra="forbid")

    prompt: StrictStr
    model: StrictStr | None = None
    n: StrictInt = 1
    size: StrictStr | None = None
    response_format: Literal["b64_json"] = "b64_json"
    user: StrictStr | None = None
    stream: StrictBool = False
    negative_prompt: StrictStr | None = None
    num_inference_steps: StrictInt | None = None
    guidance_scale: Number = 3.5
    true_cfg_scale: Number = 1.0
    seed: StrictInt | None = None


FIELDS = tuple(ImageGenerationRequest.model_fields)


@dataclass(frozen=True)
class ParsedRequest:
    body: ImageGenerationRequest
    params: SamplingParams


def _type_message(kind: str) -> str:
    return {
        "string_type": "must be a string",
        "int_type": "must be an integer",
        "int_from_float": "must be an integer",
        "float_type": "must be a number",
        "bool_type": "must be true or false",
        "missing": "is required",
    }.get(kind, "")


def pydantic_error(error: PydanticValidationError) -> APIError:
    """The first problem of a pydantic validation, as a field-precise 422."""
    first = error.errors(include_url=False)[0]
    loc = [str(part) for part in first.get("loc", ())]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        return invalid(param, f"{param}: unknown field; supported fields: {', '.join(FIELDS)}",
                       code="unknown_field")
    if kind == "missing":
        return invalid(param, f"{param}: is required", code="missing_field")
    if param == "response_format":
        return invalid(param, "response_format: only 'b64_json' is supported (this server "
                              f"does not host image URLs), got {first.get('input')!r}")
    if kind == "model_type":
        return invalid(None, "the request body must be a JSON object", status=400,
                       code="invalid_body")
    message = _type_message(kind) or first.get("msg", "is invalid")
    return invalid(param, f"{param}: {message}, got {first.get('input')!r}")


def decode_json(raw: bytes) -> Any:
    """The body as JSON, or a 400 saying where the syntax breaks."""
    if not raw.strip():
        raise invalid(None, "the request body is empty; send a JSON object", status=400,
                      code="invalid_body")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise invalid(None, f"the request body is not valid JSON: {e}", status=400,
                      code="invalid_json") from e


def parse_generation_request(
    raw: bytes,
    *,
    engine: Any,
    model_name: str,
    default_size: tuple[int, int],
    default_steps: int,
) -> ParsedRequest:
    data = decode_json(raw)
    if not isinstance(data, dict):
        raise invalid(None, "the request body must be a JSON object, got "
                            f"{type(data).__name__}", status=400, code="invalid_body")
    try:
        body = ImageGenerationRequest.model_validate(data)
    except PydanticValidationError as e:
        raise pydantic_error(e) from e
    if body.model is not None and body.model != model_name:
        raise APIError(404, f"model: {body.model!r} does not exist; this server serves "
                            f"{model_name!r} (see GET /v1/models)", param="model",
                       code="model_not_found")
    width, height = default_size
    if body.size is not None:
        parsed = parse_size(body.size)
        if parsed is None:
            raise invalid("size", f"size: must be 'WIDTHxHEIGHT' in pixels, e.g. "
                                  f"'{width}x{height}', got {body.size!r}")
        width, height = parsed
    params = SamplingParams(
        prompt=body.prompt, negative_prompt=body.negative_prompt, height=height, width=width,
        num_inference_steps=(default_steps if body.num_inference_steps is None
                             else body.num_inference_steps),
        guidance_scale=float(body.guidance_scale), true_cfg_scale=float(body.true_cfg_scale),
        seed=body.seed, num_images=body.n,
    )
    try:
        engine.validate_params(params)
    except InvalidRequestError as e:
        raise request_error(e) from e
    return ParsedRequest(body, params)


def request_error(e: InvalidRequestError) -> APIError:
    """An engine validation error as a 422 whose param is the API's field name."""
    if e.field in ("height", "width"):
        return invalid("size", f"size: {e.field} {e.message}")
    return invalid(e.field, f"{e.field}: {e.message}")


# -- responses -------------------------------------------------------------------------------
def png_base64(image: Any) -> str:
    return base64.b64encode(png_bytes(image)).decode("ascii")


def generation_response(result: Any, *, created: int | None = None) -> dict[str, Any]:
    """The OpenAI images response, plus a ``ditserve`` object with seed and timings."""
    return {
        "created": int(created if created is not None else time.time()),
        "data": [{"b64_json": png_base64(image)} for image in result.images],
        "ditserve": {
            "request_id": result.request_id,
            "seed": result.seed,
            "num_inference_steps": result.num_inference_steps,
            "queue_seconds": round(result.queue_seconds, 6),
            "latency_seconds": round(result.latency_seconds, 6),
        },
    }
