"""The event names of the image routes' streams (``"stream": true``).

``PARTIAL_IMAGE`` and ``COMPLETED`` are OpenAI's image stream events (the SDK's typed
``ImageGenPartialImageEvent`` / ``ImageGenCompletedEvent``; the edits route's are
``image_edit.*``); ``QUEUED`` and ``PROGRESS`` are ditserve's own, under their own types,
which OpenAI clients pass over; ``ERROR`` ends a stream that failed. Written by
``generation.waiting``, described by ``generation.openapi``.
"""

from __future__ import annotations

from dataclasses import dataclass

QUEUED = "ditserve.queued"
PROGRESS = "ditserve.progress"
PARTIAL_IMAGE = "image_generation.partial_image"
COMPLETED = "image_generation.completed"
ERROR = "error"
EVENT_TYPES = (QUEUED, PROGRESS, PARTIAL_IMAGE, COMPLETED, ERROR)


@dataclass(frozen=True)
class ImageEvents:
    """The event names of one image route's stream: generations' ``image_generation.*``,
    edits' ``image_edit.*`` (OpenAI's ``ImageEditPartialImageEvent`` / ``...CompletedEvent``;
    the payloads are the same)."""

    queued: str
    progress: str
    partial_image: str
    completed: str


GENERATION_EVENTS = ImageEvents(QUEUED, PROGRESS, PARTIAL_IMAGE, COMPLETED)
EDIT_EVENTS = ImageEvents("image_edit.queued", "image_edit.progress",
                          "image_edit.partial_image", "image_edit.completed")
