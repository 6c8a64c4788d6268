"""What the loaded model can run: its limits, read off its own config by its pipeline.

``ModelLimits`` bounds a request's size, frames, conditioning images and text length; the
server shows it in ``/v1/models`` and its OpenAPI document and refuses a request beyond it up
front, and ``SamplingParams.validate_for`` applies it. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.reference_media import ReferenceLimits

MAX_SIDE = 8192
MAX_FRAMES = 1025


@dataclass(frozen=True)
class ModelLimits:
    """What the loaded model can run, read off its own config (each pipeline's ``limits``).

    pixel_multiple: height and width divide by it (VAE factor x patch size).
    max_side: the largest height or width: the model's positional table (a rope of
        ``positions`` entries per axis reaches ``positions * pixel_multiple`` pixels), capped
        at MAX_SIDE; MAX_SIDE for a model whose positions are computed on the fly (Flux).
    frame_step: None for an image model; a video model's ``num_frames - 1`` divides by it.
    min_frames: the shortest clip the model generates (1: any; MiniMax-H3: 5 s).
    max_frames: 1 for an image model; a video model's longest clip its positional table
        covers (Wan: ``rope_max_seq_len`` latent frames), capped at MAX_FRAMES.
    positions: entries per axis of the model's positional table; None when it has none.
    condition_images: (fewest, most) input images a request brings (edits, image-to-video);
        (0, 0) for a text-only model.
    max_text_tokens: the most text tokens per prompt (``max_sequence_length``) it takes.
    min_condition_side, max_condition_aspect: the smallest side and the most extreme aspect
        ratio of an input image the model's pipeline takes (FLUX.2's: 64 px, 8); None: any.
    image_strength: for a model that denoises from its source image (image-to-image and
        inpainting: it takes ``strength`` and a ``mask``), its default strength without and
        with a mask; None for every other model.
    audio: whether it generates a sound track with its videos (a request's ``audio``).
    last_frame: whether a request's last image may be the video's last frame (a request's
        ``last_frame``: MiniMax-H3's keyframe workflow).
    references: what an omni-reference model takes (a request's ``references``: MiniMax-H3's
        ``ref2va`` replica); None: the model takes no references.
    frame_align: (multiple, remainder) for a video model that rounds a clip's frame count up
        to the next ``multiple * n + remainder`` its VAE encodes (MiniMax-H3: 17 n + 5); the
        request is rounded as it arrives, so the job reports the frames its video has.
    guidance: False for a guidance-distilled model with no guidance input at all (MiniMax-H3:
        no guidance scale, no negative prompt, one forward per step); such a model refuses
        them rather than ignore them.
    true_cfg: whether ``true_cfg_scale`` is an input (Flux, FLUX.2, Qwen-Image: CFG against a
        negative prompt); False where classifier-free guidance is ``guidance_scale`` (Wan,
        Z-Image, Cosmos3), so a request's ``true_cfg_scale`` is refused, not ignored.
    image_needs_frames: the fewest frames a request's input images are used at (2 for a
        ``Family.still_images`` family, Cosmos3: its one frame is made from the text alone), so
        a shorter request with an image is refused.
    """

    pixel_multiple: int = 16
    max_side: int = MAX_SIDE
    frame_step: int | None = None
    min_frames: int = 1
    max_frames: int = 1
    max_prompt_chars: int | None = None
    positions: int | None = None
    condition_images: tuple[int, int] = (0, 0)
    max_text_tokens: int | None = None
    min_condition_side: int | None = None
    max_condition_aspect: float | None = None
    image_strength: tuple[float, float] | None = None
    audio: bool = False
    last_frame: bool = False
    references: ReferenceLimits | None = None
    guidance: bool = True
    frame_align: tuple[int, int] | None = None
    image_needs_frames: int = 1
    true_cfg: bool = True

    def aligned_frames(self, frames: int) -> int:
        """``frames`` rounded up as the model's VAE needs (unchanged without ``frame_align``)."""
        if self.frame_align is None or not isinstance(frames, int) or frames < 1:
            return frames
        multiple, remainder = self.frame_align
        return frames + (remainder - frames) % multiple

    def check_images_used(self, *, images: int, frames: int) -> None:
        """Refuse input images a request this short would not use (rather than ignore them)."""
        if images and isinstance(frames, int) and frames < self.image_needs_frames:
            raise InvalidRequestError(
                "image", f"a {frames}-frame request does not use an input image (this model "
                         "makes it from the text alone; the image conditions a video's first "
                         f"frame): ask for at least {self.image_needs_frames} frames, or send "
                         "no image")

    def check_guidance(self, *, guidance_scale: float, negative_prompt: str | None,
                       true_cfg_scale: float) -> None:
        """Refuse guidance a guidance-distilled model has no input for (it would be ignored,
        and the job would report a setting that changed nothing)."""
        if self.guidance:
            return
        why = "this model is guidance-distilled (guidance is in its weights, one forward per step)"
        if negative_prompt:
            raise InvalidRequestError("negative_prompt", f"{why}: it takes no negative prompt")
        if guidance_scale != 1.0:
            raise InvalidRequestError("guidance_scale", f"{why}: it takes no guidance_scale; "
                                      f"leave it out (or send 1), got {guidance_scale}")
        if true_cfg_scale != 1.0:
            raise InvalidRequestError("true_cfg_scale", f"{why}: it takes no true_cfg_scale; "
                                      f"leave it out (or send 1), got {true_cfg_scale}")

    def check_true_cfg(self, true_cfg_scale: float) -> None:
        """Refuse a true-CFG scale where the model's CFG is ``guidance_scale``."""
        if not self.true_cfg and self.guidance and true_cfg_scale != 1.0:
            raise InvalidRequestError(
                "true_cfg_scale", "this model has no true CFG: its classifier-free guidance "
                f"is guidance_scale (with negative_prompt); leave true_cfg_scale out (or send "
                f"1), got {true_cfg_scale}")

    def check_last_frame(self, wanted: object, *, images: int) -> None:
        """Refuse a last-frame image where the model conditions on a first frame only, or
        where the request brings no image to be it; a keyframe model's two images are a
        first and a last frame, so they come with ``last_frame``."""
        if not isinstance(wanted, bool):
            raise InvalidRequestError("last_frame", f"must be a boolean, got {wanted!r}")
        if wanted and not self.last_frame:
            raise InvalidRequestError("last_frame", "this model takes no last frame; send "
                                      "the first frame alone (MiniMax-H3 takes both)")
        if wanted and not images:
            raise InvalidRequestError("last_frame", "a last frame needs its image")
        if self.last_frame and images > 1 and not wanted:
            raise InvalidRequestError("last_frame", f"{images} images are a first and a last "
                                      "frame: mark the last one (last_frame)")

    def check_audio(self, wanted: bool) -> None:
        """Refuse a request's sound track where the model makes none."""
        if wanted and not self.audio:
            raise InvalidRequestError("audio", "this model generates no sound track; leave "
                                      "audio off (Cosmos3 models with a sound tokenizer and "
                                      "MiniMax-H3 do)")

    @classmethod
    def of_table(cls, positions: int | None, *, pixel_multiple: int, tokens_per_position: int = 1,
                 frame_step: int | None = None, frames_per_position: int = 1,
                 max_prompt_chars: int | None = None,
                 max_text_tokens: int | None = None) -> ModelLimits:
        """Limits of a model whose positional table holds ``positions`` entries per axis:
        ``tokens_per_position`` latent patches per entry on the spatial axes, and (video)
        ``frames_per_position`` latent frames per entry on the time axis."""
        if positions is None:
            side, frames = MAX_SIDE, MAX_FRAMES
        else:
            side = positions * tokens_per_position * pixel_multiple
            frames = (positions * frames_per_position - 1) * (frame_step or 1) + 1
        side = min(side, MAX_SIDE) // pixel_multiple * pixel_multiple
        if frame_step is None:
            frames = 1
        else:
            frames = min(frames, MAX_FRAMES)
            frames -= (frames - 1) % frame_step
        return cls(pixel_multiple=pixel_multiple, max_side=side, frame_step=frame_step,
                   max_frames=frames, max_prompt_chars=max_prompt_chars, positions=positions,
                   max_text_tokens=max_text_tokens)
