"""Generation requests: sampling parameters, the batch-compatibility key, and request status.

Pure Python (no torch): the scheduler, the HTTP layer and the operator-facing code import it.
``SamplingParams`` is what a client asks for; ``BatchKey`` is the subset of it that changes the
shape or meaning of the denoise forward, so only requests with equal keys share a batch.
The number of steps, the seed and the current step are deliberately not in the key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ditserve.engine.condition_image import ConditionImage as ConditionImage
from ditserve.engine.condition_image import check_mask_fits, kept_steps, source_strength
from ditserve.engine.config.step_cache import StepCacheSpec
from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.lora_ref import MAX_LORA_SCALE as MAX_LORA_SCALE
from ditserve.engine.lora_ref import MAX_LORAS_PER_REQUEST as MAX_LORAS_PER_REQUEST
from ditserve.engine.lora_ref import LoraRef as LoraRef
from ditserve.engine.lora_ref import check_loras
from ditserve.engine.model_limits import MAX_FRAMES as MAX_FRAMES
from ditserve.engine.model_limits import MAX_SIDE as MAX_SIDE
from ditserve.engine.model_limits import ModelLimits as ModelLimits
from ditserve.engine.reference_media import Reference, check_references, shape_key
from ditserve.engine.request_status import RequestStatus as RequestStatus

MAX_STEPS = 1000
MAX_IMAGES = 8
MAX_PARTIAL_IMAGES = 3  # OpenAI's bound on streamed previews
MAX_CONDITION_IMAGES = 4  # images one request may condition on (Qwen-Image-Edit Plus: 3)
MAX_PRIORITY = 2**31 - 1  # |priority| bound: an int32, as in vLLM
MAX_DEADLINE_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class BatchKey:
    """Fields that change the denoise tensor contract; equal keys may share a forward.

    Only the token grid (height, width, frames) does. Everything else is per row: each row
    carries its own timestep and guidance value, true CFG just adds rows for the negative
    prompt, and several images per request are several rows. Keeping the key this small is
    what lets requests with different step counts, guidance and CFG share a batch. LoRA
    adapters are per row too (each row's low-rank delta is added to the shared base linear,
    ``engine.adapters``), so requests with different adapters share a forward.
    """

    height: int
    width: int
    num_frames: int = 1
    # The conditioning images' sizes: their latents join every row's tokens (other counts).
    condition: tuple[tuple[int, int], ...] = ()
    # The text length of a request that names one: prompts of another length would be padded
    # to a common length, which changes a Flux or Wan output (their text attention is unmasked).
    max_sequence_length: int | None = None
    # The references' kinds and sizes: their rows join the request's packed sequence.
    references: tuple[tuple[str, int, int], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """One generation request, as the client specified it.

    guidance_scale: the distilled-guidance value fed to guidance-embedding models (Flux-dev);
        ignored by image models without a guidance embedding. Video families (Wan) use it as
        diffusers' own Wan pipeline does: classifier-free guidance whenever it is > 1, against
        ``negative_prompt`` (or the empty prompt).
    true_cfg_scale: classifier-free guidance with ``negative_prompt``; active when > 1 and a
        negative prompt is given, the empty string included (as in diffusers' own Flux and
        Qwen-Image pipelines; without one it is off, as there).
    max_sequence_length: text tokens per prompt; None is the pipeline's own default (512 for
        Flux, Wan and Qwen-Image, as diffusers).
    num_frames: 1 for images; a video family's frame count (``frame_step * k + 1``).
    seed: None draws a random seed at admission; the seed used is reported back.
    partial_images: previews of the running latents to decode, at evenly spaced steps (see
        ``preview_steps``); they travel as "preview" events, never change the result.
    images: conditioning images (an edit's sources, an image-to-video first frame); empty for
        text-only generation. How many a model takes is its pipeline's ``condition_images``.
    last_frame: the last of ``images`` is the video's last frame, the one before it (if
        any) its first (keyframes: ``ModelLimits.last_frame``, MiniMax-H3's ``fl2va``).
    mask, strength: inpainting's region (white repainted) and how far from the source a
        model that denoises from it starts (None: its default, filled in by ``validate_for``;
        ``condition_image.source_strength``).
    loras: the LoRA adapters applied to this request's rows, each with its scale (stacked:
        their deltas add up, as diffusers' ``set_adapters`` with several names).
    step_cache: this request's step cache (``engine.config.step_cache``); None takes the
        server's default. Per row, so it is not part of the batch key.
    priority: the scheduling class, lower is sooner (as vLLM's ``priority``); only the
        scheduler reads it, and only under ``--scheduling-policy priority``.
    deadline_s: seconds from arrival by which the result is wanted; the scheduler refuses or
        stops a request that cannot make it (``DeadlineError``). None: no deadline.
    audio: the video's sound track too (``ModelLimits.audio``: models that make one).
    references: the media an omni-reference model conditions on, in the order it reads them
        (``engine.reference_media``: images and audio; ``ModelLimits.references``).
    """

    prompt: str
    negative_prompt: str | None = None
    height: int = 64
    width: int = 64
    num_inference_steps: int = 4
    guidance_scale: float = 3.5
    true_cfg_scale: float = 1.0
    seed: int | None = None
    num_images: int = 1
    num_frames: int = 1
    partial_images: int = 0
    images: tuple[ConditionImage, ...] = ()
    last_frame: bool = False
    mask: ConditionImage | None = None
    strength: float | None = None
    max_sequence_length: int | None = None
    loras: tuple[LoraRef, ...] = ()
    step_cache: StepCacheSpec | None = None
    priority: int = 0
    deadline_s: float | None = None
    audio: bool = False
    references: tuple[Reference, ...] = ()

    @property
    def uses_true_cfg(self) -> bool:
        return self.true_cfg_scale > 1.0 and self.negative_prompt is not None

    def _validate_frames(self, frame_step: int | None, max_frames: int,
                         min_frames: int = 1) -> None:
        frames = self.num_frames
        if frame_step is None:
            if frames != 1:
                raise InvalidRequestError("num_frames", "this is an image model: num_frames must "
                                          f"be 1, got {frames!r}")
            return
        if not isinstance(frames, int) or isinstance(frames, bool) \
                or not min_frames <= frames <= max_frames:
            raise InvalidRequestError(
                "num_frames", f"must be an integer in [{min_frames}, {max_frames}] for this "
                f"model, got {frames!r}")
        if (frames - 1) % frame_step:
            lower = frames - (frames - 1) % frame_step
            raise InvalidRequestError(
                "num_frames", f"must be {frame_step}k+1 for this model, got {frames} "
                f"(try {lower} or {lower + frame_step})")

    def _validate_images(self, accepted: tuple[int, int]) -> None:
        fewest, most = accepted
        count = len(self.images)
        if not all(isinstance(i, ConditionImage) for i in self.images):
            raise InvalidRequestError("image", "conditioning images must be decoded RGB images")
        if most == 0 and count:
            raise InvalidRequestError("image", "this model generates from text only; it takes no "
                                      "input image (serve an edit or image-to-video model)")
        if count < fewest:
            raise InvalidRequestError("image", f"this model needs {fewest} input image"
                                      f"{'s' if fewest > 1 else ''}, got {count}")
        if count > most:
            raise InvalidRequestError("image", f"this model takes at most {most} input image"
                                      f"{'s' if most > 1 else ''}, got {count}")

    def _validate_scheduling(self) -> None:
        p = self.priority
        if not isinstance(p, int) or isinstance(p, bool) or not abs(p) <= MAX_PRIORITY:
            raise InvalidRequestError(
                "priority", f"must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}] (lower "
                f"is sooner), got {p!r}")
        d = self.deadline_s
        if d is None:
            return
        if not isinstance(d, (int, float)) or isinstance(d, bool) or d != d \
                or not 0 < d <= MAX_DEADLINE_S:
            raise InvalidRequestError(
                "deadline_s", f"must be a number of seconds in (0, {MAX_DEADLINE_S:g}], got "
                f"{d!r}")

    def batch_key(self) -> BatchKey:
        return BatchKey(height=self.height, width=self.width, num_frames=self.num_frames,
                        condition=tuple((i.width, i.height) for i in self.images),
                        max_sequence_length=self.max_sequence_length,
                        references=tuple(shape_key(r) for r in self.references))

    @property
    def rows(self) -> int:
        """Rows this request adds to a denoise forward (images, doubled under true CFG)."""
        return self.num_images * (2 if self.uses_true_cfg else 1)

    @property
    def preview_steps(self) -> frozenset[int]:
        """Steps after which a preview is decoded: ``partial_images`` evenly spaced points of
        the trajectory, rounded to a step, never the last step (that one is the result). Few
        steps give fewer previews (4 steps, 3 previews: steps 1, 2, 3; 2 steps: step 1)."""
        total, k = self.denoise_steps, self.partial_images
        # round((i + 1) * total / (k + 1)) in integers, halves rounded up
        points = (((i + 1) * total * 2 + k + 1) // (2 * (k + 1)) for i in range(k))
        return frozenset(step for step in points if 1 <= step < total)

    def validate_for(self, limits: ModelLimits) -> SamplingParams:
        """``validate`` under the loaded model's limits; returns the request with the
        model's default ``strength`` filled in where it denoises from a source image."""
        limits.check_audio(self.audio)  # a sound track only from a model that makes one
        limits.check_guidance(guidance_scale=self.guidance_scale,
                              negative_prompt=self.negative_prompt,
                              true_cfg_scale=self.true_cfg_scale)
        limits.check_last_frame(self.last_frame, images=len(self.images))
        limits.check_images_used(images=len(self.images), frames=self.num_frames)
        limits.check_true_cfg(self.true_cfg_scale)
        check_references(self.references, limits.references)
        strength = source_strength(images=len(self.images), mask=self.mask,
                                   strength=self.strength, steps=self.num_inference_steps,
                                   image_strength=limits.image_strength)
        if isinstance(self.mask, ConditionImage) and len(self.images) == 1 \
                and isinstance(self.images[0], ConditionImage):
            check_mask_fits(self.images[0], self.mask)
        params = dataclasses.replace(self, strength=strength,
                                     num_frames=limits.aligned_frames(self.num_frames))
        return params.validate(pixel_multiple=limits.pixel_multiple,
                               max_prompt_chars=limits.max_prompt_chars,
                               frame_step=limits.frame_step, max_side=limits.max_side,
                               max_frames=limits.max_frames, min_frames=limits.min_frames,
                               condition_images=limits.condition_images,
                               max_text_tokens=limits.max_text_tokens,
                               min_condition_side=limits.min_condition_side,
                               max_condition_aspect=limits.max_condition_aspect)

    @property
    def denoise_steps(self) -> int:
        """The steps this request runs: all, or fewer from a source image at ``strength``
        (``condition_image.kept_steps``)."""
        if self.strength is None or not self.images:
            return self.num_inference_steps
        return kept_steps(self.num_inference_steps, self.strength)

    def validate(
        self,
        *,
        pixel_multiple: int = 16,
        max_prompt_chars: int | None = None,
        requires_prompt: bool = True,
        max_images: int = MAX_IMAGES,
        frame_step: int | None = None,
        condition_images: tuple[int, int] = (0, 0),
        max_text_tokens: int | None = None,
        max_side: int = MAX_SIDE,
        max_frames: int = MAX_FRAMES,
        min_frames: int = 1,
        min_condition_side: int | None = None,
        max_condition_aspect: float | None = None,
    ) -> SamplingParams:
        """Raise InvalidRequestError naming the first bad field, else return self.

        pixel_multiple: the model's spatial granularity (VAE factor x patch size).
        frame_step: None for an image model; a video model's temporal VAE factor.
        condition_images: (fewest, most) conditioning images the model takes.
        max_text_tokens: the model's bound on ``max_sequence_length`` (None: only >= 1).
        max_side, max_frames: what the model's positional tables reach (``ModelLimits``).
        min_frames: the shortest clip the model generates (``ModelLimits``; MiniMax-H3: 5 s).
        min_condition_side, max_condition_aspect: the input images' bounds (``ModelLimits``).
        """
        self._validate_images(condition_images)
        for index, image in enumerate(self.images):
            if isinstance(image, ConditionImage):  # else _validate_images refused it
                image.check_shape(index, min_condition_side, max_condition_aspect)
        self._validate_text(requires_prompt, max_prompt_chars)
        self._validate_size(pixel_multiple, max_side)
        self._validate_counts(max_images)
        self._validate_frames(frame_step, max_frames, min_frames)
        if self.step_cache is not None:
            if not isinstance(self.step_cache, StepCacheSpec):
                raise InvalidRequestError("step_cache", "must be a StepCacheSpec")
            self.step_cache.validate()
        self._validate_scheduling()
        check_loras(self.loras)
        self._validate_numbers(max_text_tokens)
        return self

    def _validate_text(self, requires_prompt: bool, max_prompt_chars: int | None) -> None:
        if not isinstance(self.prompt, str):
            raise InvalidRequestError("prompt", "must be a string")
        if requires_prompt and not self.prompt.strip():
            raise InvalidRequestError("prompt", "must not be empty")
        if max_prompt_chars is not None and len(self.prompt) > max_prompt_chars:
            raise InvalidRequestError(
                "prompt", f"is {len(self.prompt)} characters; the limit is {max_prompt_chars}"
            )
        if self.negative_prompt is not None and not isinstance(self.negative_prompt, str):
            raise InvalidRequestError("negative_prompt", "must be a string")

    def _validate_size(self, pixel_multiple: int, max_side: int) -> None:
        for name in ("height", "width"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidRequestError(name, f"must be an integer, got {value!r}")
            if value < pixel_multiple or value > max_side:
                raise InvalidRequestError(
                    name, f"must be between {pixel_multiple} and {max_side} for this model, "
                    f"got {value}")
            if value % pixel_multiple:
                lower = value - value % pixel_multiple
                raise InvalidRequestError(
                    name,
                    f"must be a multiple of {pixel_multiple} for this model, got {value} "
                    f"(try {lower} or {lower + pixel_multiple})",
                )

    def _validate_counts(self, max_images: int) -> None:
        steps = self.num_inference_steps
        if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= MAX_STEPS:
            raise InvalidRequestError(
                "num_inference_steps", f"must be an integer in [1, {MAX_STEPS}], got {steps!r}"
            )
        n = self.num_images
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= max_images:
            raise InvalidRequestError("n", f"must be an integer in [1, {max_images}], got {n!r}")
        k = self.partial_images
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_PARTIAL_IMAGES:
            raise InvalidRequestError(
                "partial_images", f"must be an integer in [0, {MAX_PARTIAL_IMAGES}], got {k!r}"
            )

    def _validate_numbers(self, max_text_tokens: int | None) -> None:
        for name in ("guidance_scale", "true_cfg_scale"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise InvalidRequestError(name, f"must be a number, got {value!r}")
            if not 0.0 <= value <= 100.0 or value != value:
                raise InvalidRequestError(name, f"must be in [0, 100], got {value}")
        length = self.max_sequence_length
        if length is not None and (
            not isinstance(length, int) or isinstance(length, bool) or length < 1
            or (max_text_tokens is not None and length > max_text_tokens)
        ):
            raise InvalidRequestError(
                "max_sequence_length", f"must be an integer in [1, {max_text_tokens or 'inf'}] "
                f"for this model, got {length!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool)
            or not 0 <= self.seed < 2**63
        ):
            raise InvalidRequestError("seed", f"must be an integer in [0, 2^63), got {self.seed!r}")


@dataclass(frozen=True)
class NewRequest:
    """A request admitted this step, as the model runner receives it: its id, what the client
    asked for, and the seed drawn at submission (``params.seed`` may be None)."""

    request_id: str
    params: SamplingParams
    seed: int
