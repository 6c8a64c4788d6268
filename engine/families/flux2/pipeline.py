"""Step-wise FLUX.2 (the family's diffusers pipeline layout) on top of diffusers components.

Matches the family's diffusers pipeline numerically for the same seed: the same prompt
encoding (the chat-formatted prompt padded to ``max_sequence_length`` tokens, the encoder's
hidden layers ``text_encoder_out_layers`` stacked along the width), the same initial noise
draw (a CPU generator seeded with the request's seed, shape (n, 4C, h/2, w/2): the latents
already 2x2-patchified, then flattened to tokens), the same empirical schedule shift
(``compute_empirical_mu``), the same Euler update, the same batch-norm denormalisation and
decode. The guidance value enters the DiT's guidance embedding ([dev]); there are no CFG rows
unless a request asks for true CFG with a negative prompt (an extension: FLUX.1's rule).

Reference images (multi-reference editing, ``/v1/images/edits`` with 1..N images) are
resized as diffusers does (capped at 1024x1024 pixels, cropped to a multiple of 16),
VAE-encoded (the mode, batch-norm normalised), packed, and appended after the target's
tokens in request order; image i's position ids have time coordinate 10 + 10 i. They are
encoded once at admission (one VAE forward per image size across the requests admitted in
one step) and kept as static rows, so requests at different steps share a forward; requests
with other reference sizes (or none) run as other shape groups of the same step.

Differences are on purpose: every row carries its own timestep and guidance, and the text
encoder runs without its LM head (``headless_encoder``: the pipeline reads hidden states
only; diffusers' call computes and drops 131k logits per token). Prompt upsampling
(``caption_upsample_temperature``, a generation by the encoder) is not served.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ditserve.engine.families import FLUX2
from ditserve.engine.pipeline_defaults import call_defaults
from ditserve.engine.pipelines.common import seeded_noise, upload
from ditserve.engine.pipelines.conditioning import encode_each, take_encoded, to_pil
from ditserve.engine.pipelines.guidance import guided_step
from ditserve.engine.pipelines.host_embedding import token_ids
from ditserve.engine.request import ModelLimits, SamplingParams
from ditserve.engine.step.denoise_state import DenoiseState
from ditserve.engine.step.sampler import FlowMatchEulerSampler

if TYPE_CHECKING:
    from ditserve.engine.step.input_batch import InputBatch
    from ditserve.engine.weights.loader import LoadedComponents

MAX_TEXT_TOKENS = 512  # the released encoders' template + prompt budget (diffusers' default)
# Reference images a request may bring: diffusers takes any number; each adds its tokens to
# every forward of the request (a 1024x1024 reference: 4096), so the server bounds them.
MAX_REFERENCE_IMAGES = 10
MAX_REFERENCE_PIXELS = 1024 * 1024  # diffusers resizes larger references down to this area
# What diffusers' ``Flux2ImageProcessor.check_image_input`` accepts (its defaults): the server
# refuses other references up front (400) instead of failing them in the pipeline.
MIN_REFERENCE_SIDE = 64
MAX_REFERENCE_ASPECT = 8
REFERENCE_TIME_SCALE = 10  # reference i's time coordinate: 10 + 10 i (diffusers' scale)
IMAGE_TOKENS = "image_latents"  # static row: the packed reference-image tokens


def reference_size(width: int, height: int, multiple: int) -> tuple[int, int]:
    """(width, height) a reference enters the VAE at: above ``MAX_REFERENCE_PIXELS`` scaled
    down to that area (diffusers' ``Flux2ImageProcessor._resize_to_target_area``: sides
    truncated), then cropped to ``multiple``. ``_preprocess`` crops to it; the work rule
    counts its tokens from it without resizing a pixel."""
    if width * height > MAX_REFERENCE_PIXELS:
        scale = math.sqrt(MAX_REFERENCE_PIXELS / (width * height))
        width, height = int(width * scale), int(height * scale)
    return width // multiple * multiple, height // multiple * multiple


def empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """FLUX.2's schedule shift for a token count and step count (diffusers'
    ``compute_empirical_mu``, BFL's fit)."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    return float(compute_empirical_mu(image_seq_len=image_seq_len, num_steps=num_steps))


