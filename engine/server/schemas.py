"""The generation request body and its mapping to SamplingParams.

``parse_generation_request`` is the one place a raw body becomes a ``SamplingParams``: JSON
syntax (400; numbers of thousands of digits, NaN, deep nesting and bad UTF-8 included), field
types and unknown fields (pydantic), valid Unicode, the served model (404), the OpenAI
``size`` string, the replica's limits (``RequestLimits``), then the engine's model-specific
rules (``engine.validate_params``: pixel multiple, prompt length). Every 400 names the
offending field in ``param`` and in the message. ``image_openapi.request_schema`` describes the same
rules, from the same limits, for the OpenAPI document.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Strict,
    StrictBool,
    StrictInt,
    StrictStr,
)
from pydantic import ValidationError as PydanticValidationError

from ditserve.engine.config.step_cache import POLICIES as STEP_CACHE_POLICIES
from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.loop.client import EngineClient
from ditserve.engine.request import MAX_PARTIAL_IMAGES, MAX_SIDE, MAX_STEPS, SamplingParams
from ditserve.engine.server.adapter_fields import LoraSelection
from ditserve.engine.server.config import parse_size, size_out_of_range
from ditserve.engine.server.errors import APIError, invalid, shown
from ditserve.engine.server.extension_fields import parse_extensions
from ditserve.engine.server.model_defaults import ModelDefaults

Number = Annotated[float, Strict()]  # strict: 3 and 3.5 are numbers, "3" and true are not


def _integral(value: Any) -> Any:
    # JSON (and JSON Schema's "integer") does not tell 4 from 4.0; 4.5 and "4" stay errors.
    return int(value) if isinstance(value, float) and value.is_integer() else value


Integer = Annotated[StrictInt, BeforeValidator(_integral)]

# OpenAI fields that mean nothing to a diffusion model: accepted (type-checked) and ignored.
# The answer says what was done instead (output_format "png", background "opaque").
IGNORED_FIELDS = ("background", "moderation", "output_compression", "output_format",
                  "quality", "style", "safety_identifier")


class ImageGenerationRequest(BaseModel):
    """POST /v1/images/generations. OpenAI fields, the ignored ones, then ditserve's own.
    ``null`` means "the default" for every optional field, as in OpenAI's API."""

    model_config = ConfigDict(extra="forbid")

    prompt: StrictStr
    model: StrictStr | None = None
    n: Integer | None = None
    size: StrictStr | None = None
    response_format: Literal["b64_json"] | None = None
    user: StrictStr | None = None
    stream: StrictBool | None = None
    partial_images: Integer | None = None
    # ignored (IGNORED_FIELDS)
    background: StrictStr | None = None
    moderation: StrictStr | None = None
    output_compression: Integer | None = None
    output_format: StrictStr | None = None
    quality: StrictStr | None = None
    style: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    # ditserve's extensions
    negative_prompt: StrictStr | None = None
    num_inference_steps: Integer | None = None
    guidance_scale: Number | None = None
    true_cfg_scale: Number | None = None
    seed: Integer | None = None
    max_sequence_length: Integer | None = None
    loras: list[LoraSelection] | None = None
    priority: Integer | None = None
    deadline_s: Number | None = None
    step_cache: Any = None  # checked by server.step_cache_field (its messages, not pydantic's)


FIELDS = tuple(ImageGenerationRequest.model_fields)


@dataclass(frozen=True)
class RequestLimits:
    """What a request may ask of this replica (from the server config and the loaded model)."""

    model_name: str
    default_size: tuple[int, int]  # (width, height)
    default_steps: int
    pixel_multiple: int
    max_prompt_chars: int | None
    max_side: int = MAX_SIDE
    max_steps: int = MAX_STEPS
    default_guidance: float = ModelDefaults.guidance  # the model's (server.model_defaults)
    default_true_cfg: float = ModelDefaults.true_cfg  # the model's (server.model_defaults)
    max_text_tokens: int = 512  # the most max_sequence_length may be (the loaded pipeline's)
    step_cache_policies: tuple[str, ...] = STEP_CACHE_POLICIES  # what the model takes


@dataclass(frozen=True)
class ParsedRequest:
    body: ImageGenerationRequest
    params: SamplingParams

    @property
    def stream(self) -> bool:
        return bool(self.body.stream)


_TYPE_MESSAGES = {
    "string_type": "must be a string",
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "bool_type": "must be true or false",
}


def pydantic_error(error: PydanticValidationError, *,
                   fields: tuple[str, ...] = FIELDS) -> APIError:
    """The first problem of a pydantic validation, as a field-precise 400 (``fields``: the
    body's field names, listed for an unknown one)."""
    first = error.errors(include_url=False)[0]
    loc = [str(part) for part in first.get("loc", ())]
    param = loc[0] if loc else None  # a union's member names follow the field: drop them
    kind, value = first.get("type", ""), first.get("input")
    if kind == "extra_forbidden":
        return invalid(param, f"{param}: unknown field; supported fields: {', '.join(fields)}",
                       code="unknown_field")
    if kind == "missing":
        return invalid(param, f"{param}: is required", code="missing_field")
    if param == "response_format":
        return invalid(param, "response_format: only 'b64_json' is supported (this server "
                              f"does not host image URLs), got {shown(value)}")
    if kind == "float_type" and isinstance(value, int) and not isinstance(value, bool):
        return invalid(param, f"{param}: is out of range, got {shown(value)}")
    message = _TYPE_MESSAGES.get(kind) or first.get("msg", "is invalid")
    return invalid(param, f"{param}: {message}, got {shown(value)}")


