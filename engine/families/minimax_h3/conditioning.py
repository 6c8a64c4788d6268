"""What one MiniMax-H3 request conditions on, before its noise is drawn: its prompt's rows,
its packed layout, its latent grid, and the conditioning latents its layout reserved rows
for - per workflow, as diffusers' blocks prepare them:

- ``keyframed`` (``t2va``, ``fl2va``): the prompt after any keyframes' vision blocks, the
  keyframes on the canvas and encoded (``keyframes``), ``MiniMaxH3PrepareLayoutStep``'s
  layout;
- ``referenced`` (``ref2va``, a ref2va replica): the references normalized, presented and
  encoded (``references``), ``MiniMaxH3Ref2VAPrepareLayoutStep``'s layout.

Called by the step pipeline's ``prepare_encode`` (``engine.families.minimax_h3.pipeline``),
whose components and model facts it reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.families.minimax_h3 import keyframes, video_processor
from ditserve.engine.families.minimax_h3 import references as refs
from ditserve.engine.families.minimax_h3.packing import ItemLayout
from ditserve.engine.families.minimax_h3.video_processor import VisionProcessors
from ditserve.engine.reference_media import Reference, ReferenceVideo
from ditserve.engine.request import SamplingParams

PIXEL_MEAN, PIXEL_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # diffusers' (ImageNet)
CANVAS = (768, 768 * 1344)  # diffusers' canvas_short_edge, canvas_max_pixels (released)
Grid = tuple[int, int, int, int]  # latent frames, latent height, width, audio latents


@dataclass
class Conditioning:
    """text: (1, L, D) prompt rows; layout: the packed sequence; grid: the generated rows'
    latent shape; visual: each keyframe's or image reference's (1, C, 1, h, w) latents, in
    packed order (noised by the caller, off the request's generator); audio: each
    soundtrack's clean (A * 2, C_a) rows."""

    text: torch.Tensor
    layout: ItemLayout
    grid: Grid
    visual: list[torch.Tensor]
    audio: list[torch.Tensor] = field(default_factory=list)


def grid(pipe: Any, num_frames: int, height: int, width: int) -> Grid:
    facts = pipe._facts
    frames = facts.video_latent_num_frames(num_frames, pipe.frames_per_chunk,
                                           pipe.latents_per_chunk)
    return (int(frames), height // pipe.spatial_factor, width // pipe.spatial_factor,
            int(facts.audio_latent_num_frames(num_frames)))


def keyframed(pipe: Any, p: SamplingParams, frames: int) -> Conditioning:
    """A text-only or keyframe request (``frames``: its aligned frame count)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep

    anchors = keyframes.anchors(p.images, p.last_frame)
    if anchors and pipe.image_processor is None:
        raise InvalidRequestError("image", "this MiniMax-H3 directory has no processor folder "
                                  "(Qwen3-VL's image processor): it serves text to video only")
    placed = keyframes.on_canvas(p.images, p.width, p.height)
    text, tags = pipe._encode_prompt(p.prompt, p.images, (p.width, p.height))
    shape = grid(pipe, frames, p.height, p.width)
    latent_frames, h, w, audio = shape
    positions, token_tags, video_idx, audio_idx, text_idx, conditions, _ = \
        MiniMaxH3PrepareLayoutStep.build_packed_sequence(
            tags, latent_frames, h, w, audio, pipe.patch, pipe.audio_channels,
            pipe._facts.MINIMAX_H3_AUDIO_TAG, pipe.video_tag, anchors)
    layout = ItemLayout(positions, token_tags, video_idx, audio_idx, text_idx, int(conditions))
    visual = keyframes.encode(pipe.vae, placed, device=pipe.device, pixel_mean=PIXEL_MEAN,
                              pixel_std=PIXEL_STD)
    return Conditioning(text, layout, shape, visual)


def normalized(pipe: Any, references: tuple[Reference, ...], num_frames: int) -> list[Any]:
    """The references as diffusers' setup step leaves them for a clip of ``num_frames``."""
    media = refs.diffusers_references(references, clip_frames=num_frames, fps=pipe.fps)
    return refs.normalize(media,
                          short_edge=pipe.reference_short_edge, multiple=pipe.pixel_multiple,
                          audio_rate=int(pipe.audio_vae.config.sampling_rate),
                          num_frames=num_frames, fps=pipe.fps, canvas=pipe.canvas)


def presented(pipe: Any, prompt: str, references: tuple[Reference, ...], frames: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``ref2va`` prompt rows and their tags (``_encode_prompt`` with references) for a
    clip of ``frames``: video references are cut to it before the conditioner samples them;
    without videos, soundtracks reach the presentation as labels only and any clip will do
    (``frames`` 0: the longest)."""
    from ditserve.engine.families.minimax_h3 import TEXT_LAYER, presentation

    media = normalized(pipe, references, frames or pipe.max_frames)
    ids, tags, vision = refs.presentation(pipe.tokenizer, pipe.vision_processors, prompt, media,
                                          fps=pipe.fps, text_tag=pipe.text_tag,
                                          video_tag=pipe.video_tag)
    return presentation.encode_ids(pipe.text_encoder, ids, tags, vision, layer=TEXT_LAYER,
                                   device=pipe.device)


def referenced(pipe: Any, p: SamplingParams, frames: int) -> Conditioning:
    """A ``ref2va`` request on a ref2va replica (``frames``: its aligned frame count)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (
        MiniMaxH3Ref2VAPrepareLayoutStep,
    )

    if p.images or p.last_frame:
        raise InvalidRequestError("image", "a ref2va replica takes references, not keyframes: "
                                  "send the images as references")
    media = normalized(pipe, p.references, frames)
    # The prompt cache keys on the clip's length only where a video reference depends on it.
    clip = frames if any(isinstance(r, ReferenceVideo) for r in p.references) else 0
    text, tags = pipe._encode_prompt(p.prompt, references=p.references, frames=clip)
    visual = refs.encode_visual(pipe.vae, media, device=pipe.device, pixel_mean=PIXEL_MEAN,
                                pixel_std=PIXEL_STD, encode_seed=keyframes.ENCODE_SEED,
                                frames_per_chunk=pipe.frames_per_chunk,
                                latents_per_chunk=pipe.latents_per_chunk)
    audio = refs.encode_audio(pipe.audio_vae, media, device=pipe.device)
    shape = grid(pipe, frames, p.height, p.width)
    latent_frames, h, w, audio_len = shape
    positions, token_tags, video_idx, audio_idx, text_idx, video_refs, audio_refs = \
        MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
            tags, media, visual, audio, latent_frames, h, w, audio_len, pipe.patch,
            pipe.audio_channels, pipe._facts.MINIMAX_H3_AUDIO_TAG, pipe.video_tag)
    layout = ItemLayout(positions, token_tags, video_idx, audio_idx, text_idx,
                        int(video_refs), int(audio_refs))
    return Conditioning(text, layout, shape, visual, audio)


class ConditionRows:
    """The work rule's conditioning rows of a MiniMax-H3 request (the pipeline's
    ``ConditionTokens``): a ref2va replica's image references at their own short edge
    (``references.image_rows``) and video references on their canvas over the clip
    (``references.video_rows``), else one canvas of rows per keyframe - the packed
    sequence's ``[reference blocks]`` / ``[keyframe conditions]``. The pipeline inherits it."""

    pixel_multiple: int
    reference_short_edge: int
    reference_limits: Any
    canvas: tuple[int, int]
    fps: int
    image_processor: Any
    vision_processors: VisionProcessors
    condition_images: tuple[int, int]

    @property
    def audio_rate(self) -> int:  # the pipeline's: its audio VAE's sampling rate
        raise NotImplementedError

    @property
    def max_frames(self) -> int:  # the pipeline's: the longest clip
        raise NotImplementedError

    def read_conditioners(self, components: Any) -> None:
        """What the model directory lets a request condition on: keyframes (a first and a
        last frame) where it has Qwen3-VL's image processor, which reads them into the
        prompt (text only otherwise); on a ref2va replica (its DiT the checkpoint's
        transformer_ref) references instead (``references.replica_limits``), video ones
        where the processor folder has the video processor too."""
        config = components.config
        self.image_processor = keyframes.load_image_processor(components.model_dir)
        self.condition_images = (0, 0 if self.image_processor is None
                                 else keyframes.MAX_KEYFRAMES)
        self.reference_short_edge = int(config.get("reference_image_short_edge",
                                                   refs.DEFAULT_SHORT_EDGE))
        # The canvas rule (short edge, area cap) a video reference is put on, as the target.
        self.canvas = (int(config.get("canvas_short_edge", CANVAS[0])),
                       int(config.get("canvas_max_pixels", CANVAS[1])))
        self.vision_processors = VisionProcessors(
            self.image_processor,
            video_processor.load(Path(components.model_dir) / keyframes.PROCESSOR))
        self.reference_limits = refs.replica_limits(
            components.model_dir, self.image_processor, int(self.audio_rate),
            self.vision_processors.video_processor)
        if self.reference_limits is not None:
            self.condition_images = (0, 0)

    def condition_tokens(self, params: SamplingParams) -> int:
        side = self.pixel_multiple
        if self.reference_limits is not None:
            return refs.image_rows(params.references, short_edge=self.reference_short_edge,
                                   multiple=side) + \
                refs.video_rows(params.references, num_frames=params.num_frames,
                                multiple=side, canvas=self.canvas, fps=self.fps)
        return len(params.images) * (params.height // side) * (params.width // side)

    @property
    def most_condition_tokens(self) -> int:
        """The most image references at 1:4 on a ref2va replica, and the most video
        references at the longest clip on the largest canvas (12 references at most in all:
        both bounds together are an upper bound). Keyframes add a canvas of rows each (two at
        most), where the usual clip the planner counts is 124 canvases of pixel frames (~3.4x
        its 37 latent frames): its margin covers them."""
        limits = self.reference_limits
        if limits is None:
            return 0
        short_edge, area = self.canvas
        largest = area // (self.pixel_multiple ** 2)  # the canvas's cap, in rows a frame
        return refs.most_image_rows(short_edge=self.reference_short_edge,
                                    multiple=self.pixel_multiple) + \
            limits.videos * self.max_frames * largest
