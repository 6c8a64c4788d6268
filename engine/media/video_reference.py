"""Video reference files (MiniMax-H3's motion and camera references): read at the edge,
decoded where the model reads them.

``probe`` runs where the request arrives (the HTTP route, ``generate --reference``): it
decodes the file once with PyAV, keeping no frame, to refuse what cannot be read and to learn
what the engine's checks need - the displayed size, the frame count and rate, the
soundtrack's rate - and returns a ``ReferenceVideo`` that carries the file itself. ``decode``
runs in the engine when the request is prepared: the frames as (count, height, width, 3)
uint8 RGB and the soundtrack as (channels, samples) float32, read as diffusers'
``MiniMaxH3VideoReference.from_file`` reads a file (RGB24 frames, the stream's display
rotation undone, planar float audio at the container's rate) - only the first ``limit``
frames, as no clip reads more. Keeping the compressed file in the request until then means
a queued, batched or stored job holds megabytes, not the gigabytes of its decoded frames.
"""

from __future__ import annotations

import io
import math
from typing import Any

from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.reference_media import ReferenceVideo

MAX_SECONDS = 60.0  # a reference longer than any clip is cut anyway (MiniMax-H3: 15 s)
MAX_FRAME_PIXELS = 4096 * 4096


def _open(data: bytes, field: str) -> Any:
    import av

    try:
        return av.open(io.BytesIO(data), mode="r")
    except (av.error.FFmpegError, ValueError) as e:
        raise InvalidRequestError(field, f"not a readable video file ({e})") from e


def probe(data: bytes, *, field: str = "references") -> ReferenceVideo:
    """The file's ``ReferenceVideo`` (module docstring); a 400 naming ``field`` when it has
    no decodable video stream, runs longer than ``MAX_SECONDS`` or has frames beyond
    ``MAX_FRAME_PIXELS``."""
    import av

    with _open(data, field) as container:
        if not container.streams.video:
            raise InvalidRequestError(field, "the file has no video stream")
        stream = container.streams.video[0]
        rate = float(stream.average_rate or stream.guessed_rate or 0)
        if not rate > 0:
            raise InvalidRequestError(field, "the video stream has no frame rate")
        count, size, rotation = 0, (0, 0), 0.0
        try:
            for frame in container.decode(stream):
                size, rotation = (frame.width, frame.height), frame.rotation
                if size[0] * size[1] > MAX_FRAME_PIXELS:
                    raise InvalidRequestError(field, f"frames of {size[0]}x{size[1]} are beyond "
                                              f"{MAX_FRAME_PIXELS} pixels; downscale the video")
                count += 1
                if count > MAX_SECONDS * rate:
                    raise InvalidRequestError(field, f"the video runs longer than "
                                              f"{MAX_SECONDS:g} s; the model reads its first "
                                              "seconds only: cut it before sending")
        except av.error.FFmpegError as e:
            raise InvalidRequestError(field, f"the video cannot be decoded ({e})") from e
        if count == 0:
            raise InvalidRequestError(field, "the video has no frames")
        audio = container.streams.audio[0] if container.streams.audio else None
        sound_rate = int(audio.codec_context.sample_rate) if audio is not None else None
        channels = int(audio.codec_context.channels) if audio is not None else 0
    if channels > 2:
        raise InvalidRequestError(field, f"the video's soundtrack has {channels} channels; a "
                                  "reference soundtrack is mono or stereo")
    width, height = size if round(rotation / 90.0) % 2 == 0 else size[::-1]
    return ReferenceVideo(data, width, height, count, rate, sound_rate, channels)


def frames_needed(reference: ReferenceVideo, clip_frames: int, clip_fps: float) -> int:
    """The source frames a clip of ``clip_frames`` at ``clip_fps`` can read: its frames come
    from the first ones only, whatever the rates (one more for the rounding of the slots)."""
    return min(reference.count, math.ceil(clip_frames * reference.fps / clip_fps) + 1)


def decode(reference: ReferenceVideo, *, limit: int | None = None
           ) -> tuple[Any, Any, int | None]:
    """The first ``limit`` frames (all: None) as (count, height, width, 3) uint8 RGB as
    displayed, and the soundtrack (None without one) as a (channels, samples) float32 tensor
    with its rate."""
    import numpy as np
    import torch

    with _open(reference.data, "references") as container:
        stream = container.streams.video[0]
        frames, rotation = [], 0.0
        for frame in container.decode(stream):
            rotation = frame.rotation
            frames.append(frame.to_ndarray(format="rgb24"))
            if limit is not None and len(frames) >= limit:
                break
        sound, rate = None, None
        if container.streams.audio:
            container.seek(0)
            sound, rate = _soundtrack(container, container.streams.audio[0])
    pixels = np.stack(frames)
    turns = round(rotation / 90.0) % 4  # ffmpeg shows a frame upright: undo its rotation
    if turns:
        pixels = np.ascontiguousarray(np.rot90(pixels, k=-turns, axes=(1, 2)))
    if sound is not None:
        sound = torch.as_tensor(sound)
    return pixels, sound, rate


def _soundtrack(container: Any, stream: Any) -> tuple[Any, int]:
    """The stream's samples as planar float32 at the container's own rate and layout."""
    import av
    import numpy as np

    rate = int(stream.codec_context.sample_rate)
    resampler = av.audio.resampler.AudioResampler(format="fltp", layout=stream.layout,
                                                  rate=rate)
    chunks = []
    for frame in container.decode(stream):
        chunks += [out.to_ndarray() for out in resampler.resample(frame)]
    chunks += [out.to_ndarray() for out in resampler.resample(None)]
    return np.concatenate(chunks, axis=-1).astype(np.float32), rate
