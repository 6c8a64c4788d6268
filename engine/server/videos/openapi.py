"""The OpenAPI parts of the video routes: the create body (JSON and multipart, from the same
``VideoLimits`` the parser enforces), the ``video`` object, the list page, the delete
answer, the MP4 content (200 / 206 with Content-Range / 416) and the job's event stream.

``schemas(limits)`` goes into ``components.schemas`` (``openapi.build_openapi``, on a video
replica); the ``*_answers`` functions are the routes' ``responses``.
"""

from __future__ import annotations

from typing import Any

from ditserve.engine.server.config import MAX_FPS
from ditserve.engine.server.fields import step_cache as step_cache_field
from ditserve.engine.server.fields.adapters import FORM_LORAS_PATTERN
from ditserve.engine.server.jobs.model import API_STATUSES
from ditserve.engine.server.limits import VideoLimits
from ditserve.engine.server.openapi import (
    LORAS_SCHEMA,
    NOT_ONLY_SPACES,
    answers,
    headers,
    json_answer,
    nullable,
    ref,
    scheduling_fields,
    size_pattern,
)
from ditserve.engine.server.videos.request import FIELDS

STATUSES = list(API_STATUSES)
EVENT_TYPES = [f"video.{status}" for status in STATUSES]
STORE_DOWN = {503: "The job store cannot be reached (code job_store_unavailable); retry "
                   "after Retry-After seconds"}
NOT_FOUND = {404: "No video with this id (never made, deleted or expired)", **STORE_DOWN}


CREATE_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": ref("VideoCreateRequest")},
    "multipart/form-data": {"schema": ref("VideoCreateForm")}}}}


def _properties(limits: VideoLimits, *, form: bool) -> dict[str, Any]:
    """Each field's schema, null not included (the JSON body adds it, a form has none)."""
    text = {"type": "string"}
    prompt: dict[str, Any] = {"type": "string", "minLength": 1, "pattern": NOT_ONLY_SPACES,
                              "description": "what to film (not only spaces)"}
    if limits.max_prompt_chars is not None:
        prompt["maxLength"] = limits.max_prompt_chars
    width, height = limits.default_size

    def integer(low: int, high: int, description: str) -> dict[str, Any]:
        return {"type": "integer", "minimum": low, "maximum": high, "description": description}

    # OpenAI's string form: whole seconds (none when even 1 s exceeds max_frames).
    whole = limits.second_strings
    seconds_text: dict[str, Any] = {"type": "string", "enum": whole} if whole else {"not": {}}
    seconds: dict[str, Any] = seconds_text if form else {"anyOf": [
        {"type": "number", "exclusiveMinimum": limits.min_seconds,
         "maximum": limits.max_seconds},
        seconds_text]}
    seconds["description"] = (f"duration: frames at the model's native {limits.default_fps} "
                              "fps (the smallest valid count that lasts this long); not with "
                              "num_frames or fps" + ("; in a form, whole seconds" if form
                                                     else ""))
    return {
        "prompt": prompt,
        "model": {"const": limits.model_name},
        "size": {"type": "string", "pattern": size_pattern(limits, auto=False),
                 "description": f"WIDTHxHEIGHT, multiples of {limits.pixel_multiple} up to "
                                f"{limits.max_side} (the model's and the server's bound; "
                                f"default {width}x{height})"},
        "seconds": seconds,
        "num_frames": {"type": "integer", "enum": limits.allowed_frames,
                       "description": f"{limits.frame_step}k+1 frames from "
                                      f"{limits.min_frames} to {limits.max_frames} (default "
                                      f"{limits.default_frames})"},
        "fps": integer(1, MAX_FPS, f"MP4 frame rate (default {limits.default_fps})"),
        "num_inference_steps": integer(1, limits.max_steps,
                                       f"denoise steps (default {limits.default_steps})"),
        "guidance_scale": {"type": "number", "minimum": 0, "maximum": 100,
                           "description": "classifier-free guidance when > 1, against "
                                          f"negative_prompt (default {limits.default_guidance})"},
        "negative_prompt": text,
        "seed": integer(0, 2**63 - 1, "omitted: random, reported in the job"),
        "max_sequence_length": integer(1, limits.max_text_tokens, "text tokens per prompt "
                                       "(default: the pipeline's own, 512 as in diffusers)"),
        # In a form the list travels as JSON text.
        "loras": {"type": "string", "pattern": FORM_LORAS_PATTERN,
                  "description": "LoRA adapters, stacked: name[:scale],... (scale default 1; "
                                 "names from GET /v1/models, an unknown one is a 404), or the "
                                 'JSON list as text: [{"name": ..., "scale": ...}]'}
        if form else LORAS_SCHEMA,
        **scheduling_fields(lambda schema: schema),
        "audio": ({"type": "string", "enum": ["true", "false"] if limits.audio else ["false"]}
                  if form else {"type": "boolean", **({} if limits.audio else {"enum": [False]})}
                  ) | {"description": "generate the model's sound track too, muxed into the "
                                      "MP4 (AAC); only a model that makes one (Cosmos3 with a "
                                      "sound tokenizer)"},
        "references": _references_schema(limits, form=form),
        "step_cache": ({**step_cache_field.form_schema(limits.step_cache_policies),
                        "description": step_cache_field.DESCRIPTION}
                       if form else step_cache_field.openapi_schema(limits.step_cache_policies)),
    }


