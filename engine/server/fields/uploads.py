"""Uploaded images (an edit's ``image`` and ``mask``, a video job's ``input_reference``): multipart bodies
read into memory, and each file decoded by ``engine.media.image_input`` (400 naming the field).

Bounded at every step: the body is limited by the edge (``server.max_upload_bytes`` on the
upload routes, 413 past it), multipart parts stay in memory (never spooled to a temporary
file), the number of files and fields is capped, and an image's header is checked before its
pixels are decoded (format, ``server.max_image_pixels``: decompression bombs are a 400).

Called by the edits route and the video route (``input_reference``).
"""

from __future__ import annotations

import asyncio
import base64
import re
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.media.image_input import decode_image, decode_mask
from ditserve.engine.request import ConditionImage
from ditserve.engine.server.errors import invalid

MAX_FORM_FIELDS = 64
_BOUNDARY = re.compile(r'boundary=("[^"]{1,70}"|[^;,\s]{1,70})', re.IGNORECASE)


@dataclass(frozen=True)
class UploadLimits:
    """max_bytes: the whole body (the edge enforces it too); max_pixels: decoded width x
    height of one image; max_files: image files in one request."""

    max_bytes: int
    max_pixels: int
    max_files: int = 16


class _InMemoryParser(MultiPartParser):
    """Starlette's multipart parser with files kept in memory up to the body limit (the
    default spools past 1 MiB to a temporary file on disk)."""

    def __init__(self, headers: Any, stream: Any, *, limits: UploadLimits) -> None:
        super().__init__(headers, stream, max_files=limits.max_files,
                         max_fields=MAX_FORM_FIELDS, max_part_size=1 << 20)
        self.spool_max_size = limits.max_bytes


async def read_multipart(request: Any, limits: UploadLimits) -> FormData:
    """The request's multipart form (400 when it is not one, or is malformed)."""
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise invalid(None, "the request body must be multipart/form-data (send the image as a "
                            f"file part), got {content_type or 'no Content-Type'}",
                      code="invalid_body")
    # The body is bounded by the edge (max_upload_bytes); read whole, it is checked for its
    # closing boundary, and the parser then reads the same bytes (Starlette caches them).
    check_multipart(await request.body(), content_type)
    try:
        return await _InMemoryParser(request.headers, request.stream(), limits=limits).parse()
    except MultiPartException as e:
        raise invalid(None, f"malformed multipart body: {e.message}",
                      code="invalid_multipart") from e


def check_multipart(raw: bytes, content_type: str) -> None:
    """A 400 for a multipart body without its closing delimiter (``--BOUNDARY--``): a body
    cut short would otherwise lose its last field without a word (the parser keeps the
    parts it finished)."""
    match = _BOUNDARY.search(content_type)
    if match is None:
        raise invalid(None, "Content-Type: multipart/form-data needs a boundary parameter",
                      code="invalid_multipart")
    closing = b"--" + match.group(1).strip('"').encode("latin-1") + b"--"
    if not (raw.startswith(closing) or b"\r\n" + closing in raw):
        raise invalid(None, "the multipart body is truncated: it does not end with its "
                            "closing boundary (--BOUNDARY--); send the whole form",
                      code="invalid_multipart")


def is_file(value: Any) -> bool:
    return isinstance(value, UploadFile)


async def read_image(upload: Any, *, field: str, limits: UploadLimits) -> ConditionImage:
    """One uploaded file, checked and decoded (see module docstring)."""
    if not is_file(upload):
        raise invalid(field, f"{field}: must be an image file (a multipart file part), not a "
                             "text field", code="invalid_image")
    return await _decode(await upload.read(), field=field, limits=limits)


async def read_mask(upload: Any, *, limits: UploadLimits) -> ConditionImage:
    """An edit's ``mask`` file, checked and decoded to black and white (white: repaint;
    ``engine.media.image_input.decode_mask``)."""
    field = "mask"
    if not is_file(upload):
        raise invalid(field, f"{field}: must be an image file (a multipart file part), not a "
                             "text field", code="invalid_image")
    return await _decode(await upload.read(), field=field, limits=limits, mask=True)


async def reference_image(value: Any, *, limits: UploadLimits,
                          field: str = "input_reference") -> ConditionImage:
    """A video job's ``input_reference`` (or ditserve's ``last_frame_reference``): an
    uploaded file, or (JSON bodies, OpenAI's ``ImageInputReferenceParam``)
    ``{"image_url": "data:image/...;base64,..."}``."""
    if is_file(value):
        return await read_image(value, field=field, limits=limits)
    if isinstance(value, bytes):  # a file part's content, read by the body reader
        return await _decode(value, field=field, limits=limits)
    url = value.get("image_url") if isinstance(value, dict) else None
    if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
        raise invalid(field, f"{field}: must be an image file (multipart) or "
                             "{\"image_url\": \"data:image/png;base64,...\"}; this server "
                             "fetches no URLs and stores no files (file_id)",
                      code="invalid_image")
    try:
        data = base64.b64decode(url.partition(";base64,")[2], validate=True)
    except ValueError as e:
        raise invalid(field, f"{field}: the data URL is not valid base64",
                      code="invalid_image") from e
    return await _decode(data, field=field, limits=limits)


async def _decode(data: bytes, *, field: str, limits: UploadLimits,
                  mask: bool = False) -> ConditionImage:
    try:
        # Decoding a large image takes tens of milliseconds: off the event loop.
        return await asyncio.to_thread(decode_mask if mask else decode_image, data,
                                       field=field, max_pixels=limits.max_pixels)
    except InvalidRequestError as e:
        raise invalid(field, f"{field}: {e.message}", code="invalid_image") from e
