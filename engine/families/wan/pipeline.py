"""Step-wise Wan 2.x text-to-video (the family's diffusers pipeline layout) on top of diffusers components.

One module serves the family's layouts: Wan 2.1 T2V (one DiT), Wan 2.2 T2V A14B (two
experts: ``transformer`` for timesteps at or above ``boundary_ratio * num_train_timesteps``,
``transformer_2`` below) and Wan 2.2 TI2V-5B (one DiT, ``expand_timesteps``: a timestep per
latent token). It matches the family's diffusers pipeline numerically for the same seed: the same
prompt cleaning and UMT5 encoding (zeros past the prompt's tokens), the same float32 noise
(CPU generator, (n, C, frames, h, w)), the model's own scheduler (UniPC in the released
checkpoints) and the same CFG combine.

Differences, on purpose: CFG's negative-prompt rows run in the same forward as the positive
ones; requests at different steps share a forward (each row has its own timestep; each
request owns its scheduler object, since UniPC keeps a history); and a batch whose requests
sit on both sides of Wan 2.2's boundary runs one forward per expert over that expert's rows,
expert 1 then expert 2 - both streamed through the same offload slots. Rows are independent
in every layer, so a request's output equals its output alone.

Pixels are (n, F, 3, H, W) float in [0, 1] (n videos of F frames).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ditserve.engine.adapters import rows as adapter_rows
from ditserve.engine.errors import ModelLoadError
from ditserve.engine.families import WAN
from ditserve.engine.families.wan.block import chunk_token_math
from ditserve.engine.pipeline_defaults import call_defaults
from ditserve.engine.pipelines.common import (
    decode_normalized_video,
    latent_statistics,
    seeded_noise,
    upload,
)
from ditserve.engine.pipelines.experts import ExpertStack
from ditserve.engine.pipelines.guidance import guided_step
from ditserve.engine.pipelines.host_embedding import token_ids
from ditserve.engine.request import ModelLimits, SamplingParams
from ditserve.engine.step.denoise_state import DenoiseState
from ditserve.engine.step.sampler import SchedulerTrajectory
from ditserve.engine.step_cache.rows import forward_rows

if TYPE_CHECKING:
    from ditserve.engine.step.input_batch import InputBatch
    from ditserve.engine.weights.loader import LoadedComponents

MAX_TEXT_TOKENS = 512  # the released Wan models' text length (UMT5, 512 tokens)


class WanStepPipeline:
    """StepPipeline for Wan 2.1 / 2.2 text-to-video (see module docstring)."""

    family = WAN

    def __init__(
        self, components: LoadedComponents, *, device: torch.device, move_transformer: bool = True
    ) -> None:
        m = components.modules
        self.device = device
        # The loader lists transformer_2 only when boundary_ratio is set (diffusers never runs
        # it otherwise).
        experts = {name: m[name] for name in components.dit_components}
        ratio = components.config.get("boundary_ratio")
        if len(experts) == 1 and ratio is not None:
            raise ModelLoadError("the model sets boundary_ratio but has no transformer_2 expert")
        self.experts = list(experts.values())
        for expert in self.experts:
            # diffusers' block math with its token-wise parts in slices: about half the
            # activation memory at video token counts (engine/families/wan/block.py).
            chunk_token_math(expert)
        if len(experts) > 1:
            stack = ExpertStack(experts)
            self.transformer: torch.nn.Module = stack
            self.block_lists = stack.block_lists(WAN.block_lists)
        else:
            self.transformer = self.experts[0]
            self.block_lists = WAN.block_lists
        self.scheduler = m["scheduler"]
        self.boundary: float | None = (
            None if len(self.experts) == 1
            else float(ratio) * float(self.scheduler.config.num_train_timesteps)
        )
        self.expand_timesteps = bool(components.config.get("expand_timesteps", False))
        self.vae = m["vae"].to(device)
        self.text_encoder = m["text_encoder"]
        self.tokenizer = m["tokenizer"]
        if move_transformer:
            self.transformer.to(device)
        # The DiT's compute dtype: diffusers' ModelMixin.dtype skips the modules Wan keeps in
        # float32 (rope, time embedder, norms, scale-shift tables), whose parameters may come
        # first - in bf16 serving the patch embedding would otherwise get float32 latents.
        self.dtype: torch.dtype = self.experts[0].dtype
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        self._prompt_clean = prompt_clean  # diffusers' own cleaning (html, whitespace, ftfy)
        # UMT5 tokens per prompt: the diffusers pipeline's own default (512), whatever the tokenizer
        # says; a request may ask for another length up to 512, the released models' length.
        self.max_sequence_length = int(
            call_defaults(components.pipeline_class)["max_sequence_length"])
        self.max_text_tokens = MAX_TEXT_TOKENS
        self.max_prompt_chars: int | None = 4000
        self.patch = tuple(self.experts[0].config.patch_size)  # (t, h, w)
        self.frame_step: int | None = int(self.vae.config.scale_factor_temporal)
        self.spatial_factor = int(self.vae.config.scale_factor_spatial)
        self.pixel_multiple = self.spatial_factor * int(self.patch[1])
        self.latent_channels = int(self.experts[0].config.in_channels)
        self._latents_mean, self._latents_inv_std = latent_statistics(self.vae, device)

    # -- encode ------------------------------------------------------------------------------
    def _encode_prompt(self, prompt: str, length: int) -> torch.Tensor:
        """(1, L, D) UMT5 states, zeroed past the prompt's own tokens (as diffusers)."""
        return self._encode_prompts([prompt], length)[0]

    @torch.inference_mode()
    def _encode_prompts(self, prompts: list[str], length: int) -> list[torch.Tensor]:
        """``_encode_prompt`` of each prompt in one encoder pass: every prompt is padded to
        ``length`` with its attention mask, as alone, and zeroed past its own tokens."""
        tokens = self.tokenizer(
            [self._prompt_clean(p) for p in prompts], padding="max_length",
            max_length=length, truncation=True, add_special_tokens=True,
            return_attention_mask=True, return_tensors="pt",
        )
        lengths = tokens.attention_mask.sum(dim=1).tolist()  # host tensors: no device sync
        states = self.text_encoder(
            token_ids(self.text_encoder, tokens.input_ids, self.device),
            upload(tokens.attention_mask, self.device)
        ).last_hidden_state.to(self.text_encoder.dtype)
        embeds = torch.zeros_like(states)
        for row, n in enumerate(lengths):
            embeds[row, :int(n)] = states[row, :int(n)]
        embeds = embeds.to(self.dtype)
        return [embeds[i:i + 1] if len(prompts) == 1 else embeds[i:i + 1].clone()
                for i in range(len(prompts))]

    def text_prompts(self, params: SamplingParams) -> list[str]:
        """The prompts ``prepare_encode`` encodes for ``params`` (the batched encode's input):
        CFG whenever guidance > 1, as diffusers' pipeline."""
        cfg = params.guidance_scale > 1.0
        return [params.prompt] + ([params.negative_prompt or ""] if cfg else [])

    def limits(self) -> ModelLimits:
        """diffusers' WanRotaryPosEmbed holds ``rope_max_seq_len`` positions per axis, in
        patches: a latent grid of more patches per axis (frames / patch_t, height and width /
        patch) gets a shorter table than the tokens and fails in the forward."""
        return ModelLimits.of_table(
            int(self.experts[0].config.rope_max_seq_len), pixel_multiple=self.pixel_multiple,
            frame_step=self.frame_step, frames_per_position=int(self.patch[0]),
            max_prompt_chars=self.max_prompt_chars,
            max_text_tokens=self.max_text_tokens)

    def latent_shape(self, n: int, num_frames: int, height: int, width: int) -> tuple[int, ...]:
        frames = (num_frames - 1) // int(self.frame_step or 1) + 1
        return (n, self.latent_channels, frames, height // self.spatial_factor,
                width // self.spatial_factor)

    @torch.inference_mode()
    def prepare_encode(self, state: DenoiseState) -> None:
        p = state.params
        n = p.num_images
        cfg = p.guidance_scale > 1.0  # as diffusers' pipeline: CFG whenever guidance > 1
        length = p.max_sequence_length or self.max_sequence_length
        texts = [self._encode_prompt(p.prompt, length)] * n
        if cfg:
            texts += [self._encode_prompt(p.negative_prompt or "", length)] * n
        state.rows = len(texts)
        state.host["cfg"] = cfg
        state.static_rows = {"encoder_hidden_states": torch.cat(texts)}
        # Same draw as diffusers: float32 on a CPU generator, then moved.
        state.latents = seeded_noise(self.latent_shape(n, p.num_frames, p.height, p.width),
                                     seed=state.seed, dtype=torch.float32, device=self.device)
        state.schedule = SchedulerTrajectory(type(self.scheduler), self.scheduler.config,
                                             p.num_inference_steps)
        state.step_index = 0

    # -- denoise ------------------------------------------------------------------------------
    def expert_of(self, state: DenoiseState) -> int:
        """0 for the (high-noise) first DiT, 1 for Wan 2.2's low-noise expert."""
        if self.boundary is None or state.current_timestep() >= self.boundary:
            return 0
        return 1

    def _forward(self, expert: int, hidden: torch.Tensor, timesteps: torch.Tensor,
                 text: torch.Tensor) -> torch.Tensor:
        timestep = timesteps.to(self.device)
        if self.expand_timesteps:
            # (rows,) -> (rows, tokens): TI2V takes one timestep per latent token (all equal
            # for text-to-video), as diffusers' mask * t.
            tokens = hidden.shape[2] * (hidden.shape[3] // self.patch[1]) * (
                hidden.shape[4] // self.patch[2])
            timestep = timestep[:, None].expand(hidden.shape[0], tokens)
        return self.experts[expert](
            hidden_states=hidden.to(self.dtype), timestep=timestep,
            encoder_hidden_states=text, return_dict=False,
        )[0]

    @torch.inference_mode()
    def denoise_step(self, batch: InputBatch) -> torch.Tensor:
        text = batch.static["encoder_hidden_states"]
        experts = [self.expert_of(s) for s in batch.states]
        if len(set(experts)) == 1:
            return self._forward(experts[0], batch.hidden_states, batch.timesteps, text)
        # Straddling the boundary: one forward per expert over its requests' rows, in expert
        # order (the order offload streams them), scattered back into batch order.
        out: torch.Tensor | None = None
        for expert in sorted(set(experts)):
            slices = [sl for sl, e in zip(batch.row_slices, experts, strict=True) if e == expert]
            with forward_rows(slices), adapter_rows.narrowed(slices):  # step cache, LoRA rows
                rows = self._forward(
                    expert,
                    torch.cat([batch.hidden_states[sl] for sl in slices]),
                    torch.cat([batch.timesteps[sl] for sl in slices]),
                    torch.cat([text[sl] for sl in slices]),
                )
            if out is None:
                out = rows.new_empty((batch.num_rows, *rows.shape[1:]))
            start = 0
            for sl in slices:
                size = sl.stop - sl.start
                out[sl] = rows[start : start + size]
                start += size
        assert out is not None
        return out

    def step(self, state: DenoiseState, output_rows: torch.Tensor) -> None:
        guided_step(state, output_rows,
                    state.params.guidance_scale if state.host["cfg"] else None)

    # -- decode -------------------------------------------------------------------------------
    @torch.inference_mode()
    def post_decode(self, state: DenoiseState) -> None:
        assert state.latents is not None
        state.pixels = decode_normalized_video(self.vae, state.latents, self._latents_mean,
                                               self._latents_inv_std)
