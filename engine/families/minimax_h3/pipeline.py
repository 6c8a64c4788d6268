"""Step-wise MiniMax-H3 text-to-video with its sound track (diffusers' ``t2va`` workflow),
from a first and/or last frame (``fl2va``), and - on a ref2va replica - from image and audio
references (``ref2va``: ``references``), on top of diffusers' components.

Composes the stages of diffusers' modular workflows as ``MiniMaxH3Blocks`` composes them, cut
at step boundaries: encode (``conditioning``, per workflow: ``presentation``: the prompt
after any keyframes' or references' vision blocks, the Qwen3-VL hidden state after layer 50;
``keyframes`` / ``references``: their conditioning latents), prepare (the ``17 n + 5`` frame
count; ``MiniMaxH3PrepareLayoutStep`` / ``MiniMaxH3Ref2VAPrepareLayoutStep``: the packed
``[text | keyframes or references | audio | video]`` layout; float32 conditioning, video and
audio noise off one CPU generator, in that order; ``MiniMaxH3SetTimestepsStep``: shift 12 for
video, 3 for audio), one denoise forward per step (``MiniMaxH3LoopDenoiser``;
``MiniMaxH3LoopSchedulerStep``: each modality's generated rows step down their own schedule
in float32, the conditioning rows held), decode (``MiniMaxH3AfterDenoiseStep``,
``MiniMaxH3VideoDecodeStep``, ``MiniMaxH3AudioDecodeStep``). The layout and timestep plans
are diffusers' own static functions; the rest follows them op for op, so a request equals
diffusers' call for the same seed.

Differences, on purpose:

- every video of a step - requests with other prompts, at other steps - runs in ONE DiT
  forward, as items of one packed sequence (``packing``), where diffusers runs one forward
  per request; each item attends only to itself, so a request's output equals its output
  alone;
- a request's ``num_inference_steps`` counts DiT forwards, as every family's does here;
  diffusers' MiniMax-H3 counts the points of its sigma grid, the terminal zero included, so
  ``num_inference_steps=N`` here is diffusers' ``num_inference_steps=N + 1``;
- the sound track is decoded only for a request that asks for it (``audio``; then muxed
  into the MP4); the audio rows are denoised either way, since the video's are denoised
  jointly with them;
- ``num_images`` > 1 draws each video's noise after the previous one's off the same
  generator, as consecutive diffusers calls with one generator do (keyframe noise first);
- a keyframe request's canvas is its size (the server and CLI fill the model's default in),
  where diffusers, given no size, takes the first keyframe's aspect ratio.

Pixels are (n, F, 3, H, W) float in [0, 1] with F the aligned frame count (diffusers rounds
``num_frames`` up to ``17 n + 5``); a request with ``audio`` also gets its stereo waveform
(``state.audio``: (n, 2, samples) at ``state.audio_rate`` Hz).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.families import MINIMAX_H3
from ditserve.engine.families.minimax_h3 import TEXT_LAYER, conditioning, keyframes, presentation
from ditserve.engine.families.minimax_h3.packing import (
    StepItem,
    install,
    items_in_flight,
    joint_inputs,
)
from ditserve.engine.pipelines.common import upload
from ditserve.engine.reference_media import Reference, check_references
from ditserve.engine.request import ConditionImage, ModelLimits
from ditserve.engine.step.denoise_state import DenoiseState
from ditserve.engine.step.sampler import SchedulerTrajectory

if TYPE_CHECKING:
    from ditserve.engine.step.input_batch import InputBatch
    from ditserve.engine.weights.loader import LoadedComponents

MAX_PROMPT_CHARS = 4000
MAX_PROMPT_TOKENS = 1024  # bounds the planner's estimate; prompts are never truncated
AUDIO = "audio"  # host: the request's _AudioTrack
PIXEL_MEAN, PIXEL_STD = conditioning.PIXEL_MEAN, conditioning.PIXEL_STD
KEYFRAME_ROWS = "keyframe_rows"  # host: (n, K, C * patch) noised keyframe rows, or absent
REFERENCE_AUDIO_ROWS = "reference_audio_rows"  # host: (R, C_a) clean soundtrack rows (ref2va)


@dataclass
class _AudioTrack:
    """A request's audio rows while they denoise: (n, A, C_a) float32, channel-major as
    diffusers packs them, their own schedule, and the last forward's predictions."""

    latents: torch.Tensor
    schedule: SchedulerTrajectory
    prediction: torch.Tensor | None = None


