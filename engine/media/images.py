"""Decoded pixels -> PIL images and PNG bytes (the engine's output formats)."""

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


def png_bytes(image: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
