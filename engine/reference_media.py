"""A request's references: the media an omni-reference model conditions on (MiniMax-H3's
``ref2va``: subject, style or voice references, in the order the model reads them).

An image reference is a ``ConditionImage`` (decoded 8-bit RGB, as an edit's source); an
audio reference is a ``ReferenceAudio`` (float32 samples at the rate they were recorded,
mono or stereo). Decoded at the edge (``engine.server.fields.references``, the CLI's
``--reference``); carried on ``SamplingParams.references``; judged against the model's
``ModelLimits.references`` (``check_references``). Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

from ditserve.engine.condition_image import ConditionImage
from ditserve.engine.errors import InvalidRequestError

FIELD = "references"


@dataclass(frozen=True, repr=False)
class ReferenceAudio:
    """An audio reference: ``channels`` (1 or 2) planes of float32 little-endian samples
    in [-1, 1], channel after channel, at ``sample_rate`` Hz."""

    sample_rate: int
    channels: int
    samples: bytes

    def __post_init__(self) -> None:
        if self.channels not in (1, 2) or len(self.samples) % (4 * self.channels):
            raise InvalidRequestError(FIELD, "an audio reference is mono or stereo float32 "
                                      "samples")

    @property
    def frames(self) -> int:
        return len(self.samples) // (4 * self.channels)

    def __repr__(self) -> str:  # never print the samples into a log
        return f"ReferenceAudio({self.channels}x{self.frames} at {self.sample_rate} Hz)"


Reference: TypeAlias = ConditionImage | ReferenceAudio


@dataclass(frozen=True)
class ReferenceLimits:
    """What a model's omni-reference workflow takes: at most ``images`` image and ``audios``
    audio references, audio at ``audio_rate`` Hz only (None: no audio references; the
    engine resamples nothing), never audio alone."""

    images: int
    audios: int = 0
    audio_rate: int | None = None


def shape_key(reference: Reference) -> tuple[str, int, int]:
    """What a reference changes in a forward's layout (its rows): kind and size."""
    if isinstance(reference, ConditionImage):
        return ("image", reference.width, reference.height)
    return ("audio", reference.frames, reference.sample_rate)


def check_references(references: Sequence[object], limits: ReferenceLimits | None) -> None:
    """Refuse references where the model takes none, and a reference request beyond its
    limits (counts, audio rate, audio alone); a reference model needs one at least."""
    if limits is None:
        if references:
            raise InvalidRequestError(FIELD, "this model takes no references (MiniMax-H3's "
                                      "omni-reference workflow is served by a ref2va replica: "
                                      "`ditserve model ref2va`)")
        return
    images = [r for r in references if isinstance(r, ConditionImage)]
    audios = [r for r in references if isinstance(r, ReferenceAudio)]
    if len(images) + len(audios) != len(references):
        raise InvalidRequestError(FIELD, "references must be decoded images or audio")
    if not images:
        raise InvalidRequestError(FIELD, "this replica serves the omni-reference workflow "
                                  "(ref2va): a request needs at least one image reference "
                                  "(audio references go with one); send text-only and "
                                  "keyframe requests to a t2va replica")
    if len(images) > limits.images:
        raise InvalidRequestError(FIELD, f"at most {limits.images} image references, got "
                                  f"{len(images)}")
    if audios and limits.audio_rate is None:
        raise InvalidRequestError(FIELD, "this model takes no audio references")
    if len(audios) > limits.audios:
        raise InvalidRequestError(FIELD, f"at most {limits.audios} audio references, got "
                                  f"{len(audios)}")
    for audio in audios:
        if audio.sample_rate != limits.audio_rate:
            raise InvalidRequestError(FIELD, f"an audio reference must be at the audio VAE's "
                                      f"{limits.audio_rate} Hz, got {audio.sample_rate} Hz "
                                      "(resampling needs torchaudio, which is not installed: "
                                      "resample it before sending)")
        if audio.frames == 0:
            raise InvalidRequestError(FIELD, "an audio reference has no samples")
