"""ditserve's ``references`` field of a video job: the media an omni-reference replica
conditions on (MiniMax-H3's ``ref2va``), in the order the model reads them.

Forms it takes, one reference each, in order:

- JSON: ``"references": [...]`` of data URLs (``"data:image/png;base64,..."``,
  ``"data:audio/wav;base64,..."``, ``"data:video/mp4;base64,..."``) or objects
  ``{"image_url": URL}`` / ``{"audio_url": URL}`` / ``{"video_url": URL}`` with a data URL
  (OpenAI's ``ImageInputReferenceParam`` form);
- multipart: file parts named ``references`` or ``references[]`` (repeated), and the text
  fields the OpenAI SDK writes for ``extra_body={"references": [...]}``: ``references[]``
  (a data URL each) and ``references[][image_url]`` / ``[audio_url]`` / ``[video_url]``.

Each is decoded by ``engine.media.reference_input`` (an image, a WAV soundtrack, a video
file with its soundtrack). No URL is fetched and no file stored. A replica that takes no references
refuses the field before anything is decoded; counts beyond the model's are the engine's
400 (``reference_media.check_references``). Called by the video route.
"""

from __future__ import annotations

import asyncio
import base64
import re
from typing import Any

from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.loop.client import EngineClient
from ditserve.engine.media.reference_input import decode_reference
from ditserve.engine.reference_media import FIELD, Reference
from ditserve.engine.server.errors import APIError, invalid
from ditserve.engine.server.fields.uploads import UploadLimits, is_file

MAX_REFERENCES = 16  # decoded at most per request (the model's own bound is lower: 9 + 3)
FORM_NAMES = (FIELD, f"{FIELD}[]")
_KEYS = ("image_url", "audio_url", "video_url")
_FORM_KEY = re.compile(r"^references\[\]\[(image_url|audio_url|video_url)\]$")


def is_reference_field(name: str) -> bool:
    """Whether a form field carries a reference (module docstring's multipart forms)."""
    return name in FORM_NAMES or _FORM_KEY.match(name) is not None


def takes_references(engine: EngineClient) -> bool:
    facts = engine.facts()
    return facts is not None and facts.limits.references is not None


def references_refused() -> APIError:
    return invalid(FIELD, "references: this replica takes no references; MiniMax-H3's "
                          "omni-reference workflow (ref2va) is served by a ref2va replica "
                          "(`ditserve model ref2va CHECKPOINT OUT`, then serve OUT)",
                   code="unsupported_value")


def as_list(value: Any) -> list[Any]:
    """The JSON body's ``references`` as its list (one reference alone is a list of one)."""
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


async def decode_references(values: list[Any], *, limits: UploadLimits
                            ) -> tuple[Reference, ...]:
    """Each value (a file part's bytes, a data URL, an ``{"image_url"|"audio_url"|
    "video_url": URL}`` object) decoded, in order; a 400 naming the reference that cannot be read."""
    if len(values) > MAX_REFERENCES:
        raise invalid(FIELD, f"references: at most {MAX_REFERENCES} per request, got "
                             f"{len(values)}", code="invalid_reference")
    out = []
    for index, value in enumerate(values):
        name = f"references[{index}]"
        data = await _bytes(value, name)
        try:
            out.append(await asyncio.to_thread(decode_reference, data, field=name,
                                               max_pixels=limits.max_pixels))
        except InvalidRequestError as e:
            raise invalid(FIELD, f"{name}: {e.message}", code="invalid_reference") from e
    return tuple(out)


async def _bytes(value: Any, name: str) -> bytes:
    if is_file(value):
        return bytes(await value.read())
    if isinstance(value, bytes):
        return value
    if isinstance(value, dict) and len(value) == 1:
        value = next((value[key] for key in _KEYS if key in value), None)
    if not isinstance(value, str) or not value.startswith("data:") or ";base64," not in value:
        raise invalid(FIELD, f"{name}: must be a file part, a data URL "
                             "(data:image/png;base64,..., data:audio/wav;base64,..., "
                             'data:video/mp4;base64,...) or {"image_url"|"audio_url"|'
                             '"video_url": DATA_URL}; this server fetches no URLs',
                      code="invalid_reference")
    try:
        return base64.b64decode(value.partition(";base64,")[2], validate=True)
    except ValueError as e:
        raise invalid(FIELD, f"{name}: the data URL is not valid base64",
                      code="invalid_reference") from e
