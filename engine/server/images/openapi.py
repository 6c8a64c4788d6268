"""The OpenAPI parts of POST /v1/images/generations: its JSON body (the schema itself is
``generation.openapi``'s, shared with the edits form) and its answers: the images, or with
``stream`` the generation events.
"""

from __future__ import annotations

from typing import Any

from ditserve.engine.server import openapi
from ditserve.engine.server.generation.openapi import sse_answer
from ditserve.engine.server.openapi import ref

GENERATION_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": ref("ImageGenerationRequest")}}}}


def answers() -> dict[int | str, Any]:
    """The route's ``responses``: the images (JSON) or the event stream, and its errors."""
    return openapi.answers(
        {**openapi.json_answer("ImagesResponse"), **sse_answer()},
        404, 408, 413, 429, 503, 504,
        ok_description="The images (JSON), or with `stream` an event stream: "
                       "image_generation.partial_image, .completed (OpenAI), error, and "
                       "ditserve.queued / ditserve.progress (JSON arrays; docs/serving.md)")
