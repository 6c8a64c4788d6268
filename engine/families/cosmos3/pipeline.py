"""Step-wise Cosmos3 (the family's diffusers pipeline layout: text-to-video, text-to-image,
image-to-video, an optional sound track) on top of diffusers components.

Matches diffusers' pipeline numerically for the same seed: the same prompt templates and chat
tokenization (the pipeline's own ``tokenize_prompt``), the same sequence layout (its own
segment builders: mRoPE positions, the noisy frames' tokens), the same float32 noise from
one CPU generator (vision, then sound), the model's UniPC scheduler (one object per request
and modality, since UniPC keeps a history) and the same CFG combine in float32.

Differences, on purpose:

- every sequence of a step - each request's prompt and negative prompt, requests at any
  step, with or without sound, text- or image-conditioned - runs in one DiT forward in a
  joint layout (``packing``), where diffusers runs one forward per prompt; each sequence
  attends only to itself, so a request's output equals its output alone;
- image-to-video VAE-encodes the first frame alone, where diffusers encodes the image
  repeated over the whole clip: the VAE is causal in time, so the first latent frame - the
  only one the condition keeps - is the same;
- the DiT's token table stays in host memory (the prompts' rows are looked up there and
  uploaded, a few KB) and its language-model head, which generation never runs, stays
  there too (``host_modules``): 2 x 1.2 GB of Cosmos3-Nano never reach the device.

Pixels are (n, F, 3, H, W) float in [0, 1]; a request with ``audio`` also gets its waveform
(``state.audio``: (n, channels, samples) in [-1, 1] at ``state.audio_rate`` Hz).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.families import COSMOS3
from ditserve.engine.families.cosmos3 import FPS
from ditserve.engine.families.cosmos3.block import chunk_token_math
from ditserve.engine.families.cosmos3.packing import (
    ItemLayout,
    PackedItemsProcessor,
    StepItem,
    items_in_flight,
    joint_inputs,
)
from ditserve.engine.pipelines.common import decode_normalized_video, latent_statistics, upload
from ditserve.engine.pipelines.conditioning import to_pil
from ditserve.engine.pipelines.guidance import guided
from ditserve.engine.request import ModelLimits
from ditserve.engine.step.denoise_state import DenoiseState
from ditserve.engine.step.sampler import SchedulerTrajectory

if TYPE_CHECKING:
    from ditserve.engine.step.input_batch import InputBatch
    from ditserve.engine.weights.loader import LoadedComponents

HOST_MODULES = ("embed_tokens", "lm_head")  # the DiT's modules kept in host memory
MAX_PROMPT_CHARS = 4000
MAX_PROMPT_TOKENS = 512
SOUND = "sound"  # host: the request's _Sound


def keep_on_host(model: Any, device: torch.device) -> tuple[torch.nn.Module, ...]:
    """The DiT's modules that stay in host memory (module doc): its token table, whose
    looked-up rows are uploaded to ``device`` (a few KB per prompt; the ids stay on the
    host), and its language-model head, which generation never runs."""
    model.embed_tokens.register_forward_hook(lambda module, args, out: upload(out, device))
    return tuple(getattr(model, name) for name in HOST_MODULES)


@dataclass
class _Sound:
    """A request's sound track while it denoises: (n, C_s, T_s) float32 latents, their own
    UniPC trajectory, and the last forward's predictions for its rows."""

    latents: torch.Tensor
    schedule: SchedulerTrajectory
    prediction: torch.Tensor | None = None