def _references_schema(limits: VideoLimits, *, form: bool) -> dict[str, Any]:
    """ditserve's ``references`` (``fields.references``): only on an omni-reference replica."""
    taken = limits.references
    if taken is None:
        return {"not": {}, "description": "references: only a ref2va replica takes them"}
    most = taken.total or taken.images + taken.audios + taken.videos
    audio = (f"WAV soundtracks at {taken.audio_rate} Hz (up to {taken.audios}, with an "
             "image or a video)" if taken.audio_rate is not None else "no audio")
    videos = (f"video files (MP4, WebM, MOV; up to {taken.videos}, each with its soundtrack "
              "at the same rate, if any)" if taken.videos else "no video files")
    description = (f"the media the video is conditioned on, in the order the model reads "
                   f"them: images (PNG, JPEG, WebP; up to {taken.images}), {videos} and "
                   f"{audio}")
    if form:
        return {"type": "array", "maxItems": most, "description": description + " (file "
                "parts named references or references[], or references[] data URLs)",
                "items": {"type": "string", "format": "binary"}}
    url = {"type": "string", "pattern": "^data:[^,;]*;base64,"}
    return {"type": "array", "minItems": 1, "maxItems": most, "description": description,
            "items": {"anyOf": [
                url,
                {"type": "object", "required": ["image_url"], "additionalProperties": False,
                 "properties": {"image_url": url}},
                {"type": "object", "required": ["audio_url"], "additionalProperties": False,
                 "properties": {"audio_url": url}},
                {"type": "object", "required": ["video_url"], "additionalProperties": False,
                 "properties": {"video_url": url}}]}}


def request_schema(limits: VideoLimits, *, form: bool) -> dict[str, Any]:
    """The create body under ``limits``: JSON (optional fields may be null) or a form."""
    properties = _properties(limits, form=form)
    assert set(properties) == set(FIELDS), "the schema and the parser disagree on the fields"
    if not form:
        properties = {name: schema if name == "prompt" else nullable(schema)
                      for name, schema in properties.items()}
    seconds_given: dict[str, Any] = {"required": ["seconds"]}
    if not form:
        seconds_given["properties"] = {"seconds": {"not": {"type": "null"}}}
    absent: dict[str, Any] = {"not": {}} if form else {"type": "null"}
    return {
        "type": "object", "title": "VideoCreateForm" if form else "VideoCreateRequest",
        "required": ["prompt"], "properties": properties, "additionalProperties": False,
        # seconds picks the frame count at the native rate: num_frames and fps go together.
        "if": seconds_given,
        "then": {"properties": {"num_frames": absent, "fps": absent}},
    }


