"""Step-wise Z-Image (the family's diffusers pipeline layout) on top of diffusers components.

Matches the family's diffusers pipeline numerically for the same seed: the prompt goes
through the tokenizer's own chat template into Qwen3, whose second-to-last hidden states at
the prompt's real tokens are its caption; the noise is drawn the same way (CPU generator,
(n, C, h, w), float32 latents throughout); the schedule is the same flow-matching one (the
Euler sampler shared with Flux); the DiT gets the timestep as ``(1000 - t) / 1000`` and its
prediction is negated before the step; classifier-free guidance runs whenever
``guidance_scale`` > 0 and combines as ``pos + g * (pos - neg)``.

Differences, on purpose: the negative-prompt rows run in the same forward as the positive
rows (streamed weights cross PCIe once per step), every row carries its own timestep so
requests at different steps share a forward, and prompts of different lengths share a
forward - the DiT takes one caption tensor per row (its list interface) and pads and masks
them itself, so each row gets only its own caption's tokens.

With a source image (``/v1/images/edits``, ``generate --image``) it runs diffusers'
image-to-image pipeline, and with a mask too its inpainting pipeline, on the same denoise
(``engine.families.z_image.source``): one replica serves generations and edits.

Not served: diffusers' ``cfg_normalization`` and ``cfg_truncation`` call options (their
defaults - off, and a truncation of 1.0, which never truncates - are what runs).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ditserve.engine.families import Z_IMAGE
from ditserve.engine.families.z_image.source import MASK_KEY, SourceImages
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

MAX_TEXT_TOKENS = 512  # the pipeline's default max_sequence_length
# The pipelines a source image (and a mask) selects: their call defaults give the strength.
IMAGE_TO_IMAGE, INPAINT = "ZImageImg2ImgPipeline", "ZImageInpaintPipeline"
TIME_SCALE = 1000.0  # diffusers feeds the DiT (1000 - t) / 1000


class ZImageStepPipeline:
    """StepPipeline for Z-Image-Turbo and Base (see module docstring)."""

    family = Z_IMAGE

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
        self.block_lists = Z_IMAGE.block_lists
        # The step cache reuses the main layers' residual (image and caption tokens in one
        # stream); the refiners, 4 of 34 blocks, each see one stream of its own and run always.
        self.step_cache_block_lists: tuple[str, ...] = ("layers",)
        self.frame_step: int | None = None  # an image family
        self.dtype: torch.dtype = next(self.transformer.parameters()).dtype
        self.sampler = FlowMatchEulerSampler(m["scheduler"].config)
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        # The DiT's 2x2 patches of the latent grid: sizes divide by twice the VAE factor.
        self.patch_size = int(self.transformer.config.all_patch_size[0])
        self.pixel_multiple = self.vae_scale_factor * self.patch_size
        self.max_sequence_length = int(
            call_defaults(components.pipeline_class)["max_sequence_length"])
        self.max_text_tokens = MAX_TEXT_TOKENS
        self.max_prompt_chars: int | None = 4000
        self.latent_channels = int(self.transformer.config.in_channels)
        self.condition_images = (0, 1)  # text only, or one source image (edits)
        self.sources = SourceImages(self.vae, pixel_multiple=self.pixel_multiple, device=device)

    # -- encode ------------------------------------------------------------------------------
    def _encode_prompt(self, prompt: str, length: int) -> torch.Tensor:
        """(L, D) caption: Qwen3's second-to-last hidden states at the prompt's tokens."""
        return self._encode_prompts([prompt], length)[0]

    @torch.inference_mode()
    def _encode_prompts(self, prompts: list[str], length: int) -> list[torch.Tensor]:
        """``_encode_prompt`` of each prompt in one encoder pass. diffusers pads every prompt
        to ``length``; here the batch is padded on the right to its longest prompt only:
        Qwen3 is causal, so a prompt's tokens never see the padding after them, and each row
        keeps only its own tokens (by its mask, as diffusers). A tokenizer that pads on the
        left would shift the tokens' positions, which RoPE attention does not see (measured
        on the tiny model: 2e-6)."""
        texts = [self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True,
            enable_thinking=True) for prompt in prompts]
        tokens = self.tokenizer(texts, padding=True, max_length=length, truncation=True,
                                return_tensors="pt", padding_side="right")
        hidden = self.headless_encoder()(
            input_ids=token_ids(self.text_encoder, tokens.input_ids, self.device),
            attention_mask=upload(tokens.attention_mask, self.device),
            output_hidden_states=True,
        ).hidden_states[-2]
        # Host tensors: each row's own length without a device sync.
        lengths = tokens.attention_mask.sum(dim=1).tolist()
        rows = [hidden[i, :int(n)] for i, n in enumerate(lengths)]
        return rows if len(prompts) == 1 else [row.clone() for row in rows]

    def headless_encoder(self) -> torch.nn.Module:
        """Qwen3 without an LM head (``.model`` of a causal-LM checkpoint): only hidden states
        are read. Z-Image's released encoder is the headless ``Qwen3Model`` already."""
        inner = getattr(self.text_encoder, "model", None)
        return inner if isinstance(inner, torch.nn.Module) else self.text_encoder

    def uses_cfg(self, params: SamplingParams) -> bool:
        """diffusers' rule: classifier-free guidance whenever ``guidance_scale`` > 0."""
        return params.guidance_scale > 0.0

    def text_prompts(self, params: SamplingParams) -> list[str]:
        """The prompts ``prepare_encode`` encodes for ``params`` (the batched encode's input)."""
        return [params.prompt] + ([params.negative_prompt or ""] if self.uses_cfg(params) else [])

    def limits(self) -> ModelLimits:
        """The rope table holds ``axes_lens[1]`` / ``axes_lens[2]`` positions on the image's
        height and width axes, one per latent patch; the caption axis holds the text after
        which the image's frame index comes."""
        lens = self.transformer.config.axes_lens
        positions = min(int(lens[1]), int(lens[2]))
        limits = ModelLimits.of_table(positions, pixel_multiple=self.pixel_multiple,
                                      max_prompt_chars=self.max_prompt_chars,
                                      max_text_tokens=min(self.max_text_tokens, int(lens[0]) - 2))
        strength = (float(call_defaults(IMAGE_TO_IMAGE)["strength"]),
                    float(call_defaults(INPAINT)["strength"]))
        return dataclasses.replace(limits, image_strength=strength)

    def _latent_grid(self, height: int, width: int) -> tuple[int, int]:
        return (self.patch_size * (height // self.pixel_multiple),
                self.patch_size * (width // self.pixel_multiple))

    @torch.inference_mode()
    def prepare_encode(self, state: DenoiseState) -> None:
        p = state.params
        length = p.max_sequence_length or self.max_sequence_length
        positive = self._encode_prompt(p.prompt, length)
        negative = self._encode_prompt(p.negative_prompt or "", length) \
            if self.uses_cfg(p) else None
        self._prepare_rows(state, positive, negative)

    def _prepare_rows(self, state: DenoiseState, positive: torch.Tensor,
                      negative: torch.Tensor | None) -> None:
        """The request's caption rows (``n`` positive, then ``n`` negative under CFG), its
        initial latents and its schedule, from its (L, D) captions."""
        p = state.params
        n = p.num_images
        captions = [positive] * n + ([negative] * n if negative is not None else [])
        longest = max(c.shape[0] for c in captions)
        # (rows, L, D) right-padded to this request's longest caption; the lengths go with
        # the state as host facts, so the forward cuts each row's caption without a sync.
        embeds = torch.zeros(len(captions), longest, captions[0].shape[1], dtype=self.dtype,
                             device=self.device)
        for row, caption in enumerate(captions):
            embeds[row, : caption.shape[0]] = caption
        state.rows = len(captions)
        state.static_rows = {"cap_feats": embeds}
        state.host["caption_lengths"] = tuple(c.shape[0] for c in captions)
        lh, lw = self._latent_grid(p.height, p.width)
        shape = (n, self.latent_channels, lh, lw)
        tokens = (lh // self.patch_size) * (lw // self.patch_size)
        schedule = self.sampler.schedule(p.num_inference_steps, tokens)
        if p.images:  # from the source image: the kept steps, latents at their first sigma
            schedule, _ = self.sources.kept_schedule(schedule, p)
            latents, inpainting = self.sources.start(p, seed=state.seed, schedule=schedule,
                                                     latent_shape=shape, dtype=embeds.dtype)
            # float32 from here on, as diffusers' scheduler returns them after a step.
            state.latents = latents.float()
            if inpainting is not None:
                state.host[MASK_KEY] = inpainting
        else:
            # Same draw as diffusers: CPU generator, (n, C, h, w), float32.
            state.latents = seeded_noise(shape, seed=state.seed, dtype=torch.float32,
                                         device=self.device)
        state.schedule = schedule
        state.step_index = 0

    # -- denoise ------------------------------------------------------------------------------
    @torch.inference_mode()
    def denoise_step(self, batch: InputBatch) -> torch.Tensor:
        """The DiT's velocity for every row, (rows, C, h, w) float32, negated as diffusers
        negates it before the step."""
        captions = batch.static["cap_feats"]
        lengths = [n for s in batch.states for n in s.host["caption_lengths"]]
        # One caption tensor per row, its own length: the DiT pads and masks them itself.
        cap_feats = [captions[row, :n] for row, n in enumerate(lengths)]
        # (rows, C, h, w) -> rows x (C, 1, h, w): one frame per image, in the DiT's dtype.
        images = list(batch.hidden_states.to(self.dtype).unsqueeze(2).unbind(0))
        timestep = (TIME_SCALE - batch.timesteps.to(self.device)) / TIME_SCALE
        out = self.transformer(images, timestep, cap_feats, return_dict=False)[0]
        return -torch.stack([o.float() for o in out]).squeeze(2)

    def step(self, state: DenoiseState, output_rows: torch.Tensor) -> None:
        p = state.params
        index = state.step_index
        # Negated rows: -(pos + g(pos - neg)) == (-pos) + g((-pos) - (-neg)), exactly.
        guided_step(state, output_rows, p.guidance_scale if self.uses_cfg(p) else None,
                    from_conditional=True)
        inpainting = state.host.get(MASK_KEY)
        if inpainting is not None:
            state.latents = inpainting.blend(state.latents, state.schedule, index)

    # -- decode -------------------------------------------------------------------------------
    @torch.inference_mode()
    def post_decode(self, state: DenoiseState) -> None:
        assert state.latents is not None
        latents = state.latents.to(self.vae.dtype)
        latents = latents / self.vae.config.scaling_factor + self.vae.config.shift_factor
        decoded = self.vae.decode(latents, return_dict=False)[0]
        pixels = (decoded.float() / 2 + 0.5).clamp(0, 1)  # (n, 3, H, W) in [0, 1]
        # From CUDA, non_blocking lands in pinned memory without a host sync; the pixels are
        # valid once the step's queued work has finished (the runner waits for that).
        state.pixels = pixels.to("cpu", non_blocking=True)
