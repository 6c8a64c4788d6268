"""A request's references: the media an omni-reference model conditions on (MiniMax-H3's
``ref2va``: subject, style or voice references, in the order the model reads them).

An image reference is a ``ConditionImage`` (decoded 8-bit RGB, as an edit's source); an
audio reference is a ``ReferenceAudio`` (float32 samples at the rate they were recorded,
mono or stereo); a video reference is a ``ReferenceVideo`` (decoded 8-bit RGB frames at the
container's frame rate, with its soundtrack when it has one). Decoded at the edge (``engine.server.fields.references``, the CLI's
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


@dataclass(frozen=True, repr=False)
class ReferenceVideo:
    """A video reference (a motion and camera reference): the container file as sent
    (``data``: MP4, WebM, MOV...; decoded where the model reads it, ``media.video_reference``,
    so a queued or stored request holds the compressed file, not its frames) and what the
    edge read of it: ``count`` frames of ``width`` x ``height`` as displayed, at ``fps`` (the
    container's rate; the model resamples onto its own), and its soundtrack's rate and
    channels (``audio_rate`` None: no soundtrack; the reference then conditions on motion
    alone)."""

    data: bytes
    width: int
    height: int
    count: int
    fps: float
    audio_rate: int | None = None
    audio_channels: int = 0

    def __post_init__(self) -> None:
        if min(self.width, self.height, self.count) <= 0 or not self.data:
            raise InvalidRequestError(FIELD, "a video reference needs frames")
        if not self.fps > 0:
            raise InvalidRequestError(FIELD, f"a video reference needs a positive frame rate, "
                                      f"got {self.fps}")

    def __repr__(self) -> str:  # never print the file into a log
        sound = "" if self.audio_rate is None else f" with sound at {self.audio_rate} Hz"
        return (f"ReferenceVideo({self.count} frames of {self.width}x{self.height} at "
                f"{self.fps:g} fps{sound})")


Reference: TypeAlias = ConditionImage | ReferenceAudio | ReferenceVideo


@dataclass(frozen=True)
class ReferenceLimits:
    """What a model's omni-reference workflow takes: at most ``images`` image, ``audios``
    audio and ``videos`` video references and ``total`` in all (None: no total beyond the
    three), audio (a video's soundtrack too) at ``audio_rate`` Hz only (None: no audio; the
    engine resamples nothing), never audio alone. ``videos_refused``: why a model that takes
    video references in general takes none here (its directory lacks the video processor),
    said when one is sent."""

    images: int
    audios: int = 0
    audio_rate: int | None = None
    videos: int = 0
    total: int | None = None
    videos_refused: str = "this model takes no video references"


def shape_key(reference: Reference) -> tuple[str, int, int]:
    """What a reference changes in a forward's layout (its rows): kind and size."""
    if isinstance(reference, ConditionImage):
        return ("image", reference.width, reference.height)
    if isinstance(reference, ReferenceVideo):
        return ("video", reference.width * reference.height, reference.count)
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
    videos = [r for r in references if isinstance(r, ReferenceVideo)]
    if len(images) + len(audios) + len(videos) != len(references):
        raise InvalidRequestError(FIELD, "references must be decoded images, audio or video")
    if not images and not videos:
        raise InvalidRequestError(FIELD, "this replica serves the omni-reference workflow "
                                  "(ref2va): a request needs at least one image or video "
                                  "reference (audio references go with one); send text-only "
                                  "and keyframe requests to a t2va replica")
    if len(images) > limits.images:
        raise InvalidRequestError(FIELD, f"at most {limits.images} image references, got "
                                  f"{len(images)}")
    if videos and not limits.videos:
        raise InvalidRequestError(FIELD, limits.videos_refused)
    if len(videos) > limits.videos:
        raise InvalidRequestError(FIELD, f"at most {limits.videos} video references, got "
                                  f"{len(videos)}")
    if audios and limits.audio_rate is None:
        raise InvalidRequestError(FIELD, "this model takes no audio references")
    if len(audios) > limits.audios:
        raise InvalidRequestError(FIELD, f"at most {limits.audios} audio references, got "
                                  f"{len(audios)}")
    if limits.total is not None and len(references) > limits.total:
        raise InvalidRequestError(FIELD, f"at most {limits.total} references in all, got "
                                  f"{len(references)}")
    for index, reference in enumerate(references):
        if isinstance(reference, ReferenceAudio):
            _check_sound(index, reference.sample_rate, reference.frames, limits, of_video=False)
        elif isinstance(reference, ReferenceVideo) and reference.audio_rate is not None:
            _check_sound(index, reference.audio_rate, 1, limits, of_video=True)


def _check_sound(index: int, rate: int, samples: int, limits: ReferenceLimits, *,
                 of_video: bool) -> None:
    what = f"reference {index + 1}" + ("'s soundtrack" if of_video else "")
    if limits.audio_rate is None:
        raise InvalidRequestError(FIELD, f"{what}: this model takes no audio")
    if rate != limits.audio_rate:
        fix = (f"re-encode the video's audio at {limits.audio_rate} Hz (ffmpeg -ar "
               f"{limits.audio_rate}) or drop it (ffmpeg -an) to condition on motion alone"
               if of_video else "resample it before sending")
        raise InvalidRequestError(FIELD, f"{what} is at {rate} Hz; audio must be at the audio "
                                  f"VAE's {limits.audio_rate} Hz (resampling needs torchaudio, "
                                  f"which is not installed): {fix}")
    if samples == 0:
        raise InvalidRequestError(FIELD, f"{what} has no samples")