def schemas(limits: VideoLimits) -> dict[str, Any]:
    string, integer = {"type": "string"}, {"type": "integer"}
    nullable_int = {"type": ["integer", "null"]}
    video = {
        "type": "object",
        "required": ["id", "object", "model", "status", "progress", "created_at",
                     "completed_at", "expires_at", "error", "seconds", "size"],
        "properties": {
            "id": {"type": "string", "pattern": "^video_[0-9a-f]{32}$"},
            "object": {"const": "video"}, "model": string,
            "status": {"enum": STATUSES},
            "progress": {"type": "integer", "minimum": 0, "maximum": 100},
            "created_at": integer, "completed_at": nullable_int, "expires_at": nullable_int,
            "error": {"anyOf": [{"type": "null"}, {
                "type": "object", "required": ["code", "message"],
                "properties": {"code": string, "message": string}}]},
            "prompt": {"type": ["string", "null"]},
            "remixed_from_video_id": {"type": "null"},
            "seconds": string, "size": string,
            "ditserve": {"type": "object", "description": "frames, fps, steps, seed, timings "
                                                          "and the MP4's bytes"},
        },
    }
    event = {"type": "object", "required": ["type", "video"],
             "properties": {"type": {"enum": EVENT_TYPES}, "video": ref("Video")}}
    return {
        "VideoCreateRequest": request_schema(limits, form=False),
        "VideoCreateForm": request_schema(limits, form=True),
        "Video": video,
        "VideoList": {"type": "object",
                      "required": ["object", "data", "first_id", "last_id", "has_more"],
                      "properties": {"object": {"const": "list"},
                                     "data": {"type": "array", "items": ref("Video")},
                                     "first_id": {"type": ["string", "null"]},
                                     "last_id": {"type": ["string", "null"]},
                                     "has_more": {"type": "boolean"}}},
        "VideoDeleted": {"type": "object", "required": ["id", "object", "deleted"],
                         "properties": {"id": string, "object": {"const": "video.deleted"},
                                        "deleted": {"const": True}}},
        "VideoEvent": event,
    }


def create_answers() -> dict[int | str, Any]:
    return answers(json_answer("Video"), 404, 413, 429, 503,
                   ok_description="The job, queued (poll it, or follow its events)",
                   descriptions={404: "`model` is not the served model",
                                 503: "Loading or draining, or the job store cannot be reached "
                                      "(job_store_unavailable); retry after Retry-After "
                                      "seconds"})


def video_answers(name: str = "Video", *errors: int) -> dict[int | str, Any]:
    return answers(json_answer(name), 404, 503, *errors, descriptions=NOT_FOUND)


def list_answers() -> dict[int | str, Any]:
    return answers(json_answer("VideoList"), 503, ok_description="A page of jobs",
                   descriptions=STORE_DOWN)


def content_answers() -> dict[int | str, Any]:
    mp4 = {"video/mp4": {"schema": {"type": "string", "format": "binary"}}}
    out = answers({}, 404, 409, 416, 503, descriptions=NOT_FOUND,
                  ok_description="The whole MP4 (H.264). Accept-Ranges: bytes")
    out[200]["content"] = mp4
    out[200]["headers"] = headers({"Accept-Ranges": {"schema": {"const": "bytes"}},
                                   "Content-Length": {"schema": {"type": "string"}}})
    out[206] = {"description": "The bytes one Range asked for",
                "headers": headers({"Content-Range": {"required": True, "schema": {
                    "type": "string", "pattern": "^bytes [0-9]+-[0-9]+/[0-9]+$"}}}),
                "content": mp4}
    out[416]["headers"] = headers({"Content-Range": {"required": True, "schema": {
        "type": "string", "pattern": "^bytes \\*/[0-9]+$"}}})
    return out


def events_answers() -> dict[int | str, Any]:
    out = answers({}, 404, 503, descriptions=NOT_FOUND,
                  ok_description="Server-Sent Events: the job's object after every change "
                                 "(event video.<status>), ending with its final status")
    out[200]["content"] = {"text/event-stream": {"schema": {
        "type": "object", "required": ["event", "data"],
        "properties": {"event": {"enum": EVENT_TYPES},
                       "data": {"type": "string", "contentMediaType": "application/json",
                                "contentSchema": ref("VideoEvent")}}}}}
    return out
