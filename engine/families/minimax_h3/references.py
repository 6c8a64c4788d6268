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

Video references are refused: the conditioner reads them through Qwen3-VL's video
processor, which needs torchvision (not installable beside the CPU torch here).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ditserve.engine.errors import ConfigError, InvalidRequestError, ModelLoadError
from ditserve.engine.families.base import index_file
from ditserve.engine.pipelines.conditioning import to_pil
from ditserve.engine.reference_media import FIELD, Reference, ReferenceAudio, ReferenceLimits

REF2VA = "ref2va"
WORKFLOW_KEY = "ditserve_workflow"  # the replica directory's mark in its index
REFERENCE_DIT = "transformer_ref"  # the checkpoint's DiT of the ref2va workflow
DIT = "transformer"
MAX_IMAGES, MAX_AUDIOS = 9, 3  # diffusers' MiniMaxH3Ref2VASetupStep limits
MAX_ASPECT = 4  # an image reference is within 1:4 and 4:1
DEFAULT_SHORT_EDGE = 2048  # diffusers' reference_image_short_edge (the released model's)


def workflow_of(model_dir: str | Path) -> str | None:
    """``"ref2va"`` for a replica directory ``write_ref2va_replica`` wrote, else None."""
    found = index_file(Path(model_dir))
    if found is None:
        return None
    value = json.loads(found.read_text()).get(WORKFLOW_KEY)
    return value if isinstance(value, str) else None


def replica_limits(model_dir: str | Path, image_processor: Any,
                   audio_rate: int) -> ReferenceLimits | None:
    """What a ref2va replica's requests may reference (diffusers' limits: 9 images, 3
    soundtracks at the audio VAE's rate); None for any other directory (t2va, fl2va)."""
    if workflow_of(model_dir) != REF2VA:
        return None
    if image_processor is None:
        raise ModelLoadError("a ref2va replica needs the model's processor folder (Qwen3-VL's "
                             "image processor)")
    return ReferenceLimits(MAX_IMAGES, MAX_AUDIOS, audio_rate)


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


def diffusers_references(references: Sequence[Reference]) -> list[Any]:
    """The references as diffusers' dataclasses (PIL images; (channels, samples) float32
    waveforms at their rate), in the request's order."""
    from diffusers.modular_pipelines.minimax_h3 import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
    )

    out: list[Any] = []
    for reference in references:
        if isinstance(reference, ReferenceAudio):
            wave = torch.frombuffer(bytearray(reference.samples), dtype=torch.float32)
            out.append(MiniMaxH3AudioReference(audio=wave.view(reference.channels, -1),
                                               sample_rate=reference.sample_rate))
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
             for r in references if not isinstance(r, ReferenceAudio))
    return sum((w // multiple) * (h // multiple) for w, h in sizes)


def most_image_rows(*, short_edge: int, multiple: int) -> int:
    """The most rows image references may add: ``MAX_IMAGES`` of them at the longest
    admitted aspect (1:4: 16,384 rows each at the released 2048 short edge)."""
    width, height = reference_size(MAX_ASPECT * short_edge, short_edge,
                                   short_edge=short_edge, multiple=multiple)
    return MAX_IMAGES * (width // multiple) * (height // multiple)


def normalize(references: Sequence[Any], *, short_edge: int, multiple: int,
              audio_rate: int, duration_s: float) -> list[Any]:
    """diffusers' setup step on ``references`` (diffusers' dataclasses, module docstring):
    images at their own short edge, soundtracks stereo and cut to ``duration_s``."""
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.modular_pipelines.minimax_h3 import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
    )
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep

    resizer = VaeImageProcessor(vae_scale_factor=16)  # the setup step's own image_processor
    out: list[Any] = []
    for index, reference in enumerate(references):
        if reference.kind == "audio":
            wave = MiniMaxH3Ref2VASetupStep._normalize_audio_condition(
                reference.audio, reference.sample_rate, audio_rate, max_duration=duration_s)
            out.append(MiniMaxH3AudioReference(audio=wave, sample_rate=audio_rate))
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


def presentation(tokenizer: Any, image_processor: Any, prompt: str, references: Sequence[Any],
                 *, text_tag: int, video_tag: int
                 ) -> tuple[list[int], list[int], dict[str, torch.Tensor]]:
    """The ``ref2va`` presentation of the normalized ``references``, tokenized, with the
    conditioner's vision tensors of the images (one batched processor call)."""
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VATextEncoderStep

    from ditserve.engine.families.minimax_h3.presentation import vision_inputs

    images = [r.image for r in references if r.kind == "image"]
    vision, counts = vision_inputs(image_processor, images)
    ids, tags = MiniMaxH3Ref2VATextEncoderStep._build_presentation(
        tokenizer, prompt, list(references), counts, [], [], text_tag=text_tag,
        video_tag=video_tag)
    return list(ids), list(tags), vision


@torch.inference_mode()
def encode_audio(audio_vae: Any, references: Sequence[Any], *,
                 device: torch.device) -> list[torch.Tensor]:
    """Each soundtrack's clean conditioning rows, (A * 2, C_a) float32 on the CPU: the audio
    VAE's posterior mean, normalized, channel-major (diffusers' reference encoder)."""
    mean = torch.tensor(audio_vae.config.latents_mean).view(1, 1, -1)
    std = torch.tensor(audio_vae.config.latents_std).view(1, 1, -1)
    channels = int(audio_vae.config.latent_channels)
    out = []
    for reference in references:
        if reference.kind != "audio":
            continue
        posterior = audio_vae.encode(reference.audio.to(device)[:, None], return_dict=False)[0]
        latents = posterior.mode().float().cpu().transpose(1, 2)
        out.append(((latents - mean) / std).reshape(-1, channels))
    return out
