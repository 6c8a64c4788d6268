"""Step-wise FLUX.1 Kontext (the family's diffusers pipeline layout): image edits, Flux's DiT.

Kontext is Flux whose rows carry a second token sequence: the source image, resized as
diffusers does (to the preferred Kontext resolution nearest its aspect ratio, then down to a
multiple of 16 pixels), VAE-encoded (the distribution's mode, shifted and scaled), 2x2-packed
and appended after the noisy latent tokens, with position ids whose first axis is 1. The DiT
predicts every token; only the target tokens' prediction enters the sampler step. Without an
image it is plain Flux text-to-image, as in diffusers.

Matches the family's diffusers pipeline numerically for the same seed (the prompt encoding,
noise draw, schedule, Euler step and decode are Flux's: ``flux.FluxStepPipeline``). The
source image is encoded once, at admission - for the requests admitted in one step in one
VAE forward per source size (``encode_conditions``) - and its tokens are static rows of the
request, so requests at different steps share a forward. Requests with other sources (or
none) have other token counts and run as other shape groups of the same step.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import torch

from ditserve.engine.families import FLUX_KONTEXT
from ditserve.engine.families.flux.pipeline import FluxStepPipeline
from ditserve.engine.pipelines.common import upload
from ditserve.engine.pipelines.conditioning import encode_once, take_encoded, to_pil
from ditserve.engine.step.denoise_state import DenoiseState

if TYPE_CHECKING:
    from ditserve.engine.request import ConditionImage, SamplingParams
    from ditserve.engine.step.input_batch import InputBatch
    from ditserve.engine.weights.loader import LoadedComponents

IMAGE_TOKENS = "image_latents"  # static row: the packed source-image tokens


class FluxKontextStepPipeline(FluxStepPipeline):
    """StepPipeline for FLUX.1 Kontext (see module docstring)."""

    family = FLUX_KONTEXT
    condition_images = (0, 1)  # text-to-image without one, an edit with one

    def __init__(
        self, components: LoadedComponents, *, device: torch.device, move_transformer: bool = True
    ) -> None:
        super().__init__(components, device=device, move_transformer=move_transformer)
        pipe = components.pipeline
        self.image_processor = pipe.image_processor  # diffusers' own resize and normalisation
        from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

        self.preferred_resolutions = tuple(PREFERRED_KONTEXT_RESOLUTIONS)
        self.block_lists = FLUX_KONTEXT.block_lists

    # -- the source image --------------------------------------------------------------------
    def source_size(self, image: ConditionImage) -> tuple[int, int]:
        """(width, height) the source is resized to, as diffusers' ``_auto_resize``; a source
        under 16 pixels on a side (diffusers divides by zero) takes its own aspect ratio."""
        # diffusers rounds the image's own sides down to the VAE's multiple (read off the
        # sizes: no pixels converted, as the work rule asks every step).
        height, width = self.image_processor.get_default_height_width(
            image, height=image.height, width=image.width)
        if not height or not width:
            height, width = image.height, image.width
        aspect = width / height
        _, width, height = min((abs(aspect - w / h), w, h) for w, h in self.preferred_resolutions)
        multiple = self.pixel_multiple
        return width // multiple * multiple, height // multiple * multiple

    def condition_tokens(self, params: SamplingParams) -> int:
        """The source's tokens each row carries (the work rule's conditioning): its resized
        size's 16-pixel tokens, as many as the target's at the same size."""
        if not params.images:
            return 0
        width, height = self.source_size(params.images[0])
        return (width // self.pixel_multiple) * (height // self.pixel_multiple)

    @property
    def most_condition_tokens(self) -> int:
        """The largest preferred Kontext resolution's tokens (any source resizes to one)."""
        multiple = self.pixel_multiple
        return max((w // multiple) * (h // multiple) for w, h in self.preferred_resolutions)

    def _preprocess(self, state: DenoiseState) -> tuple[Hashable, torch.Tensor] | None:
        if not state.params.images:
            return None
        width, height = self.source_size(state.params.images[0])
        image = self.image_processor.resize(to_pil(state.params.images[0]), height, width)
        pixels = self.image_processor.preprocess(image, height, width)  # (1, 3, H, W) in [-1, 1]
        return (height, width), pixels

    @torch.inference_mode()
    def _vae_encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """(k, 3, H, W) pixels -> (k, C, h, w) latents: the mode, shifted and scaled."""
        # diffusers casts the image to the prompt embeddings' dtype (the DiT's) first.
        pixels = upload(pixels, self.device).to(self.dtype).to(self.vae.dtype)
        latents = self.vae.encode(pixels).latent_dist.mode()
        config = self.vae.config
        return ((latents - config.shift_factor) * config.scaling_factor).to(self.dtype)

    @torch.inference_mode()
    def encode_conditions(self, states: Sequence[DenoiseState]) -> None:
        """The sources of requests admitted together, one VAE forward per source size."""
        encode_once(states, prepare=self._preprocess, encode=self._vae_encode)

    def _source_latents(self, state: DenoiseState) -> torch.Tensor | None:
        encoded = take_encoded(state)
        if encoded is not None:
            return encoded
        prepared = self._preprocess(state)
        return None if prepared is None else self._vae_encode(prepared[1])

    def _source_ids(self, lh: int, lw: int) -> torch.Tensor:
        ids = self._image_ids(lh, lw).clone()
        ids[:, 0] = 1  # the source's tokens: first position axis 1, the target's 0
        return ids

    # -- StepPipeline ------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare_encode(self, state: DenoiseState) -> None:
        source = self._source_latents(state)
        super().prepare_encode(state)
        if source is None:
            return
        _, channels, lh, lw = source.shape
        # (1, C, h, w) -> (1, h/2 * w/2, 4C): 2x2 patches become tokens, as the target's.
        packed = source.view(1, channels, lh // 2, 2, lw // 2, 2).permute(0, 2, 4, 1, 3, 5)
        packed = packed.reshape(1, (lh // 2) * (lw // 2), channels * 4)
        state.static_rows[IMAGE_TOKENS] = packed.expand(state.rows, -1, -1).contiguous()
        target_ids = state.shared["img_ids"]
        state.shared = {**state.shared,
                        "img_ids": torch.cat([target_ids, self._source_ids(lh, lw)])}

    @torch.inference_mode()
    def denoise_step(self, batch: InputBatch) -> torch.Tensor:
        hidden = batch.hidden_states
        source = batch.static.get(IMAGE_TOKENS)
        if source is not None:
            # (rows, target, 4C) + (rows, source, 4C) -> (rows, target + source, 4C)
            hidden = torch.cat([hidden, source.to(hidden.dtype)], dim=1)
        out = self._predict(batch, hidden)
        return out[:, : batch.hidden_states.shape[1]]  # the target tokens' prediction
