"""Decoded video pixels -> uint8 frames and H.264 MP4 files (the engine's video output).

A video family's result pixels are (n, F, 3, H, W) float in [0, 1]: n videos of F frames.
``frames_uint8`` rounds one video like diffusers' ``export_to_video`` does; ``write_mp4`` /
``mp4_bytes`` encode it with PyAV (FFmpeg's libx264 inside the wheel, yuv420p, so every
player opens it), with its sound track where the model made one (AAC, FFmpeg's own
encoder, at the track's sample rate and channels). No container code of our own.

Called by `ditserve generate` on a video model, and by the HTTP video API.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from ditserve.engine.errors import InvalidRequestError

DEFAULT_FPS = 16  # Wan's native frame rate
# x264's constant-rate factor: 18 is visually lossless for generated video; lower is larger.
DEFAULT_CRF = 18


def frames_uint8(video: Any) -> Any:
    """(F, 3, H, W) float tensor in [0, 1] -> (F, H, W, 3) uint8 numpy frames."""
    if video.dim() != 4 or video.shape[1] != 3:
        raise ValueError(f"expected (frames, 3, height, width) pixels, got {tuple(video.shape)}")
    return (video.permute(0, 2, 3, 1).float().numpy() * 255).round().astype("uint8")


# A sound track: (channels, samples) float in [-1, 1] and its sample rate.
Audio = tuple[Any, int]
AUDIO_BITRATE = 192_000


def _audio_stream(container: Any, audio: Audio) -> tuple[Any, Any]:
    """An AAC stream for ``audio`` and its one planar float frame (PyAV re-frames it to the
    encoder's frame size)."""
    import av

    samples, rate = audio
    if samples.dim() != 2 or not 1 <= samples.shape[0] <= 2:
        raise ValueError(f"expected (channels, samples) audio, 1 or 2 channels, got "
                         f"{tuple(samples.shape)}")
    layout = "stereo" if samples.shape[0] == 2 else "mono"
    stream = container.add_stream("aac", rate=int(rate))
    stream.layout = layout
    stream.bit_rate = AUDIO_BITRATE
    planar = samples.float().clamp(-1, 1).contiguous().numpy()
    frame = av.AudioFrame.from_ndarray(planar, format="fltp", layout=layout)
    frame.sample_rate = int(rate)
    frame.pts = 0
    return stream, frame


MAX_ENCODER_FPS = 240  # the frame rates this writer accepts (the HTTP API allows fewer)


def _encode(video: Any, target: Any, *, fps: int, crf: int, audio: Audio | None = None) -> None:
    import av

    frames = frames_uint8(video)
    count, height, width, _ = frames.shape
    if height % 2 or width % 2:  # yuv420p subsamples chroma 2x2
        raise InvalidRequestError("size", f"H.264 needs even sides, got {width}x{height}")
    if not isinstance(fps, int) or isinstance(fps, bool) or not 1 <= fps <= MAX_ENCODER_FPS:
        raise InvalidRequestError("fps", f"must be an integer in [1, {MAX_ENCODER_FPS}], "
                                         f"got {fps!r}")
    with av.open(target, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf)}
        # Every stream before the first packet: the container writes its header then.
        sound = None if audio is None else _audio_stream(container, audio)
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():  # flush the encoder's delayed frames
            container.mux(packet)
        if sound is not None:
            track, samples = sound
            for packet in (*track.encode(samples), *track.encode()):  # + the delayed ones
                container.mux(packet)


def write_mp4(video: Any, path: str | Path, *, fps: int = DEFAULT_FPS,
              crf: int = DEFAULT_CRF, audio: Audio | None = None) -> Path:
    """Encode one video, (F, 3, H, W) in [0, 1], to an H.264 MP4 file at ``path``; with
    ``audio`` ((channels, samples) in [-1, 1], sample rate), an AAC track beside it."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    _encode(video, str(target), fps=fps, crf=crf, audio=audio)
    return target


def mp4_bytes(video: Any, *, fps: int = DEFAULT_FPS, crf: int = DEFAULT_CRF,
              audio: Audio | None = None) -> bytes:
    """The same MP4, in memory."""
    buffer = io.BytesIO()
    _encode(video, buffer, fps=fps, crf=crf, audio=audio)
    return buffer.getvalue()
