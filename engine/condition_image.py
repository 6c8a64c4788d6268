"""A conditioning image of a request: an edit's source, an image-to-video first frame; and
the rules of denoising from a source image (image-to-image, inpainting with a mask).

Decoded and checked at the edge (``engine.server.fields.uploads``, the CLI's ``--image``); carried
on ``SamplingParams.images`` (and ``mask``); each image-conditioned pipeline resizes it as its
diffusers pipeline does. ``kept_steps`` and ``check_source`` are ``SamplingParams``'s rules
for ``strength`` and ``mask``. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from ditserve.engine.errors import InvalidRequestError


@dataclass(frozen=True, repr=False)
class ConditionImage:
    """A conditioning image (an edit's source, a video's first frame): decoded 8-bit RGB,
    row-major, ``width * height * 3`` bytes, EXIF orientation already applied. Checked and
    decoded at the edge (``engine.server.fields.uploads``, the CLI); pipelines resize it as their
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

    def check_shape(self, index: int, min_side: int | None, max_aspect: float | None) -> None:
        """Refuse input image ``index`` (0-based) when shorter than ``min_side`` a side or
        longer than ``max_aspect`` : 1 (``ModelLimits.min_condition_side`` and
        ``max_condition_aspect``, the model's image reader's limits; None: any)."""
        side, longest = min(self.width, self.height), max(self.width, self.height)
        shown = f"input image {index + 1} is {self.width}x{self.height} pixels"
        if min_side is not None and side < min_side:
            raise InvalidRequestError(
                "image", f"{shown}; this model takes images at least {min_side} pixels a side")
        if max_aspect is not None and longest > max_aspect * max(1, side):
            raise InvalidRequestError(
                "image", f"{shown}, an aspect ratio of {longest / max(1, side):.0f}:1; this "
                f"model takes aspect ratios up to {max_aspect:g}:1 (crop or pad it)")


def kept_steps(steps: int, strength: float) -> int:
    """The steps a run from a source image at ``strength`` keeps of ``steps``: the last
    ``steps - int(steps - steps * strength)`` (diffusers' ``get_timesteps``: 8 at 0.6 run 5)."""
    return steps - int(max(steps - min(steps * strength, steps), 0))


def source_strength(*, images: int, mask: ConditionImage | None, strength: float | None,
                    steps: int, image_strength: tuple[float, float] | None) -> float | None:
    """A request's strength, checked: a mask (white: repaint; OpenAI's transparent pixels are
    made white at decode) and a strength need a model that denoises from its source image
    (``image_strength``: its defaults without and with a mask, diffusers' 0.6 and 1.0) and
    exactly one source; a strength is in [0, 1] and keeps at least one of the ``steps``
    (``kept_steps``). None (a model without source strength, or no source) stays None;
    with a source it becomes the model's default."""
    if image_strength is not None and images == 1 and strength is None:
        strength = image_strength[1 if mask is not None else 0]
    _check_source(images=images, mask=mask, strength=strength, steps=steps,
                  image_strength=image_strength)
    return strength


def check_mask_fits(source: ConditionImage, mask: ConditionImage) -> None:
    """Refuse a mask whose aspect ratio is not its source image's: it is resized to the
    output (a scaled copy is fine), and a mask of another shape would be stretched over
    a region the user did not mark. OpenAI asks for the image's very size; a pixel of
    rounding either way is allowed."""
    fitted = mask.width * source.height / source.width  # the mask's height at the image's shape
    if abs(fitted - mask.height) > 1:
        raise InvalidRequestError(
            "mask", f"is {mask.width}x{mask.height} pixels, the image {source.width}x"
                    f"{source.height}: a mask has the image's size (or its aspect ratio)")


def _check_source(*, images: int, mask: ConditionImage | None, strength: float | None,
                  steps: int, image_strength: tuple[float, float] | None) -> None:
    if image_strength is None:
        if mask is not None:
            raise InvalidRequestError("mask", "this model does not repaint a masked region "
                                      "(inpainting); send the image without a mask")
        if strength is not None:
            raise InvalidRequestError("strength", "this model does not denoise from its "
                                      "source image; leave strength out")
        return
    if (mask is not None or strength is not None) and images > 1:
        raise InvalidRequestError("image", f"this model edits one source image (image-to-image "
                                  f"and inpainting), got {images}")
    if (mask is not None or strength is not None) and images != 1:
        field = "mask" if mask is not None else "strength"
        raise InvalidRequestError(field, f"needs exactly one source image, got {images}")
    if strength is None:
        return
    if not isinstance(strength, (int, float)) or isinstance(strength, bool) \
            or not 0.0 <= strength <= 1.0:
        raise InvalidRequestError("strength", f"must be a number in [0, 1], got {strength!r}")
    if kept_steps(steps, strength) < 1:
        raise InvalidRequestError("strength", f"{strength:g} of {steps} steps runs no step; "
                                  "raise strength or num_inference_steps")
