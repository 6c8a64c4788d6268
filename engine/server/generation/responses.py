"""The generation API's answers: OpenAI's images response, its ``usage``, and the payloads of
the image stream events (``image_generation.partial_image`` / ``.completed``). Each validates
against the OpenAI SDK's own model (``ImagesResponse``, ``ImageGenPartialImageEvent``,
``ImageGenCompletedEvent``); ditserve's additions are extra fields those models keep.

``usage`` counts image tokens, the unit of a DiT's work: ``output_tokens`` is the number of
latent tokens the DiT denoised, ``(height / pixel_multiple) * (width / pixel_multiple)`` per
image (Flux: 16x16-pixel patches, 4096 tokens at 1024x1024), times ``n``. The prompt is not
tokenized at the API, so ``input_tokens`` (text and image) are reported as 0. A streamed
request reports each image's own usage in its completed event (their sum is the request's).

Images are encoded as the request's ``output_format`` asked (PNG by default; JPEG and WebP at
its ``output_compression``), and every answer and event says which. Encoding takes tens of
milliseconds at 1024x1024: callers run these in a worker thread.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from typing import Any

from ditserve.engine.media.images import image_bytes, to_pil_images

BACKGROUND = "opaque"  # RGB images; background "transparent" is refused at the request
# quality is ignored: the step count is what trades quality for time. The stream events say
# "auto"; the plain answer leaves it out (the SDK's ImagesResponse.quality has no "auto").
QUALITY = "auto"


@dataclass(frozen=True)
class ImageEncoding:
    """How an answer's images are written: OpenAI's ``output_format`` and, for JPEG and
    WebP, ``output_compression`` (their quality)."""

    output_format: str = "png"
    compression: int | None = None

    def b64_json(self, image: Any) -> str:
        """``image`` in this encoding, as the answer's ``b64_json`` carries it."""
        return base64.b64encode(image_bytes(image, self.output_format, self.compression)
                                ).decode("ascii")


PNG = ImageEncoding()


def image_tokens(width: int, height: int, pixel_multiple: int) -> int:
    return (width // pixel_multiple) * (height // pixel_multiple)


def usage(images: int, tokens_per_image: int) -> dict[str, Any]:
    output = images * tokens_per_image
    return {
        "input_tokens": 0,
        "input_tokens_details": {"text_tokens": 0, "image_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"image_tokens": output, "text_tokens": 0},
        "total_tokens": output,
    }


def ditserve_meta(result: Any, request_id: str) -> dict[str, Any]:
    """ditserve's extension object (OpenAI clients ignore it): id, seed and timings."""
    return {
        "request_id": request_id,
        "seed": result.seed,
        "num_inference_steps": result.num_inference_steps,
        "queue_seconds": round(result.queue_seconds, 6),
        "latency_seconds": round(result.latency_seconds, 6),
    }


def generation_response(result: Any, *, request_id: str, size: str, tokens_per_image: int,
                        created: int | None = None, encoding: ImageEncoding = PNG
                        ) -> dict[str, Any]:
    """The OpenAI images response, plus a ``ditserve`` object with seed and timings."""
    return {
        "created": int(created if created is not None else time.time()),
        "data": [{"b64_json": encoding.b64_json(image)} for image in result.images],
        "background": BACKGROUND,
        "output_format": encoding.output_format,
        "size": size,
        "usage": usage(result.num_images, tokens_per_image),
        "ditserve": ditserve_meta(result, request_id),
    }


def _image_event(image: Any, *, size: str, encoding: ImageEncoding) -> dict[str, Any]:
    return {"b64_json": encoding.b64_json(image), "background": BACKGROUND,
            "created_at": int(time.time()), "output_format": encoding.output_format,
            "quality": QUALITY, "size": size}


def partial_image_payloads(pixels: Any, *, index: int, step: int, size: str,
                           request_id: str, encoding: ImageEncoding = PNG
                           ) -> list[dict[str, Any]]:
    """One ``image_generation.partial_image`` payload per image of a preview."""
    return [{**_image_event(image, size=size, encoding=encoding),
             "partial_image_index": index, "image_index": i, "step": step,
             "request_id": request_id}
            for i, image in enumerate(to_pil_images(pixels))]


def completed_payloads(result: Any, *, request_id: str, size: str, tokens_per_image: int,
                       encoding: ImageEncoding = PNG) -> list[dict[str, Any]]:
    """One ``image_generation.completed`` payload per image, each with its own usage."""
    meta = ditserve_meta(result, request_id)
    return [{**_image_event(image, size=size, encoding=encoding),
             "usage": usage(1, tokens_per_image), "image_index": i, "request_id": request_id,
             "ditserve": meta}
            for i, image in enumerate(result.images)]