class _NotJSON(ValueError):
    pass


def _reject_constant(name: str) -> Any:
    raise _NotJSON(f"the request body is not valid JSON: {name} is not a JSON number")


def decode_json(raw: bytes) -> Any:
    """The body as JSON, or a 400 saying what is wrong with it."""
    if not raw.strip():
        raise invalid(None, "the request body is empty; send a JSON object", code="invalid_body")
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise invalid(None, f"the request body is not valid JSON: {e}",
                      code="invalid_json") from e
    except UnicodeDecodeError as e:
        raise invalid(None, "the request body is not valid UTF-8 text",
                      code="invalid_json") from e
    except RecursionError as e:
        raise invalid(None, "the request body nests too deeply", code="invalid_json") from e
    except _NotJSON as e:  # NaN, Infinity: Python's json reads them, JSON has no such numbers
        raise invalid(None, str(e), code="invalid_json") from e
    except ValueError as e:  # an integer of thousands of digits (Python's conversion limit)
        raise invalid(None, "the request body holds a number with too many digits",
                      code="invalid_json") from e


def check_text_fields(body: BaseModel) -> None:
    """A 400 naming the first text field that holds a lone UTF-16 surrogate: JSON's \\ud800
    escapes parse into strings that cannot be encoded, and would fail later, as a 500, in the
    tokenizer or a log line."""
    for name in type(body).model_fields:
        value = getattr(body, name)
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise invalid(name, f"{name}: holds a lone UTF-16 surrogate at character "
                                    f"{e.start}; send valid Unicode text") from e


def _size(body: ImageGenerationRequest, limits: RequestLimits) -> tuple[int, int]:
    if body.size is None or body.size == "auto":
        return limits.default_size
    parsed = parse_size(body.size)
    m = limits.pixel_multiple
    if parsed is None and size_out_of_range(body.size):
        raise invalid("size", f"size: width and height must be between {m} and "
                              f"{limits.max_side}, got {shown(body.size)}")
    if parsed is None:
        width, height = limits.default_size
        raise invalid("size", f"size: must be 'WIDTHxHEIGHT' in pixels or 'auto', e.g. "
                              f"'{width}x{height}', got {shown(body.size)}")
    for name, value in zip(("width", "height"), parsed, strict=True):
        if not m <= value <= limits.max_side:
            raise invalid("size", f"size: {name} must be between {m} and {limits.max_side}, "
                                  f"got {value}")
    return parsed


def _steps(body: ImageGenerationRequest, limits: RequestLimits) -> int:
    steps = body.num_inference_steps
    if steps is None:
        return limits.default_steps
    if not 1 <= steps <= limits.max_steps:
        raise invalid("num_inference_steps", "num_inference_steps: must be an integer in "
                                             f"[1, {limits.max_steps}], got {shown(steps)}")
    return steps


def _check_ranges(body: ImageGenerationRequest) -> None:
    """Ranges of the fields the engine does not see (or sees only with a stream)."""
    for name, top in (("partial_images", MAX_PARTIAL_IMAGES), ("output_compression", 100)):
        value = getattr(body, name)
        if value is not None and not 0 <= value <= top:
            raise invalid(name, f"{name}: must be an integer in [0, {top}], got {shown(value)}")


def parse_generation_request(raw: bytes, *, engine: EngineClient, limits: RequestLimits
                             ) -> ParsedRequest:
    """A judged request (the module docstring's every rule)."""
    parsed = parse_generation_fields(decode_json(raw), engine=engine, limits=limits)
    try:
        engine.validate_params(parsed.params)
    except InvalidRequestError as e:
        raise request_error(e) from e
    return parsed


def parse_generation_fields(data: Any, *, engine: EngineClient, limits: RequestLimits
                            ) -> ParsedRequest:
    """Every rule but the engine's own judgement (``engine.validate_params``): for a request
    whose params are not whole yet (the edits route adds the images, then judges)."""
    if not isinstance(data, dict):
        raise invalid(None, "the request body must be a JSON object, got "
                            f"{type(data).__name__}", code="invalid_body")
    try:
        body = ImageGenerationRequest.model_validate(data)
    except PydanticValidationError as e:
        raise pydantic_error(e) from e
    check_text_fields(body)
    extensions = parse_extensions(body, engine=engine, model_name=limits.model_name)
    _check_ranges(body)
    width, height = _size(body, limits)
    params = SamplingParams(
        prompt=body.prompt, negative_prompt=body.negative_prompt, height=height, width=width,
        num_inference_steps=_steps(body, limits),
        guidance_scale=(limits.default_guidance if body.guidance_scale is None
                        else body.guidance_scale),
        true_cfg_scale=(limits.default_true_cfg if body.true_cfg_scale is None
                        else body.true_cfg_scale),
        max_sequence_length=body.max_sequence_length,
        seed=body.seed, num_images=1 if body.n is None else body.n,
        # Previews are decoded only for a stream that can carry them.
        partial_images=(body.partial_images or 0) if body.stream else 0,
        **extensions.fields(),
    )
    return ParsedRequest(body, params)


def request_error(e: InvalidRequestError) -> APIError:
    """An engine validation error as a 400 whose param is the API's field name."""
    if e.field in ("height", "width"):
        return invalid("size", f"size: {e.field} {e.message}")
    return invalid(e.field, f"{e.field}: {e.message}")
