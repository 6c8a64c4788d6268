"""A conditioning image of a request: an edit's source, an image-to-video first frame.

Decoded and checked at the edge (``engine.server.uploads``, the CLI's ``--image``); carried
on ``SamplingParams.images``; each image-conditioned pipeline resizes it as its diffusers
pipeline does. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from ditserve.engine.errors import InvalidRequestError


@dataclass(frozen=True, repr=False)
class ConditionImage:
    """A conditioning image (an edit's source, a video's first frame): decoded 8-bit RGB,
    row-major, ``width * height * 3`` bytes, EXIF orientation already applied. Checked and
    decoded at the edge (``engine.server.uploads``, the CLI); pipelines resize it as their
    diffusers pipeline does."""

    width: int
    height: int
    rgb: bytes

    def __post_init__(self) -> None:
        if len(self.rgb) != self.width * self.height * 3:
            raise InvalidRequestError("image", f"{len(self.rgb)} bytes is not a {self.width}x"
                                      f"{self.height} RGB image")

    def __repr__(self) -> str:  # never print the pixels into a log
        return f"ConditionImage({self.width}x{self.height})"

    def check_aspect(self, max_aspect: float | None) -> None:
        """Refuse an image longer than ``max_aspect`` : 1 (the model's image reader's limit,
        ``ModelLimits.max_condition_aspect``; None: any)."""
        aspect = max(self.width, self.height) / max(1, min(self.width, self.height))
        if max_aspect is not None and aspect > max_aspect:
            raise InvalidRequestError(
                "image", f"the image is {self.width}x{self.height} pixels, an aspect ratio "
                f"of {aspect:.0f}:1; this model reads images up to {max_aspect:g}:1 (crop or "
                "pad it)")
