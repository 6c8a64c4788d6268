"""Step-wise Qwen-Image-Edit (one source image) and Qwen-Image-Edit Plus (several), on
diffusers components: Qwen-Image's DiT, whose rows carry the sources' latent tokens too.

As the family's diffusers pipelines do, for each source image:
- its VAE input is the image resized to about 1024x1024 at its own aspect ratio (sides on a
  32-pixel grid), encoded to the distribution's mode, normalised by the VAE's latent mean and
  std, 2x2-packed; its tokens follow the target's (each image's after the previous one's)
  and the DiT's RoPE sees them as further image grids (``img_shapes``);
- the prompt is encoded by Qwen2.5-VL *with* the image: the chat template carries a vision
  placeholder per image, expanded to as many ``<|image_pad|>`` tokens as the vision tower
  makes of it (grid / merge^2), and the tower's features replace them. Edit reads the
  VAE-sized image, Plus each image at about 384x384 ("Picture 1: ..." before the prompt).
  The image processor is Qwen2.5-VL's (the PIL backend, read from the model's
  ``processor/preprocessor_config.json``), so no torchvision is needed.

Everything else - true CFG with the rescale to the conditional prediction's norm, noise,
schedule (by the target's token count), Euler step, decode - is Qwen-Image's
(``qwen_image.QwenImageStepPipeline``). Matches diffusers numerically for the same seed.

The VAE encodes the sources of the requests admitted in one step together, one forward per
source size (``encode_conditions``); the encoded tokens are static rows, so requests at
different steps share a forward. Requests whose sources have other sizes have other token
counts and run as other shape groups of the same step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ditserve.engine.families import QWEN_IMAGE_EDIT, QWEN_IMAGE_EDIT_PLUS
from ditserve.engine.families.qwen_image.pipeline import MAX_TEXT_TOKENS, QwenImageStepPipeline
from ditserve.engine.pipelines.common import upload
from ditserve.engine.pipelines.conditioning import encode_each, take_encoded, to_pil
from ditserve.engine.request import ModelLimits, SamplingParams
from ditserve.engine.step.denoise_state import DenoiseState

if TYPE_CHECKING:
    from ditserve.engine.step.input_batch import InputBatch
    from ditserve.engine.weights.loader import LoadedComponents

IMAGE_TOKENS = "image_latents"  # static row: the packed source-image tokens, image after image
SOURCE_GRIDS = "source_grids"  # host: each source's (1, h/2, w/2) token grid
IMAGE_PAD = "<|image_pad|>"
VAE_AREA = 1024 * 1024  # the sources' VAE size, as diffusers' pipelines
PLUS_PROMPT_AREA = 384 * 384  # Plus: the size Qwen2.5-VL reads each image at
# Qwen2.5-VL's processor refuses images beyond 200:1, and the 1 MP resize onto a 32-pixel
# grid stretches a source of about 164:1 past that: sources are refused above this.
MAX_SOURCE_ASPECT = 150.0
# The aspects a source may have (1:1 to MAX_SOURCE_ASPECT in 1/16 steps; the area rule is
# symmetric in width and height), swept for the largest source the planner budgets for.
ADMITTED_ASPECTS = tuple(1 + k / 16 for k in range(int((MAX_SOURCE_ASPECT - 1) * 16) + 1))
PLUS_IMAGE_PROMPT = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
VISION_PATCH = 28  # pixels per vision token side (14-pixel patches merged 2x2)


def area_size(area: int, width: float, height: float) -> tuple[int, int]:
    """(width, height) of ``area`` at the aspect ratio width/height, sides on a 32-pixel grid
    (diffusers' ``calculate_dimensions``)."""
    ratio = width / height
    new_width = math.sqrt(area * ratio)
    return round(new_width / 32) * 32, round(new_width / ratio / 32) * 32


class QwenImageEditStepPipeline(QwenImageStepPipeline):
    """StepPipeline for Qwen-Image-Edit (see module docstring)."""

    family = QWEN_IMAGE_EDIT
    condition_images = (1, 1)
    prompt_area: int | None = None  # None: Qwen2.5-VL reads the VAE-sized image
    # The prompt is encoded with its images inside prepare_encode (``_encode_with_images``):
    # the runner places offloaded encoders around the step's calls, not the prompt cache.
    prompt_reads_images = True

    def __init__(
        self, components: LoadedComponents, *, device: torch.device, move_transformer: bool = True
    ) -> None:
        from transformers import Qwen2VLImageProcessorPil

        super().__init__(components, device=device, move_transformer=move_transformer)
        self.block_lists = self.family.block_lists
        self.image_processor = components.pipeline.image_processor  # diffusers' resize
        self.vision_processor = Qwen2VLImageProcessorPil.from_pretrained(
            components.model_dir / "processor")
        self.vision_tokens = int(self.vision_processor.merge_size) ** 2  # patches per token

    # -- the sources -------------------------------------------------------------------------
    def condition_tokens(self, params: SamplingParams) -> int:
        """The sources' tokens each row carries (the work rule's conditioning): each source
        at its VAE size (``area_size``, about 1 MP) in 16-pixel tokens, image after image."""
        side = self.pixel_multiple
        return sum((w // side) * (h // side)
                   for w, h in (area_size(VAE_AREA, i.width, i.height) for i in params.images))

    @property
    def most_condition_tokens(self) -> int:
        """The most sources at the largest VAE size an admitted aspect gives (1:1 is not the
        largest: the 32-pixel rounding of a long thin source can add a little)."""
        side = self.pixel_multiple
        largest = max((w // side) * (h // side) for w, h in (
            area_size(VAE_AREA, aspect, 1) for aspect in ADMITTED_ASPECTS))
        return self.condition_images[1] * largest

    def _vae_image(self, image: Any) -> torch.Tensor:
        """(1, 3, 1, H, W) in [-1, 1]: the source at about 1 MP, as diffusers prepares it."""
        width, height = area_size(VAE_AREA, *image.size)
        resized = self.image_processor.resize(image, height, width)
        return self.image_processor.preprocess(resized, height, width).unsqueeze(2)

    def _prompt_image(self, image: Any) -> Any:
        width, height = area_size(self.prompt_area or VAE_AREA, *image.size)
        return self.image_processor.resize(image, height, width)

    def _prepare_sources(self, state: DenoiseState) -> list[tuple[Hashable, torch.Tensor]]:
        pixels = [self._vae_image(to_pil(image)) for image in state.params.images]
        return [(tuple(p.shape[-2:]), p) for p in pixels]

    @torch.inference_mode()
    def _vae_encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """(k, 3, 1, H, W) pixels -> (k, C, 1, h, w) normalised latents (the mode)."""
        # diffusers casts the image to the prompt embeddings' dtype (the text encoder's).
        pixels = upload(pixels, self.device).to(self.text_encoder.dtype)
        latents = self.vae.encode(pixels).latent_dist.mode()
        config = self.vae.config
        shape = (1, int(config.z_dim), 1, 1, 1)
        mean = torch.tensor(config.latents_mean).view(shape).to(latents.device, latents.dtype)
        std = torch.tensor(config.latents_std).view(shape).to(latents.device, latents.dtype)
        return (latents - mean) / std

    @torch.inference_mode()
    def encode_conditions(self, states: Sequence[DenoiseState]) -> None:
        """The sources of requests admitted together, one VAE forward per source size."""
        encode_each(states, prepare=self._prepare_sources, encode=self._vae_encode)

    def _source_latents(self, state: DenoiseState) -> tuple[torch.Tensor, ...]:
        encoded = take_encoded(state)
        if encoded is not None:
            return tuple(encoded)
        return tuple(self._vae_encode(p) for _, p in self._prepare_sources(state))

    # -- the prompt, read with the images ----------------------------------------------------
    def _template_text(self, prompt: str, count: int) -> str:
        return self.template.format(prompt)  # Edit's template holds the image's placeholder

    def text_prompts(self, params: SamplingParams) -> list[str]:
        """None for the runner's batched text pass: an edit reads each prompt together with
        its images (``_encode_with_images``), which the text-only pass cannot stage."""
        return []

    @torch.inference_mode()
    def _encode_with_images(self, prompt: str, images: list[Any]) -> torch.Tensor:
        """(1, L, D): Qwen2.5-VL's last hidden states of the prompt read with ``images``,
        after the template prefix."""
        vision = self.vision_processor(images=images, return_tensors="pt")
        text = self._template_text(prompt, len(images))
        pieces = text.split(IMAGE_PAD)
        assert len(pieces) == len(images) + 1, "one placeholder per image"
        counts = [int(grid.prod()) // self.vision_tokens for grid in vision["image_grid_thw"]]
        # Each placeholder becomes as many image tokens as the vision tower makes of it.
        text = pieces[0] + "".join(IMAGE_PAD * c + rest for c, rest in zip(counts, pieces[1:],
                                                                            strict=True))
        tokens = self.tokenizer([text], padding=True, return_tensors="pt")
        # Device ids: the image placeholders' positions are found on the device.
        out = self.headless_encoder()(
            input_ids=upload(tokens.input_ids, self.device),
            attention_mask=upload(tokens.attention_mask, self.device),
            pixel_values=upload(vision["pixel_values"], self.device),
            image_grid_thw=upload(vision["image_grid_thw"], self.device),
            output_hidden_states=True,
        )
        # One prompt, so no padding: every token is real.
        return out.hidden_states[-1][:, self.template_drop:].to(self.text_encoder.dtype)

    def limits(self) -> ModelLimits:
        """Qwen-Image's, with the text's RoPE positions also holding the images' vision tokens
        (at most the processor's pixel budget over 28x28 pixels per token, per image)."""
        table = int(self.transformer.pos_embed.pos_freqs.shape[0])
        area = self.prompt_area or VAE_AREA
        vision = self.condition_images[1] * (area // VISION_PATCH**2 + 1)
        positions = table - MAX_TEXT_TOKENS - vision
        table_limits = ModelLimits.of_table(positions, pixel_multiple=self.pixel_multiple,
                                            tokens_per_position=2,
                                            max_prompt_chars=self.max_prompt_chars,
                                            max_text_tokens=self.max_text_tokens)
        return dataclasses.replace(table_limits, max_condition_aspect=MAX_SOURCE_ASPECT)

    # -- StepPipeline ------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare_encode(self, state: DenoiseState) -> None:
        p = state.params
        sources = self._source_latents(state)
        seen = [self._prompt_image(to_pil(image)) for image in p.images]
        positive = self._encode_with_images(p.prompt, seen)
        negative = (self._encode_with_images(p.negative_prompt or "", seen)
                    if p.uses_true_cfg else None)
        self._prepare_rows(state, positive, negative)
        packed = []
        for source in sources:
            _, channels, _, lh, lw = source.shape
            # (1, C, 1, h, w) -> (1, h/2 * w/2, 4C): 2x2 patches become tokens.
            tokens = source.view(1, channels, lh // 2, 2, lw // 2, 2).permute(0, 2, 4, 1, 3, 5)
            packed.append(tokens.reshape(1, (lh // 2) * (lw // 2), channels * 4))
        joined = torch.cat(packed, dim=1)  # (1, sum of sources' tokens, 4C)
        state.static_rows[IMAGE_TOKENS] = joined.expand(state.rows, -1, -1).contiguous()
        state.host[SOURCE_GRIDS] = tuple((1, s.shape[3] // 2, s.shape[4] // 2) for s in sources)

    @torch.inference_mode()
    def denoise_step(self, batch: InputBatch) -> torch.Tensor:
        p = batch.states[0].params
        lh, lw = self._latent_grid(p.height, p.width)
        target = batch.hidden_states
        # (rows, target, 4C) + (rows, sources, 4C) -> (rows, target + sources, 4C); one batch
        # holds one source size (the batch key), so the first request's grids are everyone's.
        hidden = torch.cat([target, batch.static[IMAGE_TOKENS].to(target.dtype)], dim=1)
        shapes = [(1, lh // 2, lw // 2), *batch.states[0].host[SOURCE_GRIDS]]
        return self._predict(batch, hidden, shapes)[:, : target.shape[1]]


class QwenImageEditPlusStepPipeline(QwenImageEditStepPipeline):
    """StepPipeline for Qwen-Image-Edit Plus: one to three source images (see module
    docstring); the model card's advice is one to three."""

    family = QWEN_IMAGE_EDIT_PLUS
    condition_images = (1, 3)
    prompt_area = PLUS_PROMPT_AREA

    def _vae_image(self, image: Any) -> torch.Tensor:
        # Plus resizes inside preprocess (the same PIL resize) without a resize first.
        width, height = area_size(VAE_AREA, *image.size)
        return self.image_processor.preprocess(image, height, width).unsqueeze(2)

    def _template_text(self, prompt: str, count: int) -> str:
        images = "".join(PLUS_IMAGE_PROMPT.format(i + 1) for i in range(count))
        return self.template.format(images + prompt)