class Flux2StepPipeline:
    """StepPipeline for FLUX.2 [dev] (see module docstring); [klein] subclasses it."""

    family = FLUX2
    condition_images = (0, MAX_REFERENCE_IMAGES)

    def __init__(
        self, components: LoadedComponents, *, device: torch.device, move_transformer: bool = True
    ) -> None:
        m = components.modules
        self.device = device
        self.transformer = m["transformer"]
        self.vae = m["vae"].to(device)
        self.text_encoder = m["text_encoder"]
        self.tokenizer = m["tokenizer"]
        if move_transformer:
            self.transformer.to(device)
        self.dtype: torch.dtype = next(self.transformer.parameters()).dtype
        self.block_lists = self.family.block_lists
        self.frame_step: int | None = None  # an image family
        self.sampler = FlowMatchEulerSampler(m["scheduler"].config)
        pipe = components.pipeline
        self.image_processor = pipe.image_processor  # diffusers' own resize and normalisation
        self.system_message: str | None = getattr(pipe, "system_message", None)
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        # 2x2 latent patches: pixel sizes must divide by twice the VAE factor.
        self.pixel_multiple = self.vae_scale_factor * 2
        call = call_defaults(components.pipeline_class)
        self.max_sequence_length = int(call["max_sequence_length"])
        self.text_layers = tuple(int(k) for k in call["text_encoder_out_layers"])
        self.max_text_tokens = MAX_TEXT_TOKENS
        self.max_prompt_chars: int | None = 4000
        self.in_channels = int(self.transformer.config.in_channels)  # 4 x the VAE's channels
        self.guidance_embeds = bool(self.transformer.config.guidance_embeds)
        self._ids: dict[tuple[Any, ...], torch.Tensor] = {}

    # -- encode ------------------------------------------------------------------------------
    def headless_encoder(self) -> torch.nn.Module:
        """The text encoder without its LM head (``.model``): the pipeline reads hidden
        states only; the states are the same as the whole model's."""
        inner = getattr(self.text_encoder, "model", None)
        return inner if isinstance(inner, torch.nn.Module) else self.text_encoder

    def _tokens(self, prompts: list[str], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids, attention mask) of the chat-formatted prompts, each padded to
        ``length`` - diffusers' ``_get_mistral_3_small_prompt_embeds`` tokenization."""
        from diffusers.pipelines.flux2.pipeline_flux2 import format_input

        messages = (format_input(prompts=prompts) if self.system_message is None
                    else format_input(prompts=prompts, system_message=self.system_message))
        inputs = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=False,
            tokenize=True, return_dict=True, return_tensors="pt", padding="max_length",
            truncation=True, max_length=length,
        )
        return inputs["input_ids"], inputs["attention_mask"]

    def _encode_prompt(self, prompt: str, length: int) -> torch.Tensor:
        """(1, L, 3D) prompt embeddings."""
        return self._encode_prompts([prompt], length)[0]

    @torch.inference_mode()
    def _encode_prompts(self, prompts: list[str], length: int) -> list[torch.Tensor]:
        """``_encode_prompt`` of each prompt in one encoder pass: every prompt is padded to
        ``length`` and its padding masked, so a row does not depend on the other rows."""
        ids, mask = self._tokens(prompts, length)
        out = self.headless_encoder()(
            input_ids=token_ids(self.text_encoder, ids, self.device),
            attention_mask=upload(mask, self.device), output_hidden_states=True,
            use_cache=False,
        )
        # (B, layers, L, D) -> (B, L, layers * D): the layers side by side per token.
        stacked = torch.stack([out.hidden_states[k] for k in self.text_layers], dim=1)
        b, layers, tokens, width = stacked.shape
        embeds = stacked.permute(0, 2, 1, 3).reshape(b, tokens, layers * width).to(self.dtype)
        if len(prompts) == 1:
            return [embeds]
        return [embeds[i:i + 1].clone() for i in range(len(prompts))]

    def text_prompts(self, params: SamplingParams) -> list[str]:
        """The prompts ``prepare_encode`` encodes for ``params`` (the batched encode's input)."""
        return [params.prompt] + ([params.negative_prompt or ""] if self.uses_cfg(params) else [])

    def uses_cfg(self, params: SamplingParams) -> bool:
        """Whether the request adds negative-prompt rows ([dev]: true CFG only)."""
        return params.uses_true_cfg

    def cfg_scale(self, params: SamplingParams) -> float:
        return float(params.true_cfg_scale)

    def limits(self) -> ModelLimits:
        """FLUX.2's rope (Flux2PosEmbed) is computed from the token ids on the fly: no table
        bounds the size; reference images are bounded as diffusers checks them."""
        limits = ModelLimits.of_table(None, pixel_multiple=self.pixel_multiple,
                                      max_prompt_chars=self.max_prompt_chars,
                                      max_text_tokens=self.max_text_tokens)
        return dataclasses.replace(limits, min_condition_side=MIN_REFERENCE_SIDE,
                                   max_condition_aspect=MAX_REFERENCE_ASPECT)

    # -- token ids ---------------------------------------------------------------------------
    def _grid(self, height: int, width: int) -> tuple[int, int]:
        """Token rows and columns of a height x width image (one token per 2x2 latents)."""
        return height // self.pixel_multiple, width // self.pixel_multiple

    def _image_ids(self, rows: int, cols: int, time: int = 0) -> torch.Tensor:
        """(rows * cols, 4) position ids (time, row, column, 0), row-major as diffusers'."""
        key = ("image", rows, cols, time)
        if key not in self._ids:
            ids = torch.cartesian_prod(torch.tensor([time]), torch.arange(rows),
                                       torch.arange(cols), torch.arange(1))
            self._ids[key] = ids.to(self.device)
        return self._ids[key]

    def _text_ids(self, length: int) -> torch.Tensor:
        """(length, 4) position ids (0, 0, 0, token) of the text."""
        key = ("text", length)
        if key not in self._ids:
            ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1),
                                       torch.arange(length))
            self._ids[key] = ids.to(self.device)
        return self._ids[key]

    # -- reference images --------------------------------------------------------------------
    def _preprocess(self, state: DenoiseState) -> list[tuple[Hashable, torch.Tensor]]:
        """Each reference as (its size, (1, 3, H, W) pixels in [-1, 1]), in request order:
        checked (at least 64 pixels a side, aspect at most 8) and resized as diffusers does -
        capped at 1024x1024 pixels (aspect kept), cropped to a multiple of 16."""
        prepared: list[tuple[Hashable, torch.Tensor]] = []
        for image in state.params.images:
            pil = self.image_processor.check_image_input(to_pil(image))
            if pil.width * pil.height > MAX_REFERENCE_PIXELS:
                pil = self.image_processor._resize_to_target_area(pil, MAX_REFERENCE_PIXELS)
            width, height = reference_size(pil.width, pil.height, self.pixel_multiple)
            pixels = self.image_processor.preprocess(pil, height=height, width=width,
                                                     resize_mode="crop")
            prepared.append(((height, width), pixels))
        return prepared

    def condition_tokens(self, params: SamplingParams) -> int:
        """The references' tokens each row carries (the work rule's conditioning): each at
        its VAE size (``reference_size``) in 16-pixel tokens, all of them."""
        side = self.pixel_multiple
        return sum((w // side) * (h // side) for w, h in (
            reference_size(i.width, i.height, side) for i in params.images))

    @property
    def most_condition_tokens(self) -> int:
        """The most references, each at the area cap (1024x1024: 4096 tokens)."""
        return self.condition_images[1] * (MAX_REFERENCE_PIXELS // self.pixel_multiple ** 2)

    def _bn_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE's latent batch norm (mean, std) over the patchified channels."""
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps)
        return mean, std.to(like.device, like.dtype)

    @torch.inference_mode()
    def _vae_encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """(k, 3, H, W) pixels -> (k, 4C, h/2, w/2) normalised patchified latents (the mode)."""
        pixels = upload(pixels, self.device).to(self.vae.dtype)
        latents = self.vae.encode(pixels).latent_dist.mode()
        k, channels, lh, lw = latents.shape
        # (k, C, h, w) -> (k, 4C, h/2, w/2): channel-major 2x2 patches, as diffusers'.
        latents = latents.view(k, channels, lh // 2, 2, lw // 2, 2).permute(0, 1, 3, 5, 2, 4)
        latents = latents.reshape(k, channels * 4, lh // 2, lw // 2)
        mean, std = self._bn_stats(latents)
        return (latents - mean) / std

    @torch.inference_mode()
    def encode_conditions(self, states: Sequence[DenoiseState]) -> None:
        """The references of requests admitted together, one VAE forward per image size."""
        encode_each(states, prepare=self._preprocess, encode=self._vae_encode)

    def _reference_latents(self, state: DenoiseState) -> list[torch.Tensor]:
        encoded = take_encoded(state)
        if encoded is not None:
            return list(encoded)
        return [self._vae_encode(pixels) for _, pixels in self._preprocess(state)]

    # -- StepPipeline ------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare_encode(self, state: DenoiseState) -> None:
        p = state.params
        n = p.num_images
        references = self._reference_latents(state)
        length = p.max_sequence_length or self.max_sequence_length
        texts = [self._encode_prompt(p.prompt, length).repeat(n, 1, 1)]
        if self.uses_cfg(p):
            texts.append(self._encode_prompt(p.negative_prompt or "", length).repeat(n, 1, 1))
        state.rows = n * len(texts)
        state.static_rows = {"encoder_hidden_states": torch.cat(texts)}
        if self.guidance_embeds:
            state.static_rows["guidance"] = torch.full(
                (state.rows,), float(p.guidance_scale), device=self.device)
        rows, cols = self._grid(p.height, p.width)
        image_ids = [self._image_ids(rows, cols)]
        if references:
            tokens = []
            for index, latents in enumerate(references):
                _, channels, h, w = latents.shape
                tokens.append(latents.reshape(1, channels, h * w).permute(0, 2, 1))
                image_ids.append(self._image_ids(
                    h, w, REFERENCE_TIME_SCALE + REFERENCE_TIME_SCALE * index))
            packed = torch.cat(tokens, dim=1)  # (1, all references' tokens, 4C)
            state.static_rows[IMAGE_TOKENS] = packed.expand(state.rows, -1, -1).contiguous()
        state.shared = {"img_ids": torch.cat(image_ids), "txt_ids": self._text_ids(length)}
        # Same draw as diffusers: CPU generator, (n, 4C, h/2, w/2), then flattened to tokens.
        noise = seeded_noise((n, self.in_channels, rows, cols), seed=state.seed,
                             dtype=self.dtype, device=self.device)
        state.latents = noise.reshape(n, self.in_channels, rows * cols).permute(0, 2, 1)
        image_tokens = rows * cols
        state.schedule = self.sampler.schedule(
            p.num_inference_steps, image_tokens,
            mu=empirical_mu(image_tokens, p.num_inference_steps))
        state.step_index = 0

    # -- denoise ------------------------------------------------------------------------------
    @torch.inference_mode()
    def denoise_step(self, batch: InputBatch) -> torch.Tensor:
        hidden = batch.hidden_states
        references = batch.static.get(IMAGE_TOKENS)
        if references is not None:
            # (rows, target, 4C) + (rows, references, 4C) -> (rows, target + references, 4C)
            hidden = torch.cat([hidden, references.to(hidden.dtype)], dim=1)
        # diffusers casts the timestep to the latents' dtype before dividing by 1000.
        timestep = batch.timesteps.to(self.device, hidden.dtype) / 1000
        guidance = batch.static["guidance"] if self.guidance_embeds else None
        out = self.transformer(
            hidden_states=hidden.to(self.dtype),
            timestep=timestep,
            guidance=guidance,
            encoder_hidden_states=batch.static["encoder_hidden_states"],
            txt_ids=batch.shared["txt_ids"],
            img_ids=batch.shared["img_ids"],
            return_dict=False,
        )[0]
        return out[:, : batch.hidden_states.shape[1]]  # the target tokens' prediction

    def step(self, state: DenoiseState, output_rows: torch.Tensor) -> None:
        p = state.params
        guided_step(state, output_rows, self.cfg_scale(p) if self.uses_cfg(p) else None)

    # -- decode -------------------------------------------------------------------------------
    @torch.inference_mode()
    def post_decode(self, state: DenoiseState) -> None:
        assert state.latents is not None
        p = state.params
        rows, cols = self._grid(p.height, p.width)
        n, _, channels = state.latents.shape
        # (n, tokens, 4C) -> (n, 4C, h/2, w/2): the tokens are row-major (diffusers scatters
        # them by their ids, which lands them in the same places).
        latents = state.latents.permute(0, 2, 1).reshape(n, channels, rows, cols)
        mean, std = self._bn_stats(latents)
        latents = latents * std + mean
        # (n, 4C, h/2, w/2) -> (n, C, h, w): undo the 2x2 patches.
        latents = latents.reshape(n, channels // 4, 2, 2, rows, cols).permute(0, 1, 4, 2, 5, 3)
        latents = latents.reshape(n, channels // 4, rows * 2, cols * 2)
        decoded = self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]
        pixels = (decoded.float() / 2 + 0.5).clamp(0, 1)  # (n, 3, H, W) in [0, 1]
        # From CUDA, non_blocking lands in pinned memory without a host sync; the pixels are
        # valid once the step's queued work has finished (the runner waits for that).
        state.pixels = pixels.to("cpu", non_blocking=True)
