"""MiniMax-H3's omni-reference workflow (``ref2va``): a video conditioned on image and
audio references, run by the checkpoint's second DiT, ``transformer_ref``.

A ``ref2va`` replica serves that workflow alone: its model directory is the checkpoint seen
through ``write_ref2va_replica`` - every component linked as it is, ``transformer`` linked to
the checkpoint's ``transformer_ref`` and the index marked ``"ditserve_workflow": "ref2va"`` -
so the engine's loaders, DLO, caches and sequence parallelism stream that DiT as the
replica's one DiT, unchanged (``workflow_of`` reads the mark).

What diffusers' ``ref2va`` blocks do before the denoise loop, for one request:

- ``normalize`` (``MiniMaxH3Ref2VASetupStep``): an image reference resized (LANCZOS, through
  diffusers' ``VaeImageProcessor``) to its own short edge, the model's
  ``reference_image_short_edge`` (2048 released), rounded to the canvas multiple, with no
  area cap and at most 1:4; an audio reference truncated to the generated duration and made
  stereo (diffusers' own ``_normalize_audio_condition``; only references already at the
  audio VAE's rate are taken, as resampling needs torchaudio);
- ``presentation`` (``MiniMaxH3Ref2VATextEncoderStep._build_presentation``, called as
  diffusers' own static function): a ``"<Picture i>: "`` label and a vision block per image,
  an ``"<Audio j>: "`` label per audio reference, then the prompt;
- the images' conditioning latents (``MiniMaxH3Ref2VAReferenceEncoderStep``): the keyframes'
  recipe (``keyframes.encode``: sampled under seed 42, rounded through float16), then noised
  to ``t = 0.999`` with one draw each off the request's generator, before the generated
  rows' noise (``keyframes.noised_rows``);
- ``encode_audio``: each soundtrack's audio-VAE posterior *mean*, normalized, held clean
  (``t = 1``) in front of the generated audio rows;
- the layout (``MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence``, diffusers'
  static function): ``[text | reference blocks | audio | video]``.

``conditioning.referenced`` composes them for the step pipeline.

A video reference (``ReferenceVideo``) goes the same way: ``normalize`` puts its frames on
MiniMax-H3's 24 fps clock, cut to the generated clip, on the canvas its own aspect resolves to
(diffusers' ``_normalize_video_condition``), its soundtrack as an audio reference's; the
presentation samples it at 2 fps into timestamped vision blocks (diffusers'
``_gather_vision_features``, through ``video_processor.VideoProcessor``: Qwen3-VL's video
processor without torchvision); ``encode_visual`` encodes its frames, snapped down to
``17 n + 5``, as diffusers' reference encoder does; its soundtrack's rows sit just before
its video rows in the layout.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ditserve.engine.condition_image import ConditionImage
from ditserve.engine.errors import ConfigError, InvalidRequestError, ModelLoadError
from ditserve.engine.families.base import index_file
from ditserve.engine.media import video_reference
from ditserve.engine.pipelines.conditioning import to_pil
from ditserve.engine.reference_media import (
    FIELD,
    Reference,
    ReferenceAudio,
    ReferenceLimits,
    ReferenceVideo,
)

REF2VA = "ref2va"
WORKFLOW_KEY = "ditserve_workflow"  # the replica directory's mark in its index
REFERENCE_DIT = "transformer_ref"  # the checkpoint's DiT of the ref2va workflow
DIT = "transformer"
MAX_IMAGES, MAX_AUDIOS, MAX_VIDEOS, MAX_REFERENCES = 9, 3, 3, 12  # diffusers' setup step's
VIDEO_SAMPLE_FPS = 2.0  # the conditioner reads a reference video at 2 fps (diffusers')
MAX_ASPECT = 4  # an image reference is within 1:4 and 4:1
DEFAULT_SHORT_EDGE = 2048  # diffusers' reference_image_short_edge (the released model's)


def workflow_of(model_dir: str | Path) -> str | None:
    """``"ref2va"`` for a replica directory ``write_ref2va_replica`` wrote, else None."""
    found = index_file(Path(model_dir))
    if found is None:
        return None
    value = json.loads(found.read_text()).get(WORKFLOW_KEY)
    return value if isinstance(value, str) else None


def replica_limits(model_dir: str | Path, image_processor: Any, audio_rate: int,
                   video_processor: Any = None) -> ReferenceLimits | None:
    """What a ref2va replica's requests may reference (diffusers' limits: 9 images, 3 videos,
    3 soundtracks, 12 in all, audio at the audio VAE's rate; videos only where the processor
    folder has Qwen3-VL's video processor); None for any other directory (t2va, fl2va)."""
    if workflow_of(model_dir) != REF2VA:
        return None
    if image_processor is None:
        raise ModelLoadError("a ref2va replica needs the model's processor folder (Qwen3-VL's "
                             "image processor)")
    return ReferenceLimits(
        MAX_IMAGES, MAX_AUDIOS, audio_rate, videos=MAX_VIDEOS if video_processor else 0,
        total=MAX_REFERENCES,
        videos_refused="this replica takes no video references: its processor folder has no "
                       "video_preprocessor_config.json (Qwen3-VL's video processor)")


