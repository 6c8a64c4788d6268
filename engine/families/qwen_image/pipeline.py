"""Step-wise Qwen-Image (the family's diffusers pipeline layout) on top of diffusers components.

Matches the family's diffusers pipeline numerically for the same seed: the prompt goes through
the same chat template into Qwen2.5-VL, whose last hidden states (template prefix dropped)
are the text tokens; the noise is drawn the same way (CPU generator, (n, 1, C, h, w), 2x2
packing); the schedule is the same resolution-shifted flow-matching one (the Euler sampler
shared with Flux), and true CFG combines as diffusers does, including its rescale of the
guided prediction to the norm of the conditional one.

Differences, on purpose: the negative-prompt rows run in the same forward as the positive
rows (streamed weights cross PCIe once per step), every row carries its own timestep so
requests at different steps share a forward, and prompts of different lengths share a batch
as right-padded rows with a text mask (diffusers' own masking of padded text tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ditserve.engine.errors import ModelLoadError
from ditserve.engine.families import QWEN_IMAGE
from ditserve.engine.pipeline_defaults import call_defaults
from ditserve.engine.pipelines.common import latent_statistics, seeded_noise, upload
from ditserve.engine.pipelines.guidance import guided_step
from ditserve.engine.pipelines.host_embedding import token_ids
from ditserve.engine.request import ModelLimits, SamplingParams
from ditserve.engine.step.denoise_state import DenoiseState
from ditserve.engine.step.sampler import FlowMatchEulerSampler

if TYPE_CHECKING:
    from ditserve.engine.step.input_batch import InputBatch
    from ditserve.engine.weights.loader import LoadedComponents

# Text tokens a prompt may keep: the pipeline's default 512 (diffusers accepts up to 1024,
# but the rope table puts the text after the image, so the size bound below assumes 512).
MAX_TEXT_TOKENS = 512


class QwenImageStepPipeline:
    """StepPipeline for Qwen-Image (see module docstring)."""

    family = QWEN_IMAGE
    encoder_keeps_hidden_states = True  # the prompt is read off every layer's hidden state

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
        if self.transformer.config.guidance_embeds:
            raise ModelLoadError("guidance-distilled Qwen-Image DiTs (guidance_embeds) are not "
                                 "served; ditserve serves Qwen-Image with true CFG")
        self.block_lists = QWEN_IMAGE.block_lists
        self.frame_step: int | None = None  # an image family
        self.dtype: torch.dtype = next(self.transformer.parameters()).dtype
        self.sampler = FlowMatchEulerSampler(m["scheduler"].config)
        # Layout constants from diffusers' own pipeline object, not copied here.
        pipe = components.pipeline
        self.template: str = pipe.prompt_template_encode
        self.template_drop: int = int(pipe.prompt_template_encode_start_idx)
        self.tokenizer_max_length = int(pipe.tokenizer_max_length)
        # Text tokens kept per prompt: the pipeline's own default max_sequence_length (512);
        # a request may ask for fewer.
        self.max_sequence_length = int(
            call_defaults(components.pipeline_class)["max_sequence_length"])
        self.max_text_tokens = MAX_TEXT_TOKENS
        self.vae_scale_factor = 2 ** len(self.vae.temperal_downsample)
        self.pixel_multiple = self.vae_scale_factor * 2  # 2x2 packing of the latent grid
        self.max_prompt_chars: int | None = 4000
        self.latent_channels = int(self.transformer.config.in_channels) // 4
        self._latents_mean, self._latents_inv_std = latent_statistics(self.vae, device)

    # -- encode ------------------------------------------------------------------------------
    def _encode_prompt(self, prompt: str, length: int) -> torch.Tensor:
        """(1, L, D) text tokens: Qwen2.5-VL's last hidden states after the template prefix."""
        return self._encode_prompts([prompt], length)[0]

    @torch.inference_mode()
    def _encode_prompts(self, prompts: list[str], length: int) -> list[torch.Tensor]:
        """``_encode_prompt`` of each prompt in one encoder pass. The batch is padded on the
        right to its longest prompt; the encoder is causal, so a prompt's tokens never see
        the padding after them, and each row keeps only its own tokens (by its mask, as
        diffusers' ``_extract_masked_hidden``) - the lengths differ per prompt."""
        tokens = self.tokenizer(
            [self.template.format(p) for p in prompts],
            max_length=self.tokenizer_max_length + self.template_drop,
            padding=True, truncation=True, return_tensors="pt", padding_side="right",
        )
        out = self.headless_encoder()(
            input_ids=token_ids(self.text_encoder, tokens.input_ids, self.device),
            attention_mask=upload(tokens.attention_mask, self.device),
            output_hidden_states=True,
        )
        hidden = out.hidden_states[-1].to(self.text_encoder.dtype)
        # Host tensors: each row's own length without a device sync.
        lengths = tokens.attention_mask.sum(dim=1).tolist()
        rows = [hidden[i:i + 1, self.template_drop:int(n)][:, :length]
                for i, n in enumerate(lengths)]
        return rows if len(prompts) == 1 else [row.clone() for row in rows]

    def headless_encoder(self) -> torch.nn.Module:
        """Qwen2.5-VL without its LM head (``.model``): the pipeline reads hidden states
        only, and the head would compute 152k logits per token from 1.09 GB of weights (which
        a streamed encoder therefore keeps in host memory). The states are the same."""
        inner = getattr(self.text_encoder, "model", None)
        return inner if isinstance(inner, torch.nn.Module) else self.text_encoder

    def text_prompts(self, params: SamplingParams) -> list[str]:
        """The prompts ``prepare_encode`` encodes for ``params`` (the batched encode's input)."""
        return [params.prompt] + ([params.negative_prompt or ""] if params.uses_true_cfg else [])

    def limits(self) -> ModelLimits:
        """QwenEmbedRope's table holds ``len(pos_freqs)`` positions; it centres the image on
        it (half a side each way) and puts the text right after the image's half side, so a
        side of 2 * (positions - text tokens) latent patches is the most it reaches."""
        positions = int(self.transformer.pos_embed.pos_freqs.shape[0]) - MAX_TEXT_TOKENS
        # A token is one pixel multiple (2x2 packed latents); a position covers 2 tokens.
        return ModelLimits.of_table(positions, pixel_multiple=self.pixel_multiple,
                                    tokens_per_position=2,
                                    max_prompt_chars=self.max_prompt_chars,
                                    max_text_tokens=self.max_text_tokens)

    def _latent_grid(self, height: int, width: int) -> tuple[int, int]:
        return (2 * (height // self.pixel_multiple), 2 * (width // self.pixel_multiple))

    @torch.inference_mode()
    def prepare_encode(self, state: DenoiseState) -> None:
        p = state.params
        length = p.max_sequence_length or self.max_sequence_length
        positive = self._encode_prompt(p.prompt, length)
        negative = (self._encode_prompt(p.negative_prompt or "", length)
                    if p.uses_true_cfg else None)
        self._prepare_rows(state, positive, negative)

    def _prepare_rows(self, state: DenoiseState, positive: torch.Tensor,
                      negative: torch.Tensor | None) -> None:
        """The request's text rows (``n`` positive, then ``n`` negative under true CFG), its
        initial latents and its schedule, from its (1, L, D) prompt encodings."""
        p = state.params
        n = p.num_images
        texts = [positive] * n + ([negative] * n if negative is not None else [])
        longest = max(t.shape[1] for t in texts)
        # (rows, L, D) right-padded to this request's longest prompt, with (rows, L) mask.
        embeds = torch.zeros(len(texts), longest, texts[0].shape[2], dtype=texts[0].dtype,
                             device=self.device)
        mask = torch.zeros(len(texts), longest, dtype=torch.bool, device=self.device)
        for row, text in enumerate(texts):
            embeds[row, : text.shape[1]] = text[0]
            mask[row, : text.shape[1]] = True
        state.rows = len(texts)
        state.static_rows = {"encoder_hidden_states": embeds, "text_mask": mask}
        state.host["text_lengths"] = tuple(t.shape[1] for t in texts)
        lh, lw = self._latent_grid(p.height, p.width)
        # Same draw as diffusers: CPU generator, (n, 1, C, h, w), then packed.
        noise = seeded_noise((n, 1, self.latent_channels, lh, lw), seed=state.seed,
                             dtype=self.text_encoder.dtype, device=self.device)
        # (n, 1, C, h, w) -> (n, h/2 * w/2, 4C): 2x2 patches become tokens.
        packed = noise.view(n, self.latent_channels, lh // 2, 2, lw // 2, 2)
        packed = packed.permute(0, 2, 4, 1, 3, 5)
        state.latents = packed.reshape(n, (lh // 2) * (lw // 2), self.latent_channels * 4)
        state.schedule = self.sampler.schedule(p.num_inference_steps, state.latents.shape[1])
        state.step_index = 0

    # -- denoise ------------------------------------------------------------------------------
    @torch.inference_mode()
    def denoise_step(self, batch: InputBatch) -> torch.Tensor:
        lh, lw = self._latent_grid(batch.states[0].params.height, batch.states[0].params.width)
        return self._predict(batch, batch.hidden_states, [(1, lh // 2, lw // 2)])

    def _predict(self, batch: InputBatch, hidden: torch.Tensor,
                 shapes: list[tuple[int, int, int]]) -> torch.Tensor:
        """The DiT's output for ``hidden`` (rows, tokens, 4C): every row's image tokens are
        the grids ``shapes`` (frames, h, w) one after another."""
        lengths = {n for s in batch.states for n in s.host["text_lengths"]}
        # Equal text lengths need no mask (as diffusers, which drops an all-true one; and on
        # CUDA a masked attention cannot take the flash kernel).
        mask = batch.static["text_mask"] if len(lengths) > 1 else None
        # diffusers casts the timestep to the latents' dtype before dividing by 1000.
        timestep = batch.timesteps.to(self.device, batch.hidden_states.dtype) / 1000
        return self.transformer(
            hidden_states=hidden,
            timestep=timestep,
            encoder_hidden_states=batch.static["encoder_hidden_states"],
            encoder_hidden_states_mask=mask,
            img_shapes=[list(shapes)] * batch.num_rows,
            return_dict=False,
        )[0]

    def step(self, state: DenoiseState, output_rows: torch.Tensor) -> None:
        p = state.params
        # diffusers rescales the guided prediction to the conditional one's norm per token.
        guided_step(state, output_rows, p.true_cfg_scale if p.uses_true_cfg else None,
                    renorm=True)

    # -- decode -------------------------------------------------------------------------------
    @torch.inference_mode()
    def post_decode(self, state: DenoiseState) -> None:
        assert state.latents is not None
        p = state.params
        lh, lw = self._latent_grid(p.height, p.width)
        n, _, channels = state.latents.shape
        # (n, h/2 * w/2, 4C) -> (n, C, 1, h, w): undo the 2x2 packing; one "frame".
        latents = state.latents.view(n, lh // 2, lw // 2, channels // 4, 2, 2)
        latents = latents.permute(0, 3, 1, 4, 2, 5).reshape(n, channels // 4, 1, lh, lw)
        latents = latents.to(self.vae.dtype) / self._latents_inv_std + self._latents_mean
        decoded = self.vae.decode(latents, return_dict=False)[0][:, :, 0]
        pixels = (decoded.float() / 2 + 0.5).clamp(0, 1)  # (n, 3, H, W) in [0, 1]
        state.pixels = pixels.to("cpu", non_blocking=True)
