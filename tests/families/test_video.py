"""Video out: H.264 MP4 through PyAV, and `ditserve generate` on a Wan model."""

from __future__ import annotations

import io
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.media.video import frames_uint8, mp4_bytes, write_mp4


def decode(source) -> tuple[np.ndarray, object]:  # type: ignore[no-untyped-def]
    with av.open(source) as container:
        stream = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
        return frames, stream


def smooth_video(frames: int, height: int, width: int) -> torch.Tensor:
    """(F, 3, H, W) moving gradients: content a lossy codec keeps close."""
    t = torch.arange(frames).view(frames, 1, 1, 1) / frames
    y = torch.linspace(0, 1, height).view(1, 1, height, 1)
    x = torch.linspace(0, 1, width).view(1, 1, 1, width)
    channels = [(x + t) / 2, (y + t) / 2, (x + y) / 2 + 0 * t]
    return torch.cat([c.expand(frames, 1, height, width) for c in channels], dim=1)


def test_mp4_holds_every_frame_at_the_rate_asked(tmp_path: Path) -> None:
    video = smooth_video(9, 48, 64)
    path = write_mp4(video, tmp_path / "clip.mp4", fps=8)
    frames, stream = decode(str(path))
    assert stream.codec_context.name == "h264"  # type: ignore[attr-defined]
    assert stream.average_rate == 8  # type: ignore[attr-defined]
    assert frames.shape == (9, 48, 64, 3)
    error = np.abs(frames.astype(np.int16) - frames_uint8(video).astype(np.int16)).mean()
    assert error < 4  # mean error in 0..255 levels
    # The in-memory encoding is a whole MP4 too.
    data = mp4_bytes(video, fps=8)
    assert data[4:8] == b"ftyp"
    assert decode(io.BytesIO(data))[0].shape == (9, 48, 64, 3)


def test_mp4_refuses_odd_sides_and_bad_rates(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="even sides"):
        write_mp4(torch.zeros(2, 3, 33, 32), tmp_path / "odd.mp4")
    with pytest.raises(InvalidRequestError, match="fps"):
        write_mp4(torch.zeros(2, 3, 32, 32), tmp_path / "rate.mp4", fps=0)


def test_generate_on_wan_writes_an_mp4_of_the_engines_frames(family_dir, family_runner,
                                                             tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from engine.driver import drive  # type: ignore[import-not-found]

    from ditserve.engine.cli.main import main
    from ditserve.engine.request import SamplingParams

    out = tmp_path / "cat.mp4"
    code = main(["generate", "--model", str(family_dir("wan")), "--device", "cpu",
                 "--prompt", "a red cat", "--steps", "3", "--seed", "7", "--height", "32",
                 "--width", "48", "--num-frames", "9", "--fps", "12",
                 "--guidance-scale", "4.0", "--out", str(out)])
    assert code == 0
    frames, stream = decode(str(out))
    assert frames.shape == (9, 32, 48, 3) and stream.average_rate == 12  # type: ignore[attr-defined]
    params = SamplingParams(prompt="a red cat", num_inference_steps=3, seed=7, height=32,
                            width=48, num_frames=9, guidance_scale=4.0)
    pixels, _ = drive(family_runner("wan"), {0: [("cli", params)]}, max_num_seqs=1)
    expected = frames_uint8(pixels["cli"][0]).astype(np.int16)
    # The file holds the engine's frames, up to H.264's loss on noise-like content (about 6
    # levels here, where unrelated frames of this content differ by about 50).
    assert np.abs(frames.astype(np.int16) - expected).mean() < 12


def test_generate_refuses_a_frame_count_the_model_cannot_make(family_dir, capsys) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.cli.main import main

    code = main(["generate", "--model", str(family_dir("wan")), "--device", "cpu",
                 "--prompt", "x", "--steps", "1", "--height", "32", "--width", "32",
                 "--num-frames", "8"])
    assert code == 2
    assert "--num-frames: must be 4k+1" in capsys.readouterr().err  # the flag typed


def test_mp4_carries_a_sound_track(tmp_path: Path) -> None:
    # A stereo tone beside the frames: an AAC stream at the track's rate, as long as it.
    rate = 16000
    t = torch.arange(rate) / rate
    tone = torch.stack([torch.sin(2 * torch.pi * 440 * t), torch.sin(2 * torch.pi * 220 * t)])
    path = write_mp4(smooth_video(8, 32, 32), tmp_path / "sound.mp4", fps=8,
                     audio=(0.5 * tone, rate))
    with av.open(str(path)) as container:
        assert container.streams.video[0].frames == 8
        stream = container.streams.audio[0]
        assert (stream.codec_context.name, stream.rate, stream.channels) == ("aac", rate, 2)
        samples = np.concatenate([f.to_ndarray() for f in container.decode(stream)], axis=1)
    # AAC adds its priming and pads the last frame: a second, within one frame of 1024.
    assert rate <= samples.shape[1] <= rate + 2048
    # The tone survives the lossy codec (its energy, not its exact samples).
    assert abs(float(np.abs(samples).mean()) - float((0.5 * tone).abs().mean())) < 0.05