def write_ref2va_replica(source: str | Path, out: str | Path) -> Path:
    """The model directory of a ``ref2va`` replica of the MiniMax-H3 checkpoint ``source``
    (module docstring): links, no copied weights; ``out`` must not exist."""
    src, target = Path(source).resolve(), Path(out)
    found = index_file(src)
    if found is None:
        raise ConfigError(f"{str(src)!r} has no modular_model_index.json")
    index = json.loads(found.read_text())
    if index.get("_class_name") != "MiniMaxH3ModularPipeline":
        raise ConfigError(f"{str(src)!r} is not a MiniMax-H3 checkpoint "
                          f"({index.get('_class_name')!r})")
    entry = index.get(REFERENCE_DIT)
    if not (isinstance(entry, list) and len(entry) == 3 and (src / REFERENCE_DIT).is_dir()):
        raise ConfigError(f"{str(src)!r} has no {REFERENCE_DIT} (the ref2va workflow's DiT)")
    if target.exists():
        raise ConfigError(f"{str(target)!r} exists; name a new directory")
    target.mkdir(parents=True)
    for part in sorted(src.iterdir()):
        if part.name in (found.name, DIT, REFERENCE_DIT) or part.name.startswith("."):
            continue
        (target / part.name).symlink_to(part)
    (target / DIT).symlink_to(src / REFERENCE_DIT)
    del index[REFERENCE_DIT]
    index[DIT] = [entry[0], entry[1], {**entry[2], "subfolder": DIT}]
    index[WORKFLOW_KEY] = REF2VA
    (target / found.name).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return target


def diffusers_references(references: Sequence[Reference], *, clip_frames: int,
                         fps: float) -> list[Any]:
    """The references as diffusers' dataclasses (PIL images; videos decoded as (frames,
    height, width, 3) uint8 at their rate, as far as a clip of ``clip_frames`` at ``fps``
    reads them; (channels, samples) float32 waveforms at their rate), in the request's
    order."""
    from diffusers.modular_pipelines.minimax_h3 import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
        MiniMaxH3VideoReference,
    )

    out: list[Any] = []
    for reference in references:
        if isinstance(reference, ReferenceAudio):
            wave = torch.frombuffer(bytearray(reference.samples), dtype=torch.float32)
            out.append(MiniMaxH3AudioReference(audio=wave.view(reference.channels, -1),
                                               sample_rate=reference.sample_rate))
        elif isinstance(reference, ReferenceVideo):
            limit = video_reference.frames_needed(reference, clip_frames, fps)
            frames, sound, rate = video_reference.decode(reference, limit=limit)
            out.append(MiniMaxH3VideoReference(frames=frames, fps=float(reference.fps),
                                               audio=sound, sample_rate=rate))
        else:
            out.append(MiniMaxH3ImageReference(image=to_pil(reference)))
    return out


