"""Decoded pixels -> PIL images, and images -> the bytes of an output format (PNG, JPEG, WebP)."""

from __future__ import annotations

import io
from typing import Any


def to_pil_images(pixels: Any) -> list[Any]:
    """(n, 3, H, W) float tensor in [0, 1] -> n RGB PIL images, rounded like diffusers. A
    one-frame video's (n, 1, 3, H, W) is its frames: a video model's still images (Cosmos3's
    text-to-image, its results and previews)."""
    from PIL import Image

    if pixels.dim() == 5 and pixels.shape[1] == 1:
        pixels = pixels[:, 0]  # (n, 1, 3, H, W) -> (n, 3, H, W)
    if pixels.dim() != 4:
        raise ValueError(f"expected image pixels (n, 3, H, W), got {tuple(pixels.shape)}; "
                         "video pixels (n, F, 3, H, W) are written with engine.media.video.write_mp4")
    # (n, 3, H, W) -> (n, H, W, 3) uint8
    array = (pixels.permute(0, 2, 3, 1).numpy() * 255).round().astype("uint8")
    return [Image.fromarray(a) for a in array]


# The formats an answer's images can take (OpenAI's output_format) and PIL's name for each.
IMAGE_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}


def png_bytes(image: Any) -> bytes:
    return image_bytes(image, "png")


def image_bytes(image: Any, output_format: str, compression: int | None = None) -> bytes:
    """``image`` encoded as ``output_format``. PNG is lossless and ignores ``compression``;
    JPEG and WebP take it as their quality (0-100, OpenAI's output_compression: 100, the
    default, keeps the most detail)."""
    buffer = io.BytesIO()
    if output_format == "png":
        image.save(buffer, format="PNG")
    else:
        quality = 100 if compression is None else compression
        image.save(buffer, format=IMAGE_FORMATS[output_format], quality=quality)
    return buffer.getvalue()
