"""Input images (an edit's source, a video's first frame): file bytes -> ``ConditionImage``.

One decoder for the HTTP upload routes (``server.fields.uploads``) and ``ditserve generate
--image``. An image's header is read before its pixels: a format other than PNG, JPEG or
WebP, a decoded size over ``max_pixels`` (a decompression bomb: a few kilobytes that would
decode to gigabytes) or a truncated file raises ``InvalidRequestError`` naming the field,
before anything large is allocated. EXIF orientation is applied, so a phone photo is the
right way up; transparency is dropped (RGB), as diffusers' image processors drop it.

A mask (``decode_mask``: an edit's ``mask``, ``generate --mask``) is decoded the same way,
into black and white: OpenAI's edits API marks the region to repaint as fully transparent
pixels of a PNG, so a mask with transparency repaints where its alpha is 0; a mask without
transparency is read as diffusers' inpainting pipelines read it, white (>= half grey)
repaints.
"""

from __future__ import annotations

import io
import warnings
from typing import Any

from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.request import ConditionImage

FORMATS = ("PNG", "JPEG", "WEBP")  # what OpenAI's image endpoints take
DEFAULT_MAX_PIXELS = 4096 * 4096


def decode_image(data: bytes, *, field: str = "image",
                 max_pixels: int = DEFAULT_MAX_PIXELS) -> ConditionImage:
    """Bytes of a PNG, JPEG or WebP file -> an upright RGB image (see module docstring)."""
    return _decode(data, field=field, max_pixels=max_pixels, mask=False)


def decode_mask(data: bytes, *, field: str = "mask",
                max_pixels: int = DEFAULT_MAX_PIXELS) -> ConditionImage:
    """Bytes of a mask file -> an upright black-and-white RGB image, white where the model
    repaints (see module docstring)."""
    return _decode(data, field=field, max_pixels=max_pixels, mask=True)


def _decode(data: bytes, *, field: str, max_pixels: int, mask: bool) -> ConditionImage:
    from PIL import Image, ImageOps, UnidentifiedImageError

    if not data:
        raise InvalidRequestError(field, "the file is empty")
    with warnings.catch_warnings():
        # Our pixel limit is checked below, before decoding; PIL's own bomb check (a
        # warning, then an error at twice its default) must not pre-empt that message.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=list(FORMATS))
        except UnidentifiedImageError as e:
            raise InvalidRequestError(field, "not a PNG, JPEG or WebP image") from e
        except Image.DecompressionBombError as e:
            # PIL refuses sizes past twice its own bound while it reads the header: the file
            # is an image, only far too large.
            raise InvalidRequestError(
                field, f"the image has more than {2 * (Image.MAX_IMAGE_PIXELS or 0)} pixels; "
                f"at most {max_pixels} pixels are accepted (decoding it would take too much "
                "memory)") from e
        width, height = image.size
        if width * height > max_pixels:
            raise InvalidRequestError(
                field, f"the image is {width}x{height} pixels; at most {max_pixels} pixels "
                "are accepted (decoding it would take too much memory)")
        try:
            image.load()
            upright = ImageOps.exif_transpose(image) or image
            rgb = _black_and_white(upright) if mask else upright.convert("RGB")
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            raise InvalidRequestError(
                field, f"the image could not be decoded ({e}); send a complete PNG, JPEG or "
                "WebP file") from e
    return ConditionImage(rgb.width, rgb.height, rgb.tobytes())


def _black_and_white(image: Any) -> Any:
    """A mask as RGB, white where to repaint: transparent pixels (alpha 0) if it has
    transparency, else its own grey level, thresholded at half as diffusers binarizes."""
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        alpha = image.convert("RGBA").getchannel("A")
        grey = alpha.point(lambda a: 255 if a == 0 else 0)
    else:
        grey = image.convert("L").point(lambda v: 255 if v >= 128 else 0)
    return grey.convert("RGB")
