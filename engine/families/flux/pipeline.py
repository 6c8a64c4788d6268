"""Step-wise Flux (the family's diffusers pipeline layout) on top of diffusers components.

Matches the family's diffusers pipeline numerically for the same seed: the same prompt encoding
(CLIP pooled + T5 sequence), the same initial noise draw (a CPU generator seeded with the
request's seed, shape (n, C, h, w), then 2x2 packing), the same schedule and Euler update, the
same decode. Differences are on purpose: true CFG runs the negative-prompt rows in the same
forward as the positive rows (weights are read once per step, which matters when they stream
over PCIe), and every row carries its own timestep and guidance value so requests at
different steps share one forward.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch

from ditserve.engine.families import FLUX
from ditserve.engine.pipeline_defaults import call_defaults
from ditserve.engine.pipelines.common import seeded_noise, upload
from ditserve.engine.pipelines.guidance import guided_step
from ditserve.engine.pipelines.host_embedding import token_ids
from ditserve.engine.request import ModelLimits, SamplingParams
from ditserve.engine.step.denoise_state import DenoiseState
from ditserve.engine.step.sampler import FlowMatchEulerSampler

if TYPE_CHECKING:
    from ditserve.engine.step.input_batch import InputBatch
    from ditserve.engine.weights.loader import LoadedComponents

MAX_T5_TOKENS = 512  # the diffusers pipeline refuses more


class FluxStepPipeline:
    """StepPipeline for Flux.1-style models (see module docstring)."""

    family = FLUX

    def __init__(
        self, components: LoadedComponents, *, device: torch.device, move_transformer: bool = True
    ) -> None:
        m = components.modules
        self.device = device
        self.transformer = m["transformer"]
        self.vae = m["vae"].to(device)
        self.text_encoder = m["text_encoder"]
        self.text_encoder_2 = m["text_encoder_2"]
        self.tokenizer = m["tokenizer"]
        self.tokenizer_2 = m["tokenizer_2"]
        if move_transformer:
            self.transformer.to(device)
        self.dtype: torch.dtype = next(self.transformer.parameters()).dtype
        self.block_lists = FLUX.block_lists
        self.frame_step: int | None = None  # an image family
        self.sampler = FlowMatchEulerSampler(m["scheduler"].config)
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        # 2x2 latent packing: pixel sizes must divide by twice the VAE factor.
        self.pixel_multiple = self.vae_scale_factor * 2
        self.clip_max_length = int(getattr(self.tokenizer, "model_max_length", 77))
        # T5 tokens per prompt: the diffusers pipeline's own default (512), whatever the tokenizer says;
        # a request may ask for fewer (``max_sequence_length``), never more than 512.
        self.max_sequence_length = int(
            call_defaults(components.pipeline_class)["max_sequence_length"])
        self.max_text_tokens = MAX_T5_TOKENS
        self.max_prompt_chars: int | None = 4000
        self.latent_channels = int(self.transformer.config.in_channels) // 4
        self.guidance_embeds = bool(self.transformer.config.guidance_embeds)
        self._img_ids: dict[tuple[int, int], torch.Tensor] = {}
        self._txt_ids: torch.Tensor | None = None

    # -- encode ------------------------------------------------------------------------------
    def _encode_prompt(self, prompt: str, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(1, L, D) T5 sequence embeddings and (1, P) CLIP pooled embeddings."""
        return self._encode_prompts([prompt], length)[0]

    @torch.inference_mode()
    def _encode_prompts(self, prompts: list[str], length: int,
                        ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``_encode_prompt`` of each prompt, in one pass of each encoder: both pad every
        prompt to a fixed length (CLIP's 77, T5's ``length``) and Flux passes no attention
        mask, so a row's embedding does not depend on the other rows."""
        clip_ids = self.tokenizer(
            prompts, padding="max_length", max_length=self.clip_max_length,
            truncation=True, return_tensors="pt",
        ).input_ids
        pooled = self.text_encoder(upload(clip_ids, self.device), output_hidden_states=False).pooler_output
        t5_ids = self.tokenizer_2(
            prompts, padding="max_length", max_length=length,
            truncation=True, return_tensors="pt",
        ).input_ids
        seq = self.text_encoder_2(token_ids(self.text_encoder_2, t5_ids, self.device),
                                  output_hidden_states=False)[0]
        seq, pooled = seq.to(self.dtype), pooled.to(self.dtype)
        if len(prompts) == 1:
            return [(seq, pooled)]
        # Own storage per row: a cached row must not keep the whole batch alive.
        return [(seq[i:i + 1].clone(), pooled[i:i + 1].clone()) for i in range(len(prompts))]

    def text_prompts(self, params: SamplingParams) -> list[str]:
        """The prompts ``prepare_encode`` encodes for ``params`` (the batched encode's input)."""
        return [params.prompt] + ([params.negative_prompt or ""] if params.uses_true_cfg else [])

    def limits(self) -> ModelLimits:
        """Flux's rope (FluxPosEmbed) is computed from the token ids on the fly: no table
        bounds the size; the schedule's resolution shift does (a square of that side is
        the most tokens it computes a shift for)."""
        limits = ModelLimits.of_table(None, pixel_multiple=self.pixel_multiple,
                                      max_prompt_chars=self.max_prompt_chars,
                                      max_text_tokens=self.max_text_tokens)
        tokens = self.sampler.max_tokens
        if tokens is None:
            return limits
        side = math.isqrt(tokens) * self.pixel_multiple
        return dataclasses.replace(limits, max_side=min(limits.max_side, side))

    def _latent_grid(self, height: int, width: int) -> tuple[int, int]:
        return (
            2 * (height // (self.vae_scale_factor * 2)),
            2 * (width // (self.vae_scale_factor * 2)),
        )

    def _image_ids(self, lh: int, lw: int) -> torch.Tensor:
        key = (lh, lw)
        if key not in self._img_ids:
            ids = torch.zeros(lh // 2, lw // 2, 3)
            ids[..., 1] = ids[..., 1] + torch.arange(lh // 2)[:, None]
            ids[..., 2] = ids[..., 2] + torch.arange(lw // 2)[None, :]
            self._img_ids[key] = ids.reshape(-1, 3).to(self.device, self.dtype)
        return self._img_ids[key]

    @torch.inference_mode()
    def prepare_encode(self, state: DenoiseState) -> None:
        p = state.params
        n = p.num_images
        length = p.max_sequence_length or self.max_sequence_length
        seq, pooled = self._encode_prompt(p.prompt, length)
        seqs, pooleds = [seq.repeat(n, 1, 1)], [pooled.repeat(n, 1)]
        if p.uses_true_cfg:
            neg_seq, neg_pooled = self._encode_prompt(p.negative_prompt or "", length)
            seqs.append(neg_seq.repeat(n, 1, 1))
            pooleds.append(neg_pooled.repeat(n, 1))
        rows = state.rows
        state.static_rows = {
            "encoder_hidden_states": torch.cat(seqs),
            "pooled_projections": torch.cat(pooleds),
            "guidance": torch.full((rows,), float(p.guidance_scale), device=self.device),
        }
        lh, lw = self._latent_grid(p.height, p.width)
        state.shared = {"img_ids": self._image_ids(lh, lw), "txt_ids": self._text_ids(seq.shape[1])}
        # Same draw as diffusers: CPU generator, (n, C, h, w), then moved and packed.
        noise = seeded_noise((n, self.latent_channels, lh, lw), seed=state.seed,
                             dtype=self.dtype, device=self.device)
        # (n, C, h, w) -> (n, h/2 * w/2, 4C): 2x2 patches become tokens.
        packed = noise.view(n, self.latent_channels, lh // 2, 2, lw // 2, 2)
        packed = packed.permute(0, 2, 4, 1, 3, 5)
        state.latents = packed.reshape(n, (lh // 2) * (lw // 2), self.latent_channels * 4)
        state.schedule = self.sampler.schedule(p.num_inference_steps, state.latents.shape[1])
        state.step_index = 0

    # -- denoise ------------------------------------------------------------------------------
    @torch.inference_mode()
    def denoise_step(self, batch: InputBatch) -> torch.Tensor:
        return self._predict(batch, batch.hidden_states)

    def _predict(self, batch: InputBatch, hidden: torch.Tensor) -> torch.Tensor:
        """The DiT's prediction for ``hidden`` (the rows' image tokens, and any extra tokens a
        subclass appends) with the batch's text, timesteps and guidance."""
        # diffusers casts the timestep to the latents' dtype before dividing by 1000.
        timestep = batch.timesteps.to(self.device, hidden.dtype) / 1000
        guidance = batch.static["guidance"] if self.guidance_embeds else None
        return self.transformer(
            hidden_states=hidden,
            timestep=timestep,
            guidance=guidance,
            pooled_projections=batch.static["pooled_projections"],
            encoder_hidden_states=batch.static["encoder_hidden_states"],
            txt_ids=batch.shared["txt_ids"],
            img_ids=batch.shared["img_ids"],
            return_dict=False,
        )[0]

    def _text_ids(self, length: int) -> torch.Tensor:
        if self._txt_ids is None or self._txt_ids.shape[0] != length:
            self._txt_ids = torch.zeros(length, 3, device=self.device, dtype=self.dtype)
        return self._txt_ids

    def step(self, state: DenoiseState, output_rows: torch.Tensor) -> None:
        p = state.params
        guided_step(state, output_rows, p.true_cfg_scale if p.uses_true_cfg else None)

    # -- decode -------------------------------------------------------------------------------
    @torch.inference_mode()
    def post_decode(self, state: DenoiseState) -> None:
        assert state.latents is not None
        p = state.params
        lh, lw = self._latent_grid(p.height, p.width)
        n, _, channels = state.latents.shape
        # (n, h/2 * w/2, 4C) -> (n, C, h, w): undo the 2x2 packing.
        latents = state.latents.view(n, lh // 2, lw // 2, channels // 4, 2, 2)
        latents = latents.permute(0, 3, 1, 4, 2, 5).reshape(n, channels // 4, lh, lw)
        latents = latents / self.vae.config.scaling_factor + self.vae.config.shift_factor
        decoded = self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]
        pixels = (decoded.float() / 2 + 0.5).clamp(0, 1)  # (n, 3, H, W) in [0, 1]
        # From CUDA, non_blocking lands in pinned memory without a host sync; the pixels are
        # valid once the step's queued work has finished (the runner waits for that).
        state.pixels = pixels.to("cpu", non_blocking=True)