class MiniMaxH3StepPipeline(conditioning.ConditionRows):
    """StepPipeline for MiniMax-H3 text-to-video with audio (see module docstring)."""

    family = MINIMAX_H3
    # post_decode reads each request's own audio rows: one request per VAE call.
    batched_decode = False
    encoder_reads_images = True  # keyframes and references pass Qwen3-VL's vision side
    step_cache_refusal = ("the step cache is not available for MiniMax-H3: its blocks run "
                          "every video of a step packed into one sequence, with no rows to "
                          "reuse")

    def __init__(
        self, components: LoadedComponents, *, device: torch.device, move_transformer: bool = True
    ) -> None:
        from diffusers.modular_pipelines.minimax_h3 import modular_pipeline as facts

        m = components.modules
        self.device = device
        self.transformer: torch.nn.Module = m["transformer"]
        self.block_lists = MINIMAX_H3.block_lists
        self.scheduler = m["scheduler"]
        self.audio_scheduler = m["audio_scheduler"]
        self.text_encoder = m["text_encoder"]
        self.tokenizer = m["tokenizer"]
        self.vae = m["vae"].to(device)
        self.audio_vae = m["audio_vae"].to(device)
        model: Any = self.transformer
        self.config = model.config
        if move_transformer:
            model.to(device)
        install(model)
        # The block stack's dtype (diffusers' ModelMixin.dtype skips the float32 heads).
        self.dtype: torch.dtype = model.dtype
        self._facts = facts
        # diffusers' pipeline properties, read off the same components.
        self.patch: tuple[int, int, int] = tuple(int(p) for p in self.config.patch_size)  # type: ignore[assignment]
        self.spatial_factor = int(self.vae.spatial_compression_ratio)
        self.pixel_multiple = self.spatial_factor * self.patch[2]  # canvas_multiple: 32
        self.frames_per_chunk = int(self.vae.config.clip_length)
        self.latents_per_chunk = int(self.vae.tokens_chunk_size)
        self.latent_channels = int(self.vae.config.latent_channels)
        self.audio_channels = facts.MINIMAX_H3_AUDIO_CHANNELS
        self.audio_latent_channels = int(self.audio_vae.config.latent_channels)
        self.text_tag = facts.MINIMAX_H3_TEXT_TAG
        self.video_tag = facts.MINIMAX_H3_VIDEO_TAG
        self.fps = facts.MINIMAX_H3_FPS
        # Any frame count: diffusers rounds it up to 17 n + 5 (the work rule then counts
        # pixel frames, ~3.4x the latent frames; ``reference_work`` is in the same units).
        self.frame_step: int | None = 1
        self.max_prompt_chars: int | None = MAX_PROMPT_CHARS
        # The prompt is encoded whole (no padded length): a request's max_sequence_length is
        # ignored; MAX_PROMPT_TOKENS bounds the planner's estimate.
        self.max_sequence_length = MAX_PROMPT_TOKENS
        self.max_text_tokens = MAX_PROMPT_TOKENS
        mean, std = (torch.tensor(self.vae.config.latents_mean), torch.tensor(self.vae.config.latents_std))
        self._video_stats = (mean.view(1, -1, 1, 1, 1).to(device), std.view(1, -1, 1, 1, 1).to(device))
        amean = torch.tensor(self.audio_vae.config.latents_mean)
        astd = torch.tensor(self.audio_vae.config.latents_std)
        self._audio_stats = (amean.view(1, -1, 1).to(device), astd.view(1, -1, 1).to(device))
        self._pixel_stats = tuple(torch.tensor(v, device=device).view(1, -1, 1, 1, 1)
                                  for v in (PIXEL_MEAN, PIXEL_STD))
        self.read_conditioners(components)

    @property
    def audio_rate(self) -> int:
        return int(self.audio_vae.config.sampling_rate)

    @property
    def min_frames(self) -> int:
        return int(5.0 * self.fps)  # diffusers' min_duration (5 s) at 24 fps

    @property
    def max_frames(self) -> int:  # 15 s (diffusers' max_duration) once rounded up to 17n+5
        top, chunk = int(15.0 * self.fps), (self.frames_per_chunk, self.latents_per_chunk)
        return max(n for n in range(self.min_frames, top + 1)
                   if self._facts.align_num_frames(n, *chunk) <= top)  # 345: 346 -> 362

    def limits(self) -> ModelLimits:
        """Positions are computed on the fly: no table bounds the size; clips of 5 to 15 s."""
        limits = ModelLimits.of_table(None, pixel_multiple=self.pixel_multiple,
                                      frame_step=self.frame_step,
                                      max_prompt_chars=self.max_prompt_chars,
                                      max_text_tokens=self.max_text_tokens)
        return dataclasses.replace(limits, min_frames=self.min_frames, max_frames=self.max_frames,
                                   audio=True, last_frame=self.condition_images[1] > 0,
                                   references=self.reference_limits, guidance=False,
                                   frame_align=(self.frames_per_chunk, self.latents_per_chunk))

    # -- encode ------------------------------------------------------------------------------
    @torch.inference_mode()
    def _encode_prompt(self, prompt: str, images: tuple[ConditionImage, ...] = (),
                       canvas: tuple[int, int] = (0, 0),
                       references: tuple[Reference, ...] = (), frames: int = 0
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(1, L, D) in the encoder's dtype and the (L,) modality tags of its rows: the
        presentation of ``prompt`` after the keyframes ``images`` put on the ``canvas``
        (width, height), or after the ``references`` (``ref2va``; ``frames``: the clip a
        video reference is cut to) - arguments the prompt cache keys on by value
        (``presentation``, ``references``)."""
        if references:
            return conditioning.presented(self, prompt, references, frames)
        placed = keyframes.on_canvas(images, *canvas)
        return presentation.encode(
            self.text_encoder, self.tokenizer, self.image_processor, prompt, placed,
            layer=TEXT_LAYER, device=self.device, text_tag=self.text_tag,
            video_tag=self.video_tag)

    def aligned_frames(self, num_frames: int) -> int:
        """diffusers' frame count: rounded up to 17 n + 5, between 5 and 15 s at 24 fps."""
        aligned = self._facts.align_num_frames(num_frames, self.frames_per_chunk,
                                               self.latents_per_chunk)
        if not self.min_frames <= aligned <= self.max_frames:
            raise InvalidRequestError(
                "num_frames", f"MiniMax-H3 generates 5 to 15 s at {self.fps} fps: num_frames, "
                f"rounded up to 17n+5, must lie in [{self.min_frames}, {self.max_frames}]; got "
                f"{num_frames} (rounded up to {aligned})")
        return int(aligned)

    def _trajectory(self, scheduler: Any, steps: int) -> SchedulerTrajectory:
        # diffusers' grid has steps + 1 points (the terminal zero): ``steps`` forwards.
        trajectory = SchedulerTrajectory(type(scheduler), scheduler.config, steps + 1)
        if trajectory.num_steps != steps:
            raise InvalidRequestError(
                "num_inference_steps", f"{steps} steps collapse to {trajectory.num_steps} "
                "distinct timesteps in MiniMax-H3's shifted schedule; ask for fewer")
        return trajectory

    @torch.inference_mode()
    def prepare_encode(self, state: DenoiseState) -> None:
        from diffusers.modular_pipelines.minimax_h3.before_denoise import (
            patchify_video_latents,
        )

        p = state.params
        n = p.num_images
        if p.height % self.pixel_multiple or p.width % self.pixel_multiple:
            raise InvalidRequestError("height", f"height and width must be multiples of "
                                      f"{self.pixel_multiple}, got {p.height}x{p.width}")
        frames = self.aligned_frames(p.num_frames)
        check_references(p.references, self.reference_limits)
        prepared = (conditioning.referenced if self.reference_limits is not None
                    else conditioning.keyframed)(self, p, frames)
        conditions, grid = prepared.visual, prepared.grid
        latent_frames, h, w, audio_len = grid
        # One CPU generator, as diffusers draws: the keyframes' (or visual references')
        # noise, the video noise, then the audio noise in rows, video after video.
        generator = torch.Generator("cpu").manual_seed(state.seed)
        videos, audios, held = [], [], []
        for _ in range(n):
            if conditions:
                held.append(keyframes.noised_rows(self.scheduler, conditions, generator,
                                                  self.patch))
            noise = torch.randn((1, self.latent_channels, latent_frames, h, w),
                                generator=generator, dtype=torch.float32)
            videos.append(patchify_video_latents(noise, self.patch))
            audios.append(torch.randn((audio_len * self.audio_channels,
                                       self.audio_latent_channels),
                                      generator=generator, dtype=torch.float32))
        state.latents = upload(torch.stack(videos), self.device)  # (n, V, C * patch)
        state.rows = n
        state.schedule = self._trajectory(self.scheduler, p.num_inference_steps)
        state.step_index = 0
        state.host["layout"] = prepared.layout
        state.host["text"] = prepared.text
        state.host["grid"] = (latent_frames, h, w, audio_len)
        if held:
            state.host[KEYFRAME_ROWS] = upload(torch.stack(held), self.device)
        if prepared.audio:
            state.host[REFERENCE_AUDIO_ROWS] = upload(torch.cat(prepared.audio), self.device)
        state.host[AUDIO] = _AudioTrack(upload(torch.stack(audios), self.device),
                                        self._trajectory(self.audio_scheduler,
                                                         p.num_inference_steps))

    # -- denoise ------------------------------------------------------------------------------
    @torch.inference_mode()
    def denoise_step(self, batch: InputBatch) -> torch.Tensor:
        items: list[StepItem] = []
        for state, rows in zip(batch.states, batch.row_slices, strict=True):
            track: _AudioTrack = state.host[AUDIO]
            video_t = state.current_timestep()
            audio_t = float(track.schedule.timesteps[state.step_index])
            video = batch.hidden_states[rows]
            held = state.host.get(KEYFRAME_ROWS)
            sound = state.host.get(REFERENCE_AUDIO_ROWS)
            for r in range(state.rows):
                # The conditioning rows lead the video (and audio) rows, where the layout
                # reserved them.
                rows_r = video[r] if held is None else torch.cat([held[r], video[r]])
                audio_r = track.latents[r] if sound is None else \
                    torch.cat([sound, track.latents[r]])
                items.append(StepItem(state.host["layout"], state.host["text"], rows_r,
                                      audio_r, video_t, audio_t))
        kwargs = joint_inputs(items, keyframe_noise_aug=keyframes.NOISE_AUG, device=self.device)
        with items_in_flight(items):
            video_out, audio_out = self.transformer(**kwargs, return_dict=False)
        # Each item's predictions for its generated rows (the keyframe rows are never stepped).
        videos = [out[item.layout.condition_rows:] for item, out in zip(
            items, video_out[0].split([int(i.video.shape[0]) for i in items]), strict=True)]
        audios = [out[item.layout.condition_audio_rows:] for item, out in zip(
            items, audio_out[0].split([int(i.audio.shape[0]) for i in items]), strict=True)]
        start = 0
        for state in batch.states:
            track = state.host[AUDIO]
            track.prediction = torch.stack(audios[start:start + state.rows])
            start += state.rows
        return torch.stack(videos)  # (rows, V, C * patch)

    def step(self, state: DenoiseState, output_rows: torch.Tensor) -> None:
        assert state.schedule is not None and state.latents is not None
        index = state.step_index
        # As diffusers' loop: each modality's rows step down their own schedule in float32.
        state.latents = state.schedule.step(state.latents, output_rows.float(), index)
        track: _AudioTrack = state.host[AUDIO]
        assert track.prediction is not None
        track.latents = track.schedule.step(track.latents, track.prediction.float(), index)
        track.prediction = None
        state.step_index += 1

    # -- decode -------------------------------------------------------------------------------
    def _unpatchify(self, rows: torch.Tensor, grid: tuple[int, int, int, int]) -> torch.Tensor:
        """diffusers' after-denoise step: (n, V, C * patch) rows -> (n, C, F, h, w)."""
        frames, h, w, _ = grid
        pt, ph, pw = self.patch
        c = self.latent_channels
        rows = rows.reshape(-1, frames // pt, h // ph, w // pw, c, pt, ph, pw)
        return rows.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(-1, c, frames, h, w).contiguous()

    @torch.inference_mode()
    def post_decode(self, state: DenoiseState) -> None:
        assert state.latents is not None
        grid = state.host["grid"]
        mean, std = self._video_stats
        pixel_mean, pixel_std = self._pixel_stats
        videos = []
        for latents in self._unpatchify(state.latents, grid).split(1):
            video = self.vae.decode(latents * std + mean, return_dict=False)[0]
            videos.append((video.float() * pixel_std + pixel_mean).clamp(0, 1))
        pixels = torch.cat(videos).permute(0, 2, 1, 3, 4)  # (n, F, 3, H, W)
        state.pixels = pixels.contiguous().to("cpu", non_blocking=True)
        finished = state.step_index >= state.params.num_inference_steps  # not a preview
        if state.params.audio and finished:
            self._decode_audio(state, grid[3])

    def _decode_audio(self, state: DenoiseState, audio_len: int) -> None:
        track: _AudioTrack = state.host[AUDIO]
        mean, std = self._audio_stats
        waves = []
        for rows in track.latents:
            # Channel-major rows -> the mono audio VAE's two batch items (C_a, A) each.
            latents = rows.reshape(self.audio_channels, audio_len, -1).permute(0, 2, 1)
            audio = self.audio_vae.decode(latents.contiguous() * std + mean,
                                          return_dict=False)[0]
            waves.append(audio.float().permute(1, 0, 2))  # (1, 2, samples)
        state.audio = torch.cat(waves).to("cpu", non_blocking=True)
        state.audio_rate = self.audio_rate