class Cosmos3StepPipeline:
    """StepPipeline for Cosmos3 Omni (see module docstring)."""

    family = COSMOS3
    condition_images = (0, 1)  # image-to-video's first frame, when given
    # post_decode reads each request's own sound track: one request per VAE call.
    batched_decode = False
    # The step cache reuses residuals per row; the layers here see packed sequences.
    step_cache_refusal = ("the step cache is not available for Cosmos3: its layers run every "
                          "sequence of a step packed into one, with no rows to reuse")

    def __init__(
        self, components: LoadedComponents, *, device: torch.device, move_transformer: bool = True
    ) -> None:
        m = components.modules
        self.device = device
        self.diffusers = components.pipeline  # its tokenizer templates and segment builders
        self.transformer: torch.nn.Module = m["transformer"]
        self.block_lists = COSMOS3.block_lists
        self.scheduler = m["scheduler"]
        self.vae = m["vae"].to(device)
        self.sound_tokenizer = m.get("sound_tokenizer")
        if self.sound_tokenizer is not None:
            self.sound_tokenizer = self.sound_tokenizer.to(device)
        model: Any = self.transformer
        self.config = model.config
        self.dtype: torch.dtype = model.dtype
        self.host_modules = keep_on_host(model, device)
        if move_transformer:
            self._place(model)
        model.set_attn_processor(PackedItemsProcessor())
        # The feed-forwards over slices of tokens: a streamed model's peak is attention's.
        chunk_token_math(model)
        self.native_flow = bool(components.config.get("use_native_flow_schedule", False))
        self.frame_step: int | None = int(self.vae.config.scale_factor_temporal)
        self.spatial_factor = int(self.vae.config.scale_factor_spatial)
        # diffusers takes any multiple of the VAE's factor: an odd latent side is padded to
        # whole patches inside the DiT (720p: 45 latent rows).
        self.pixel_multiple = self.spatial_factor
        # One token is a patch of latents: the work rule counts 32-px tokens at 720p.
        self.pixels_per_token = self.spatial_factor * int(self.config.latent_patch_size)
        self.max_prompt_chars: int | None = MAX_PROMPT_CHARS
        # The DiT reads the prompt's tokens itself: no text encoder, no padded length (a
        # request's max_sequence_length is ignored); 512 bounds the planner's estimate.
        self.max_sequence_length = MAX_PROMPT_TOKENS
        self.max_text_tokens = MAX_PROMPT_TOKENS
        self._latents_mean, self._latents_inv_std = latent_statistics(self.vae, device)

    def _place(self, model: Any) -> None:
        """Everything but the host modules on the device (the root's own parameters too)."""
        for name, child in model.named_children():
            if name not in HOST_MODULES:
                child.to(self.device)
        for param in model.parameters(recurse=False):
            param.data = param.data.to(self.device)

    def limits(self) -> ModelLimits:
        """Positions are computed on the fly (mRoPE): no positional table bounds the size."""
        limits = ModelLimits.of_table(None, pixel_multiple=self.pixel_multiple,
                                      frame_step=self.frame_step,
                                      max_prompt_chars=self.max_prompt_chars,
                                      max_text_tokens=self.max_text_tokens)
        return dataclasses.replace(limits, audio=self.has_sound)

    @property
    def has_sound(self) -> bool:
        return self.sound_tokenizer is not None and bool(getattr(self.config, "sound_gen", False))

    # -- encode ------------------------------------------------------------------------------
    def _layout(self, ids: list[int], latents: torch.Tensor, *, conditioned: bool,
                sound_len: int) -> ItemLayout:
        """One sequence's static part, by diffusers' own segment builders (item-local
        positions; ``packing.joint_inputs`` offsets them in the joint layout)."""
        pipe, cpu = self.diffusers, torch.device("cpu")
        text = pipe._prepare_text_segment(ids, device=cpu)
        und = text["und_len"]
        vision = pipe._prepare_vision_segment(
            input_vision_tokens=latents, has_image_condition=conditioned,
            mrope_offset=text["vision_start_temporal_offset"], vision_fps=float(FPS), curr=und,
            device=cpu, condition_frame_indexes=[0] if conditioned else [])
        gen_positions = [vision["vision_mrope_ids"]]
        if sound_len:
            sound = pipe._prepare_sound_segment(
                input_sound_tokens=latents.new_zeros(1, sound_len),
                mrope_offset=text["vision_start_temporal_offset"],
                sound_fps=float(self.config.sound_latent_fps),
                curr=und + vision["num_vision_tokens"], device=cpu)
            gen_positions.append(sound["sound_mrope_ids"])
        # The token table is in host memory: the ids stay there (no upload, no sync).
        return ItemLayout(
            input_ids=text["input_ids"],
            und_positions=upload(text["text_mrope_ids"], self.device),
            gen_positions=upload(torch.cat(gen_positions, dim=1), self.device),
            vision_grid=tuple(vision["vision_token_shapes"][0]),  # type: ignore[arg-type]
            noisy_frames=upload(vision["vision_noisy_frame_indexes"][0], self.device),
            noisy_vision=upload(vision["vision_mse_loss_indexes"] - und, self.device),
            sound_len=sound_len,
        )

    def _sound_len(self, num_frames: int) -> int:
        """Sound latents of a clip, as diffusers counts them (samples over the hop size)."""
        assert self.sound_tokenizer is not None
        samples = int(num_frames / FPS * self.sound_tokenizer.config.sampling_rate)
        hop = int(self.sound_tokenizer._hop_size)
        return (samples + hop - 1) // hop

    @torch.inference_mode()
    def _first_frame(self, state: DenoiseState) -> torch.Tensor:
        """(1, C, 1, h, w) normalized float32 latents of the conditioning image (module doc)."""
        from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import (
            _preprocess_conditioning_image,
        )

        p = state.params
        frame = _preprocess_conditioning_image(to_pil(p.images[0]), height=p.height,
                                               width=p.width)  # (1, 3, H, W) in [-1, 1]
        return self.diffusers._encode_video(upload(frame.unsqueeze(2), self.device)).float()

    @torch.inference_mode()
    def prepare_encode(self, state: DenoiseState) -> None:
        p = state.params
        n = p.num_images
        sound = bool(p.audio)
        if sound and not self.has_sound:
            raise InvalidRequestError("audio", "this model generates no sound (its DiT has no "
                                      "sound head or the model no sound_tokenizer)")
        # As diffusers: classifier-free guidance whenever the scale is not 1.
        cfg = p.guidance_scale != 1.0
        cond_ids, uncond_ids = self.diffusers.tokenize_prompt(
            p.prompt, p.negative_prompt, num_frames=p.num_frames, height=p.height,
            width=p.width, fps=float(FPS))
        frames = (p.num_frames - 1) // int(self.frame_step or 1) + 1
        shape = (1, int(self.config.latent_channel), frames, p.height // self.spatial_factor,
                 p.width // self.spatial_factor)
        sound_len = self._sound_len(p.num_frames) if sound else 0
        # One CPU generator, as diffusers draws: each video's noise, then its sound's.
        generator = torch.Generator("cpu").manual_seed(state.seed)
        videos, sounds = [], []
        for _ in range(n):
            videos.append(torch.randn(shape, generator=generator, dtype=torch.float32))
            if sound:
                sounds.append(torch.randn((int(self.config.sound_dim), sound_len),
                                          generator=generator, dtype=torch.float32))
        latents = upload(torch.cat(videos), self.device)
        conditioned = bool(p.images) and p.num_frames > 1  # a still image ignores the image
        if conditioned:
            latents[:, :, :1] = self._first_frame(state)  # the condition frame stays clean
        layouts = [self._layout(ids, latents[:1], conditioned=conditioned, sound_len=sound_len)
                   for ids in ([cond_ids, uncond_ids] if cfg else [cond_ids])]
        state.latents = latents
        state.rows = n * len(layouts)
        state.host["cfg"] = cfg
        state.host["layouts"] = layouts
        state.schedule = self._trajectory(p.num_inference_steps)
        state.step_index = 0
        if sound:
            state.host[SOUND] = _Sound(upload(torch.stack(sounds), self.device),
                                       self._trajectory(p.num_inference_steps))

    def _trajectory(self, steps: int) -> SchedulerTrajectory:
        sigmas = None
        if self.native_flow:  # the pipeline's own linear flow schedule
            import numpy as np

            train = int(self.scheduler.config.num_train_timesteps)
            sigmas = np.linspace(1.0 - 1.0 / train, 0.0, steps + 1)[:-1]
        return SchedulerTrajectory(type(self.scheduler), self.scheduler.config, steps,
                                   sigmas=sigmas)

    # -- denoise ------------------------------------------------------------------------------
    def _items(self, state: DenoiseState, rows: torch.Tensor) -> list[StepItem]:
        """The request's sequences in row order: every video under the prompt, then (CFG)
        under the negative prompt; ``rows`` its (rows, C, T, h, w) latents."""
        n = state.params.num_images
        sound: _Sound | None = state.host.get(SOUND)
        t = state.current_timestep()
        items = []
        for r in range(state.rows):
            layout = state.host["layouts"][r // n]
            track = None if sound is None else sound.latents[r % n]
            items.append(StepItem(layout, rows[r:r + 1], track, t))
        return items

    @torch.inference_mode()
    def denoise_step(self, batch: InputBatch) -> torch.Tensor:
        items: list[StepItem] = []
        for state, rows in zip(batch.states, batch.row_slices, strict=True):
            items += self._items(state, batch.hidden_states[rows])
        kwargs = joint_inputs(items, dtype=self.dtype, device=self.device)
        with items_in_flight(items):
            vision, sound, _ = self.transformer(**kwargs, return_dict=False)
        # Each sound-generating request's predictions, for its step (in item order).
        start = 0
        for state in batch.states:
            track: _Sound | None = state.host.get(SOUND)
            if track is not None:
                assert sound is not None
                track.prediction = torch.stack(sound[start:start + state.rows])
                start += state.rows
        return torch.cat(vision)  # (rows, C, T, h, w)

    def _guided(self, state: DenoiseState, rows: torch.Tensor) -> torch.Tensor:
        # As diffusers: the combine and the step in float32.
        return guided(rows.float(), state.params.num_images,
                      state.params.guidance_scale if state.host["cfg"] else None)

    def step(self, state: DenoiseState, output_rows: torch.Tensor) -> None:
        assert state.schedule is not None and state.latents is not None
        index = state.step_index
        state.latents = state.schedule.step(state.latents, self._guided(state, output_rows),
                                            index)
        track: _Sound | None = state.host.get(SOUND)
        if track is not None:
            assert track.prediction is not None
            track.latents = track.schedule.step(
                track.latents, self._guided(state, track.prediction), index)
            track.prediction = None
        state.step_index += 1

    # -- decode -------------------------------------------------------------------------------
    @torch.inference_mode()
    def post_decode(self, state: DenoiseState) -> None:
        assert state.latents is not None
        state.pixels = decode_normalized_video(self.vae, state.latents, self._latents_mean,
                                               self._latents_inv_std)
        track: _Sound | None = state.host.get(SOUND)
        finished = state.step_index >= state.params.num_inference_steps  # not a preview
        if track is not None and finished and self.sound_tokenizer is not None:
            decoder_dtype = next(self.sound_tokenizer.parameters()).dtype
            waveform = self.sound_tokenizer.decode(track.latents.to(decoder_dtype))
            state.audio = waveform.float().to("cpu", non_blocking=True)  # (n, channels, N)
            state.audio_rate = int(self.sound_tokenizer.config.sampling_rate)
