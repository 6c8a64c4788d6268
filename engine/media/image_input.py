"""Input images (an edit's source, a video's first frame): file bytes -> ``ConditionImage``.

One decoder for the HTTP upload routes (``server.uploads``) and ``ditserve generate
--image``. An image's header is read before its pixels: a format other than PNG, JPEG or
WebP, a decoded size over ``max_pixels`` (a decompression bomb: a few kilobytes that would
decode to gigabytes) or a truncated file raises ``InvalidRequestError`` naming the field,
before anything large is allocated. EXIF orientation is applied, so a phone photo is the
right way up; transparency is dropped (RGB), as diffusers' image processors drop it.
"""

from __future__ import annotations

import io
import warnings

from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.request import ConditionImage

FORMATS = ("PNG", "JPEG", "WEBP")  # what OpenAI's image endpoints take
DEFAULT_MAX_PIXELS = 4096 * 4096


def decode_image(data: bytes, *, field: str = "image",
                 max_pixels: int = DEFAULT_MAX_PIXELS) -> ConditionImage:
    """Bytes of a PNG, JPEG or WebP file -> an upright RGB image (see module docstring)."""
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
            rgb = upright.convert("RGB")
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            raise InvalidRequestError(
                field, f"the image could not be decoded ({e}); send a complete PNG, JPEG or "
                "WebP file") from e
    return ConditionImage(rgb.width, rgb.height, rgb.tobytes())
