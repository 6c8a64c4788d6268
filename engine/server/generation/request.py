"""The image generation body and its mapping to SamplingParams, shared by the generations
route (a JSON body) and the edits route (a form's text fields, typed as JSON).

``parse_generation_request`` is the one place a raw body becomes a ``SamplingParams``: JSON
syntax (400; numbers of thousands of digits, NaN, deep nesting and bad UTF-8 included:
``fields.body``), field types and unknown fields (pydantic), valid Unicode, the extension
fields (``fields.extensions``: adapters, 404 for another model; priority, deadline, step
cache), the OpenAI ``size`` string, the replica's limits (``limits.RequestLimits``), then the
engine's model-specific rules (``engine.validate_params``: pixel multiple, prompt length).
Every 400 names the offending field in ``param`` and in the message.
``generation.openapi.request_schema`` describes the same rules, from the same limits, for the
OpenAPI document.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr
from pydantic import ValidationError as PydanticValidationError

from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.loop.client import EngineClient
from ditserve.engine.request import MAX_PARTIAL_IMAGES, SamplingParams
from ditserve.engine.server.config import parse_size, size_out_of_range
from ditserve.engine.server.errors import invalid, shown
from ditserve.engine.server.fields.adapters import LoraSelection
from ditserve.engine.server.fields.body import (
    Integer,
    Number,
    check_text_fields,
    decode_json,
    pydantic_error,
    request_error,
)
from ditserve.engine.server.fields.extensions import parse_extensions
from ditserve.engine.server.generation.responses import ImageEncoding
from ditserve.engine.server.limits import RequestLimits

# OpenAI fields that mean nothing to a diffusion model: accepted (checked against OpenAI's
# values) and ignored. The answer says what was done instead (background "opaque");
# background "transparent" is refused (the DiT draws opaque RGB), not silently dropped.
IGNORED_FIELDS = ("background", "moderation", "quality", "style", "safety_identifier")
# OpenAI's values of its enumerated fields (output_format is honoured: responses.ImageEncoding).
OutputFormat = Literal["png", "jpeg", "webp"]
Background = Literal["auto", "opaque", "transparent"]
Moderation = Literal["auto", "low"]
Quality = Literal["auto", "low", "medium", "high", "standard", "hd"]
Style = Literal["vivid", "natural"]
FIELD_VALUES: dict[str, tuple[str, ...]] = {
    "background": get_args(Background), "moderation": get_args(Moderation),
    "quality": get_args(Quality), "style": get_args(Style),
    "output_format": get_args(OutputFormat)}


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
    output_format: OutputFormat | None = None
    output_compression: Integer | None = None  # JPEG's and WebP's quality
    # ignored (IGNORED_FIELDS)
    background: Background | None = None
    moderation: Moderation | None = None
    quality: Quality | None = None
    style: Style | None = None
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
    step_cache: Any = None  # checked by fields.step_cache (its messages, not pydantic's)


FIELDS = tuple(ImageGenerationRequest.model_fields)


@dataclass(frozen=True)
class ParsedRequest:
    body: ImageGenerationRequest
    params: SamplingParams

    @property
    def stream(self) -> bool:
        return bool(self.body.stream)

    @property
    def encoding(self) -> ImageEncoding:
        return ImageEncoding(self.body.output_format or "png", self.body.output_compression)


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
    if body.background == "transparent":
        raise invalid("background", "background: 'transparent' is not available: the model "
                                    "draws opaque RGB images; omit it or pass 'opaque' or "
                                    "'auto'", code="unsupported_value")


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
        raise pydantic_error(e, fields=FIELDS) from e
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
