"""Step-wise Wan image-to-video (the family's diffusers pipeline layout) on diffusers parts.

Two conditioning schemes, chosen by the model directory as diffusers chooses them:

- Wan 2.1 I2V (and Wan 2.2 I2V A14B's two experts): the first frame, resized to the video's
  size and followed by zero frames, is VAE-encoded as a whole video; a 4-channel mask (1 on
  the first frame) and those 16 latent channels are concatenated to the noisy latents on the
  channel axis (36 DiT input channels). A CLIP vision encoder's penultimate hidden states
  (Wan 2.1) join the text as image context in every block's cross-attention.
- Wan 2.2 TI2V (``expand_timesteps``): the first frame's own latents replace latent frame 0
  in every step's input, whose tokens get timestep 0; the decoded video starts from them.

Matches the family's diffusers pipeline numerically for the same seed; everything else -
prompt encoding, the float32 noise draw, the per-request scheduler, CFG rows in the same
forward, expert routing - is ``wan.WanStepPipeline``'s. The conditioning is encoded once at
admission (the VAE encodes the first frames of the requests admitted in one step together,
per size and frame count) and travels as static rows, so requests at different steps share a
forward; Wan 2.1's CLIP encoder reads the first frames of those requests in one forward too.
Every request needs its first frame (``condition_images`` (1, 1)).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import torch

from ditserve.engine.families import WAN_I2V
from ditserve.engine.families.wan.pipeline import WanStepPipeline
from ditserve.engine.pipelines.common import upload
from ditserve.engine.pipelines.conditioning import encode_once, take_encoded, to_pil
from ditserve.engine.step.denoise_state import DenoiseState

if TYPE_CHECKING:
    from ditserve.engine.request import ConditionImage
    from ditserve.engine.step.input_batch import InputBatch
    from ditserve.engine.weights.loader import LoadedComponents

CONDITION = "condition"  # static row: mask + first-frame latents (2.1) / first-frame latents (TI2V)
IMAGE_CONTEXT = "image_embeds"  # static row: CLIP hidden states (Wan 2.1 I2V)
CLIP_CONTEXT = "clip_context"  # host: a batched CLIP encode's rows for this request
FIRST_FRAME_MASK = "first_frame_mask"  # shared (TI2V): 0 on latent frame 0, else 1


class WanI2VStepPipeline(WanStepPipeline):
    """StepPipeline for Wan image-to-video (see module docstring)."""

    family = WAN_I2V  # type: ignore[assignment]
    condition_images = (1, 1)
    # post_decode mixes each request's own first-frame latents in (TI2V): one request per
    # VAE call (engine.placement.decode_batches).
    batched_decode = False

    def __init__(
        self, components: LoadedComponents, *, device: torch.device, move_transformer: bool = True
    ) -> None:
        super().__init__(components, device=device, move_transformer=move_transformer)
        m = components.modules
        self.video_processor = components.pipeline.video_processor
        self.image_encoder = m.get("image_encoder")
        self.clip_processor = m.get("image_processor")
        if self.image_encoder is not None:
            self.image_encoder = self.image_encoder.to(device)
        # The noise has the VAE's channels; the DiT's input adds the condition's (2.1: 36).
        self.latent_channels = int(self.vae.config.z_dim)
        config = self.vae.config
        shape = (1, int(config.z_dim), 1, 1, 1)
        # diffusers normalises the condition in float32 (the latents' dtype).
        self._cond_mean = torch.tensor(config.latents_mean).view(shape).to(device)
        self._cond_inv_std = (1.0 / torch.tensor(config.latents_std).view(shape)).to(device)

    # -- the first frame ---------------------------------------------------------------------
    def _preprocess(self, state: DenoiseState) -> tuple[Hashable, torch.Tensor] | None:
        p = state.params
        frame = self.video_processor.preprocess(to_pil(p.images[0]), height=p.height,
                                                width=p.width).to(dtype=torch.float32)
        frame = frame.unsqueeze(2)  # (1, 3, 1, H, W)
        if not self.expand_timesteps:
            # The first frame then zeros: the condition is encoded as a whole video.
            frame = torch.cat([frame, frame.new_zeros(1, 3, p.num_frames - 1, p.height,
                                                      p.width)], dim=2)
        return (p.height, p.width, p.num_frames), frame

    @torch.inference_mode()
    def _vae_encode(self, video: torch.Tensor) -> torch.Tensor:
        """(k, 3, F, H, W) pixels -> (k, C, f, h, w) normalised float32 latents (the mode)."""
        latents = self.vae.encode(upload(video, self.device).to(self.vae.dtype)).latent_dist
        return (latents.mode().float() - self._cond_mean) * self._cond_inv_std

    @torch.inference_mode()
    def encode_conditions(self, states: Sequence[DenoiseState]) -> None:
        """The first frames of requests admitted together: one VAE forward per shape, and (Wan
        2.1) one CLIP forward for all of them (its processor makes every image one size)."""
        encode_once(states, prepare=self._preprocess, encode=self._vae_encode)
        if self.image_encoder is not None and states:
            contexts = self._clip_contexts([state.params.images[0] for state in states])
            for row, state in enumerate(states):
                state.host[CLIP_CONTEXT] = contexts[row : row + 1]

    def _first_frame_latents(self, state: DenoiseState) -> torch.Tensor:
        encoded = take_encoded(state)
        if encoded is not None:
            return encoded
        prepared = self._preprocess(state)
        assert prepared is not None
        return self._vae_encode(prepared[1])

    def _mask(self, latents: torch.Tensor) -> torch.Tensor:
        """(1, 4, f, h, w): diffusers' first-frame mask, the first pixel frame repeated over
        the VAE's temporal factor, folded into 4 channels."""
        _, _, frames, height, width = latents.shape
        step = int(self.frame_step or 1)
        pixel_frames = (frames - 1) * step + 1
        mask = torch.zeros(1, 1, pixel_frames, height, width, device=latents.device)
        mask[:, :, 0] = 1
        first = torch.repeat_interleave(mask[:, :, 0:1], dim=2, repeats=step)
        mask = torch.cat([first, mask[:, :, 1:]], dim=2)
        # (1, 1, step * f, h, w) -> (1, step, f, h, w)
        return mask.view(1, -1, step, height, width).transpose(1, 2)

    @torch.inference_mode()
    def _clip_contexts(self, images: Sequence[ConditionImage]) -> torch.Tensor:
        """(k, tokens, D) CLIP penultimate hidden states of the original images (as diffusers)."""
        assert self.image_encoder is not None and self.clip_processor is not None
        inputs = self.clip_processor(images=[to_pil(i) for i in images], return_tensors="pt")
        pixels = upload(inputs["pixel_values"], self.device).to(self.image_encoder.dtype)
        states = self.image_encoder(pixel_values=pixels, output_hidden_states=True)
        return states.hidden_states[-2].to(self.dtype)

    def _image_context(self, state: DenoiseState) -> torch.Tensor:
        """(1, tokens, D): the batched encode's rows for this request, else its own."""
        context: torch.Tensor | None = state.host.pop(CLIP_CONTEXT, None)
        return context if context is not None else self._clip_contexts(state.params.images[:1])

    # -- StepPipeline ------------------------------------------------------------------------
    @torch.inference_mode()
    def prepare_encode(self, state: DenoiseState) -> None:
        latents = self._first_frame_latents(state)
        super().prepare_encode(state)
        assert state.latents is not None
        rows = state.rows
        if self.expand_timesteps:
            condition = latents  # (1, C, 1, h, w)
            mask = torch.ones_like(state.latents[:1, :1])  # (1, 1, f, h, w)
            mask[:, :, 0] = 0
            state.shared = {**state.shared, FIRST_FRAME_MASK: mask}
        else:
            condition = torch.cat([self._mask(latents), latents], dim=1)  # (1, 4 + C, f, h, w)
        state.static_rows[CONDITION] = condition.expand(rows, *condition.shape[1:]).contiguous()
        state.host[CONDITION] = condition
        if self.image_encoder is not None:
            context = self._image_context(state)
            state.static_rows[IMAGE_CONTEXT] = context.expand(rows, -1, -1).contiguous()

    def _model_input(self, hidden: torch.Tensor, condition: torch.Tensor,
                     mask: torch.Tensor | None) -> torch.Tensor:
        if mask is None:
            return torch.cat([hidden, condition.to(hidden.dtype)], dim=1).to(self.dtype)
        return ((1 - mask) * condition + mask * hidden).to(self.dtype)

    def _timesteps(self, timesteps: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        timesteps = timesteps.to(self.device)
        if mask is None:
            return timesteps
        # (rows,) -> (rows, tokens): timestep 0 on the first frame's tokens, as diffusers.
        tokens = mask[0, 0][:, :: self.patch[1], :: self.patch[2]].flatten()
        return tokens[None, :] * timesteps[:, None]

    @torch.inference_mode()
    def denoise_step(self, batch: InputBatch) -> torch.Tensor:
        mask = batch.shared.get(FIRST_FRAME_MASK)
        experts = [self.expert_of(s) for s in batch.states]
        out: torch.Tensor | None = None
        for expert in sorted(set(experts)):
            slices = [sl for sl, e in zip(batch.row_slices, experts, strict=True) if e == expert]

            def rows(t: torch.Tensor, slices: list[slice] = slices) -> torch.Tensor:
                return t if len(slices) == len(experts) else torch.cat([t[sl] for sl in slices])

            context = batch.static.get(IMAGE_CONTEXT)
            pred = self.experts[expert](
                hidden_states=self._model_input(rows(batch.hidden_states),
                                                rows(batch.static[CONDITION]), mask),
                timestep=self._timesteps(rows(batch.timesteps), mask),
                encoder_hidden_states=rows(batch.static["encoder_hidden_states"]),
                encoder_hidden_states_image=None if context is None else rows(context),
                return_dict=False,
            )[0]
            if len(slices) == len(experts):
                return pred
            if out is None:
                out = pred.new_empty((batch.num_rows, *pred.shape[1:]))
            start = 0
            for sl in slices:  # scattered back into batch order
                out[sl] = pred[start : start + sl.stop - sl.start]
                start += sl.stop - sl.start
        assert out is not None
        return out

    @torch.inference_mode()
    def post_decode(self, state: DenoiseState) -> None:
        mask = state.shared.get(FIRST_FRAME_MASK)
        if mask is not None and state.latents is not None:
            # TI2V: the decoded video starts from the first frame's own latents.
            state.latents = (1 - mask) * state.host[CONDITION] + mask * state.latents
        super().post_decode(state)