def reference_size(width: int, height: int, *, short_edge: int, multiple: int
                   ) -> tuple[int, int]:
    """(width, height) diffusers' setup step gives an image reference: its short edge at
    ``short_edge`` (upscaling included), sides rounded to ``multiple``."""
    scale = short_edge / min(width, height)
    return (max(multiple, round(width * scale / multiple) * multiple),
            max(multiple, round(height * scale / multiple) * multiple))


def image_rows(references: Sequence[Reference], *, short_edge: int, multiple: int) -> int:
    """The rows the image references add to the packed sequence: each at its
    ``reference_size``, one row per ``multiple``-pixel token (audio references not counted:
    the work rule counts no audio rows, the generated soundtrack's neither)."""
    sizes = (reference_size(r.width, r.height, short_edge=short_edge, multiple=multiple)
             for r in references if isinstance(r, ConditionImage))
    return sum((w // multiple) * (h // multiple) for w, h in sizes)


def video_rows(references: Sequence[Reference], *, num_frames: int, multiple: int,
               canvas: tuple[int, int], fps: float) -> int:
    """The rows the video references add, in the work rule's units (pixel frames, as it
    counts the generated clip): each on the canvas its aspect resolves to (``canvas``: the
    model's short edge and area cap), resampled to ``fps`` and cut to the clip's
    ``num_frames``."""
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import resolve_canvas_size

    rows = 0
    for r in references:
        if isinstance(r, ReferenceVideo):
            frames = min(num_frames, math.floor(r.count * fps / r.fps + 0.5))
            height, width = resolve_canvas_size(r.width, r.height, multiple, *canvas)
            rows += frames * (height // multiple) * (width // multiple)
    return rows


def most_image_rows(*, short_edge: int, multiple: int) -> int:
    """The most rows image references may add: ``MAX_IMAGES`` of them at the longest
    admitted aspect (1:4: 16,384 rows each at the released 2048 short edge)."""
    width, height = reference_size(MAX_ASPECT * short_edge, short_edge,
                                   short_edge=short_edge, multiple=multiple)
    return MAX_IMAGES * (width // multiple) * (height // multiple)


def normalize(references: Sequence[Any], *, short_edge: int, multiple: int,
              audio_rate: int, num_frames: int, fps: float,
              canvas: tuple[int, int]) -> list[Any]:
    """diffusers' setup step on ``references`` (diffusers' dataclasses, module docstring)
    for a clip of ``num_frames`` at ``fps``: images at their own short edge; videos on the
    ``fps`` clock, cut to the clip, on the canvas (``canvas``: short edge, area cap) their
    aspect resolves to; soundtracks stereo and cut to the clip."""
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.modular_pipelines.minimax_h3 import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
        MiniMaxH3VideoReference,
    )
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep

    setup = MiniMaxH3Ref2VASetupStep
    resizer = VaeImageProcessor(vae_scale_factor=16)  # the setup step's own image_processor
    out: list[Any] = []
    for index, reference in enumerate(references):
        wave: Any = None
        if reference.has_audio:
            wave = setup._normalize_audio_condition(
                reference.audio, reference.sample_rate, audio_rate,
                max_duration=num_frames / fps)
        if reference.kind == "audio":
            out.append(MiniMaxH3AudioReference(audio=wave, sample_rate=audio_rate))
            continue
        if reference.kind == "video":
            frames = setup._normalize_video_condition(
                reference.frames, float(reference.fps), num_frames, multiple, *canvas,
                float(fps))
            least = _least_video_frames(fps)
            if frames.shape[0] < least:
                raise InvalidRequestError(FIELD, f"reference {index + 1} runs "
                                          f"{frames.shape[0] / fps:.2f} s; the conditioner "
                                          f"reads a video at {VIDEO_SAMPLE_FPS:g} fps in pairs "
                                          f"of frames, so it must run {least / fps:.2f} s at "
                                          "least")
            out.append(MiniMaxH3VideoReference(
                frames=frames, fps=float(fps), audio=wave,
                sample_rate=None if wave is None else audio_rate))
            continue
        image = reference.image
        width, height = image.size
        if width > MAX_ASPECT * height or height > MAX_ASPECT * width:
            raise InvalidRequestError(FIELD, f"reference {index + 1} is {width}x{height}: "
                                      "MiniMax-H3 takes image references within 1:4 and 4:1")
        size = reference_size(width, height, short_edge=short_edge, multiple=multiple)
        if image.size != size:
            image = resizer.resize(image, height=size[1], width=size[0])
        out.append(MiniMaxH3ImageReference(image=image))
    return out


def _least_video_frames(fps: float, temporal_patch: int = 2) -> int:
    """The fewest frames at ``fps`` the conditioner's 2 fps sampling turns into a whole
    temporal patch (diffusers' ``_sample_video_condition_frames`` refuses fewer)."""
    return round((temporal_patch - 1) * fps / VIDEO_SAMPLE_FPS) + 1


def presentation(tokenizer: Any, processors: Any, prompt: str, references: Sequence[Any], *,
                 fps: float, text_tag: int, video_tag: int
                 ) -> tuple[list[int], list[int], dict[str, torch.Tensor]]:
    """The ``ref2va`` presentation of the normalized ``references``, tokenized, with the
    conditioner's vision tensors (images and videos each in one batched processor call;
    ``processors``: a ``video_processor.VisionProcessors``), as diffusers' text-encoder
    step builds them."""
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VATextEncoderStep

    step = MiniMaxH3Ref2VATextEncoderStep(video_sample_fps=VIDEO_SAMPLE_FPS)
    vision, image_counts, video_counts, stamps = step._gather_vision_features(
        processors, list(references), fps)
    ids, tags = step._build_presentation(
        tokenizer, prompt, list(references), image_counts, video_counts, stamps,
        text_tag=text_tag, video_tag=video_tag)
    return list(ids), list(tags), vision


@torch.inference_mode()
def encode_visual(vae: Any, references: Sequence[Any], *, device: torch.device,
                  pixel_mean: Sequence[float], pixel_std: Sequence[float], encode_seed: int,
                  frames_per_chunk: int, latents_per_chunk: int) -> list[torch.Tensor]:
    """Each image's and video's conditioning latents, (1, C, f, h, w) float32 on the CPU, in
    packed order: diffusers' ``encode_vae_condition`` of the uint8 pixels, a video's frames
    snapped down to ``17 n + 5`` so the VAE encodes them without padding."""
    import numpy as np
    from diffusers.modular_pipelines.minimax_h3.encoders import encode_vae_condition

    out = []
    for reference in references:
        if reference.kind == "image":
            pixels = torch.from_numpy(np.array(reference.image)).permute(2, 0, 1)[None, :, None]
        elif reference.kind == "video":
            count = reference.frames.shape[0]
            count = max(1, (count - latents_per_chunk) // frames_per_chunk) * \
                frames_per_chunk + latents_per_chunk
            pixels = torch.from_numpy(reference.frames[:count].copy()).permute(3, 0, 1, 2)[None]
        else:
            continue
        out.append(encode_vae_condition(vae, pixels.to(device), tuple(pixel_mean),
                                        tuple(pixel_std), encode_seed))
    return out


@torch.inference_mode()
def encode_audio(audio_vae: Any, references: Sequence[Any], *,
                 device: torch.device) -> list[torch.Tensor]:
    """Each soundtrack's clean conditioning rows, (A * 2, C_a) float32 on the CPU: the audio
    VAE's posterior mean, normalized, channel-major (diffusers' reference encoder); an audio
    reference's and a video reference's own, in packed order."""
    mean = torch.tensor(audio_vae.config.latents_mean).view(1, 1, -1)
    std = torch.tensor(audio_vae.config.latents_std).view(1, 1, -1)
    channels = int(audio_vae.config.latent_channels)
    out = []
    for reference in references:
        if not reference.has_audio:
            continue
        posterior = audio_vae.encode(reference.audio.to(device)[:, None], return_dict=False)[0]
        latents = posterior.mode().float().cpu().transpose(1, 2)
        out.append(((latents - mean) / std).reshape(-1, channels))
    return out
