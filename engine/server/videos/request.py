"""The ``POST /v1/videos`` body and its mapping to a ``VideoSpec`` (SamplingParams + fps).

OpenAI's Videos API sends ``multipart/form-data`` (its SDK does); JSON is accepted too (as
SGLang and vLLM-Omni do). Both go through one model: form values are text, so the form's
numbers are read first (``"8"`` -> 8), then the same strict pydantic types as JSON apply.

Fields: OpenAI's ``prompt``, ``model``, ``size`` ("WIDTHxHEIGHT"), ``seconds`` (a number, or
OpenAI's whole-second string such as ``"4"``); ditserve's ``num_frames``, ``fps``,
``num_inference_steps``, ``guidance_scale``, ``negative_prompt``, ``seed``. The frame count
comes from ``num_frames`` (``frame_step * k + 1``, Wan: 4k+1) or from ``seconds`` at the
model's native frame rate (Wan: 16 fps; 5 s -> 81 frames, the smallest valid count that
lasts that long): give ``fps`` with ``num_frames``, never with ``seconds``. ``input_reference``
(image-to-video: the first frame) is decoded by the route (``fields.uploads``) and taken by
an image-to-video model (Wan 2.1 I2V, Wan 2.2 TI2V); a text-to-video model refuses it.
ditserve's ``last_frame_reference`` (the same forms) is the video's last frame, for a model
whose limits take one (``ModelLimits.last_frame``: MiniMax-H3's keyframes). ditserve's
``references`` (``fields.references``: images and WAV soundtracks, in order) are the media of
an omni-reference replica (``ModelLimits.references``: MiniMax-H3's ``ref2va``).

``limits.VideoLimits`` holds the replica's bounds; ``videos.openapi.request_schema`` describes
the same rules from the same limits, so a body valid by the document is accepted.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr
from pydantic import ValidationError as PydanticValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.formparsers import MultiPartException

from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.loop.client import EngineClient
from ditserve.engine.reference_media import Reference
from ditserve.engine.request import ConditionImage, SamplingParams
from ditserve.engine.server.config import MAX_FPS
from ditserve.engine.server.errors import APIError, invalid, shown
from ditserve.engine.server.fields.adapters import LoraSelection
from ditserve.engine.server.fields.body import (
    Integer,
    Number,
    check_text_fields,
    decode_json,
    pydantic_error,
    request_error,
    typed_fields,
)
from ditserve.engine.server.fields.extensions import form_value, parse_extensions
from ditserve.engine.server.fields.forms import fold_nested, once
from ditserve.engine.server.fields.references import FIELD as REFERENCES
from ditserve.engine.server.fields.references import MAX_REFERENCES, is_reference_field
from ditserve.engine.server.fields.uploads import check_multipart
from ditserve.engine.server.jobs.model import VideoSpec
from ditserve.engine.server.limits import VideoLimits

FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")
# The image files of a body: the first frame (OpenAI's), the last frame (ditserve's).
REFERENCE_FIELDS = ("input_reference", "last_frame_reference")


class VideoCreateRequest(BaseModel):
    """POST /v1/videos; ``null`` means the default for every optional field."""

    model_config = ConfigDict(extra="forbid")

    prompt: StrictStr
    model: StrictStr | None = None
    size: StrictStr | None = None
    seconds: StrictStr | Number | None = None
    num_frames: Integer | None = None
    fps: Integer | None = None
    num_inference_steps: Integer | None = None
    guidance_scale: Number | None = None
    negative_prompt: StrictStr | None = None
    seed: Integer | None = None
    max_sequence_length: Integer | None = None
    loras: list[LoraSelection] | None = None
    priority: Integer | None = None
    deadline_s: Number | None = None
    step_cache: Any = None  # checked by fields.step_cache (its messages, not pydantic's)
    audio: StrictBool | None = None  # a sound track too (models that make one: Cosmos3)
    references: Any = None  # taken out and decoded by the route (fields.references)


FIELDS = tuple(VideoCreateRequest.model_fields)
# The form's number fields, as the body declares them; ``seconds`` stays text (OpenAI's form
# sends whole seconds as a string, "4").
_INTEGER_FIELDS = typed_fields(VideoCreateRequest, Integer)
_NUMBER_FIELDS = tuple(name for name in typed_fields(VideoCreateRequest, Number)
                       if name != "seconds")


async def read_body(request: Any) -> dict[str, Any]:
    """The body as a dict: a form (multipart or urlencoded) or JSON; 400 when it is neither."""
    content_type = request.headers.get("content-type", "").lower()
    if not content_type.startswith(FORM_TYPES):
        data = decode_json(await request.body())
        if not isinstance(data, dict):
            raise invalid(None, "the request body must be a JSON object or a form, got "
                                f"{type(data).__name__}", code="invalid_body")
        return data
    if content_type.startswith("multipart/form-data"):
        check_multipart(await request.body(), request.headers.get("content-type", ""))
    try:
        form = await request.form(max_files=len(REFERENCE_FIELDS) + MAX_REFERENCES,
                                  max_fields=64)
    except (MultiPartException, StarletteHTTPException) as e:
        message = getattr(e, "message", None) or getattr(e, "detail", None) or str(e)
        raise invalid(None, f"the form cannot be read: {message}",
                      code="invalid_multipart") from e
    out: dict[str, Any] = {}
    try:
        items = form.multi_items()
        # The references in their order (file parts and the SDK's references[] text).
        references = [value for name, value in items if is_reference_field(name)]
        plain, out = fold_nested([(n, v) for n, v in items if not is_reference_field(n)])
        if references:
            out[REFERENCES] = [await value.read() if hasattr(value, "read") else value
                               for value in references]
        for name in dict.fromkeys(name for name, _ in plain):
            value = once(form, name)
            if name in REFERENCE_FIELDS:
                # The file's bytes, read before the form (and its file) is closed below.
                out[name] = await value.read() if hasattr(value, "read") else value
                continue
            out[name] = form_value(name, value, integers=_INTEGER_FIELDS,
                                   numbers=_NUMBER_FIELDS, booleans=("audio",))
    finally:
        await form.close()
    return out


def _size(body: VideoCreateRequest, limits: VideoLimits) -> tuple[int, int]:
    from ditserve.engine.server.config import parse_size, size_out_of_range

    if body.size is None:
        return limits.default_size
    parsed = parse_size(body.size)
    width, height = limits.default_size
    m = limits.pixel_multiple
    if parsed is None and size_out_of_range(body.size):
        raise invalid("size", f"size: width and height must be multiples of {m} between {m} "
                              f"and {limits.max_side}, got {shown(body.size)}")
    if parsed is None:
        raise invalid("size", f"size: must be 'WIDTHxHEIGHT' in pixels, e.g. "
                              f"'{width}x{height}', got {shown(body.size)}")
    for name, value in zip(("width", "height"), parsed, strict=True):
        if not m <= value <= limits.max_side or value % m:
            raise invalid("size", f"size: {name} must be a multiple of {m} between {m} and "
                                  f"{limits.max_side}, got {value}")
    return parsed


def _frames_and_fps(body: VideoCreateRequest, limits: VideoLimits) -> tuple[int, int]:
    if body.seconds is not None:
        if body.num_frames is not None or body.fps is not None:
            name = "num_frames" if body.num_frames is not None else "fps"
            raise invalid(name, f"{name}: give seconds alone, or num_frames (with fps); "
                                "seconds counts frames at the model's native "
                                f"{limits.default_fps} fps")
        return limits.frames_for(_seconds(body.seconds, limits)), limits.default_fps
    fps = limits.default_fps if body.fps is None else body.fps
    if not 1 <= fps <= MAX_FPS:
        raise invalid("fps", f"fps: must be an integer in [1, {MAX_FPS}], got {shown(fps)}")
    frames = limits.default_frames if body.num_frames is None else body.num_frames
    if frames not in range(limits.min_frames, limits.max_frames + 1) \
            or (frames - 1) % limits.frame_step:
        form = "an integer" if limits.frame_step == 1 else f"{limits.frame_step}k+1"
        raise invalid("num_frames", f"num_frames: must be {form} between "
                                    f"{limits.min_frames} and {limits.max_frames} for this "
                                    f"model, got {shown(frames)}")
    return frames, fps


def _seconds(value: str | float, limits: VideoLimits) -> float:
    top, low = limits.max_seconds, limits.min_seconds
    if isinstance(value, str):
        whole = limits.second_strings
        if value not in whole:
            span = f"from {whole[0]} to {whole[-1]}" if whole else "none"
            raise invalid("seconds", f"seconds: as a string, must be whole seconds {span} for "
                                     "this replica (a fractional duration: num_frames, or a "
                                     f"number in a JSON body), got {shown(value)}")
        return float(value)
    # A model with a shortest clip (MiniMax-H3: 5 s) refuses here what its encode would fail.
    if not 0 < value <= top or limits.frames_for(value) < limits.min_frames:
        shortest = f"at least {low:g}" if limits.min_frames > 1 else "> 0"
        raise invalid("seconds", f"seconds: must be {shortest} and at most {top:g} "
                                 f"(num_frames {limits.min_frames} to {limits.max_frames} at "
                                 f"{limits.default_fps} fps), got {shown(value)}")
    return float(value)


def takes_reference(engine: EngineClient) -> bool:
    """Whether the served model animates an ``input_reference`` (image-to-video)."""
    facts = engine.facts()
    return facts is not None and facts.limits.condition_images[1] > 0


def reference_refused(name: str = "input_reference") -> APIError:
    """A reference image sent to a text-only model; ``name``: the field the client sent."""
    return invalid(name, f"{name}: image-to-video is not supported; this server generates "
                         "video from text only", code="unsupported_value")


def parse_video_request(data: dict[str, Any], *, engine: EngineClient, limits: VideoLimits,
                        images: tuple[ConditionImage, ...] = (),
                        last_frame: bool = False,
                        references: tuple[Reference, ...] = ()) -> VideoSpec:
    """A validated VideoSpec, or an APIError (400, or 404 for another model). ``images``:
    the decoded ``input_reference`` then ``last_frame_reference`` (``fields.uploads``),
    taken out of ``data``; ``last_frame``: the last of them is the last frame;
    ``references``: the decoded ``references`` (``fields.references``), taken out too."""
    sent = [name for name in REFERENCE_FIELDS if name in data]
    if sent:
        raise reference_refused(sent[0])
    if images and not takes_reference(engine):
        raise reference_refused(REFERENCE_FIELDS[last_frame and len(images) == 1])
    seconds = data.get("seconds")
    if seconds is not None and (isinstance(seconds, bool)
                                or not isinstance(seconds, (str, int, float))):
        raise invalid("seconds", "seconds: must be a number or a whole-second string such as "
                                 f"'4', got {shown(seconds)}")
    try:
        body = VideoCreateRequest.model_validate(data)
    except PydanticValidationError as e:
        raise pydantic_error(e, fields=FIELDS) from e
    check_text_fields(body)
    extensions = parse_extensions(body, engine=engine, model_name=limits.model_name)
    width, height = _size(body, limits)
    frames, fps = _frames_and_fps(body, limits)
    if body.audio and fps != limits.default_fps:
        # The sound track lasts the frames at the model's own rate: played at another, the
        # picture would outlast (or undercut) its sound.
        raise invalid("fps", f"fps: a video with its sound track (audio) plays at the model's "
                             f"{limits.default_fps} fps, which the sound is made for; leave fps "
                             f"out, got {fps}")
    steps = limits.default_steps if body.num_inference_steps is None \
        else body.num_inference_steps
    if not 1 <= steps <= limits.max_steps:
        raise invalid("num_inference_steps", "num_inference_steps: must be an integer in "
                                             f"[1, {limits.max_steps}], got {shown(steps)}")
    params = SamplingParams(
        prompt=body.prompt, negative_prompt=body.negative_prompt, height=height, width=width,
        num_inference_steps=steps, num_frames=frames, seed=body.seed,
        guidance_scale=limits.default_guidance if body.guidance_scale is None
        else body.guidance_scale, images=images, last_frame=last_frame,
        references=references,
        max_sequence_length=body.max_sequence_length, audio=bool(body.audio),
        **extensions.fields(),
    )
    try:
        # With the model's own rounding applied (MiniMax-H3's frame count): the job reports
        # the clip its video will have.
        params = engine.validate_params(params)
    except InvalidRequestError as e:
        if e.field in ("image", "last_frame"):
            name = REFERENCE_FIELDS[e.field == "last_frame"]
            raise invalid(name, f"{name}: {e.message}") from e
        raise request_error(e) from e
    return VideoSpec(params=params, fps=fps, model=limits.model_name)
