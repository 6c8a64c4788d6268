"""MiniMax-H3's video references (``ref2va``) on its tiny model: MP4 files read as a user
sends them (``media.video_reference``), equal to diffusers' modular ``ref2va`` workflow given
the same files through its own ``MiniMaxH3VideoReference.from_file`` - every frame and audio
sample - with a video alone at another frame rate with its soundtrack, and a video after an
image; batched with an image request == alone; DLO == resident; what is refused.

The tiny model puts a video reference on a 32 x 64 canvas and reads it through Qwen3-VL's
video processor as ditserve implements it without torchvision (equal to transformers':
test_minimax_h3_video_processor.py)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]
from families.family_support import (  # type: ignore[import-not-found]
    AUDIO_TOLERANCE,
    TOLERANCE,
    assert_same,
    drive_alone,
    open_runner,
    run_pipeline,
)
from families.minimax_support import BASE as CLIP  # type: ignore[import-not-found]
from families.minimax_support import (  # type: ignore[import-not-found]
    FRAMES,
    diffusers_pipeline,
    mp4,
)
from families.minimax_support import frame as picture  # type: ignore[import-not-found]

from ditserve.engine.config import OffloadConfig
from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.media.reference_input import decode_reference
from ditserve.engine.reference_media import ReferenceAudio, ReferenceVideo
from ditserve.engine.request import SamplingParams
from ditserve.engine.step.denoise_state import DenoiseState

VARIANT = "minimax-h3"
RATE = 8000  # the tiny audio VAE's


def video(seconds: float, fps: int, width: int, height: int, seed: int, *,
          sound_rate: int | None = None) -> ReferenceVideo:
    reference = decode_reference(mp4(seconds, fps, width, height, seed, sound_rate=sound_rate))
    assert isinstance(reference, ReferenceVideo)
    return reference


BASE = {**CLIP, "audio": True}
CASES: dict[str, SamplingParams] = {
    # 3 s at 30 fps with its soundtrack: resampled to 24 fps (72 frames), snapped to 56 for
    # the VAE; the soundtrack's rows just before the video's.
    "video-with-sound": SamplingParams(
        prompt="a dancer spins", num_inference_steps=2, seed=3,
        references=(video(3.0, 30, 48, 32, 1, sound_rate=RATE),), **BASE),
    # An image, then a portrait video longer than the clip (cut to its 124 frames).
    "image-then-video": SamplingParams(
        prompt="the cat walks like this", num_inference_steps=2, seed=8,
        references=(picture(40, 24, 2), video(6.0, 24, 32, 48, 3)), **BASE),
}


@pytest.fixture(scope="module")
def replica(family_dir, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    from ditserve.engine.families.minimax_h3.references import write_ref2va_replica

    return write_ref2va_replica(family_dir(VARIANT),
                                tmp_path_factory.mktemp("ref2va-video") / "replica")


@pytest.fixture(scope="module")
def runner(replica) -> Any:  # type: ignore[no-untyped-def]
    with open_runner(replica, device="cpu") as runner:
        yield runner


def reference(model_dir: Path, p: SamplingParams, tmp_path: Path
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' ``ref2va`` workflow, each video read from its file by diffusers' own
    ``MiniMaxH3VideoReference.from_file``: (1, F, 3, H, W), (1, 2, samples)."""
    from diffusers.modular_pipelines.minimax_h3 import (
        MiniMaxH3ImageReference,
        MiniMaxH3VideoReference,
    )

    from ditserve.engine.pipelines.conditioning import to_pil

    pipe = diffusers_pipeline(model_dir, "transformer_ref", workflow="ref2va")
    references: list[Any] = []
    for index, item in enumerate(p.references):
        if isinstance(item, ReferenceVideo):
            path = tmp_path / f"reference{index}.mp4"
            path.write_bytes(item.data)
            references.append(MiniMaxH3VideoReference.from_file(str(path)))
        else:
            references.append(MiniMaxH3ImageReference(image=to_pil(item)))
    out = pipe(prompt=p.prompt, references=references, num_frames=p.num_frames,
               height=p.height, width=p.width, num_inference_steps=p.num_inference_steps + 1,
               generator=torch.Generator().manual_seed(p.seed or 0), output_type="pt",
               output=["videos", "audio"])
    return out["videos"].cpu(), out["audio"].cpu()


@pytest.mark.parametrize("case", sorted(CASES))
def test_video_references_match_diffusers(family_dir, runner, case: str,  # type: ignore[no-untyped-def]
                                          tmp_path) -> None:
    params = CASES[case].validate_for(runner.limits)
    state = run_pipeline(runner, [(case, params)])[case]
    expected_video, expected_audio = reference(family_dir(VARIANT), params, tmp_path)
    assert state.pixels is not None and state.audio is not None
    assert state.pixels.shape == expected_video.shape == (1, FRAMES, 3, 32, 64)
    diff = (state.pixels - expected_video).abs().max().item()
    assert diff <= TOLERANCE, f"max abs pixel diff {diff}"
    assert state.audio.shape == expected_audio.shape
    audio_diff = (state.audio - expected_audio.float()).abs().max().item()
    assert audio_diff <= AUDIO_TOLERANCE, f"max abs audio diff {audio_diff}"
    # The video conditions the result: another clip is another video.
    other = tuple(video(3.0, 24, 48, 32, 77) if isinstance(r, ReferenceVideo) else r
                  for r in params.references)
    moved = run_pipeline(runner, [("other", SamplingParams(
        **{**params.__dict__, "references": other}))])["other"]
    assert moved.pixels is not None
    assert (moved.pixels - state.pixels).abs().max().item() > 2e-5


def test_layout_and_work_count_the_video_rows(runner) -> None:  # type: ignore[no-untyped-def]
    params = CASES["image-then-video"]
    state = DenoiseState("rows", params, seed=0)
    runner.pipeline.prepare_encode(state)
    layout = state.host["layout"]
    # The image at its 64 px short edge (64 x 96 -> 2 x 3 rows) and the video on its canvas
    # (32 x 64 portrait -> 64 x 32: 2 rows a latent frame; 124 frames -> 37 latent frames).
    assert layout.condition_rows == 6 + 37 * 2
    rule = runner.work_rule
    work = rule.tokens_per_row(params) - rule.generated_tokens_per_row(params)
    assert work == 6 + FRAMES * 2  # the work rule counts pixel frames, as for the clip


MIXED: dict[int, list[tuple[str, SamplingParams]]] = {
    0: [("video", SamplingParams(prompt="a wave", num_inference_steps=3, seed=31,
                                 references=(video(2.0, 24, 48, 32, 5),), **BASE)),
        ("image", SamplingParams(prompt="a tower", num_inference_steps=2, seed=32,
                                 references=(picture(32, 32, 12),), **BASE))],
    1: [("later", SamplingParams(prompt="sea", num_inference_steps=2, seed=33,
                                 references=(video(1.0, 30, 32, 32, 6), picture(64, 32, 14)),
                                 **BASE))],
}


@pytest.fixture(scope="module")
def alone(runner) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    return drive_alone(runner, MIXED)


def test_batched_equals_alone(runner, alone) -> None:  # type: ignore[no-untyped-def]
    together, sizes = drive(runner, MIXED, max_num_seqs=4)
    assert max(sizes) >= 2, "the scenario must actually batch"
    assert_same(together, alone)


def test_offload_equals_resident(replica, alone) -> None:  # type: ignore[no-untyped-def]
    with open_runner(replica, device="cpu", offload=OffloadConfig(enabled=True)) as offloaded:
        together, _ = drive(offloaded, MIXED, max_num_seqs=4)
    assert_same(together, alone)


@pytest.mark.slow
def test_sp2_equals_alone(replica, alone, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Two gloo ranks streaming the DiT: a video reference's rows are split with the rest of
    # the packed sequence.
    from ditserve.engine.config import EngineConfig, ParallelConfig, SchedulerConfig
    from ditserve.engine.loop.engine import DiffusionEngine

    monkeypatch.setenv("DITSERVE_WORKER_TIMEOUT_S", "120")
    config = EngineConfig(model=str(replica), device="cpu", offload=OffloadConfig(enabled=True),
                          parallel=ParallelConfig(sequence_parallel_size=2),
                          scheduler=SchedulerConfig(max_num_seqs=4))
    engine = DiffusionEngine(config).start()
    try:
        handles = {rid: engine.add_request(p) for group in MIXED.values() for rid, p in group}
        results = {rid: h.result(timeout=240).pixels for rid, h in handles.items()}
    finally:
        engine.shutdown()
    assert_same(results, alone)


def test_what_video_references_refuse(runner, replica, tmp_path) -> None:  # type: ignore[no-untyped-def]
    limits = runner.limits
    assert limits.references is not None and limits.references.videos == 3
    base = dict(prompt="x", **BASE)
    clip = video(1.0, 24, 32, 32, 9)
    with pytest.raises(InvalidRequestError, match="at most 3 video references"):
        SamplingParams(references=(clip,) * 4, **base).validate_for(limits)
    with pytest.raises(InvalidRequestError, match="at most 12 references in all"):
        voice = ReferenceAudio(RATE, 1, b"\0" * 400)
        SamplingParams(references=(picture(32, 32, 1),) * 9 + (clip, clip, voice, voice),
                       **base).validate_for(limits)
    # A soundtrack at another rate than the audio VAE's: what to do is said.
    loud = video(1.0, 24, 32, 32, 9, sound_rate=16000)
    with pytest.raises(InvalidRequestError, match="soundtrack is at 16000 Hz.*ffmpeg -an"):
        SamplingParams(references=(loud,), **base).validate_for(limits)
    # Shorter than one pair of 2 fps samples (13 frames at 24 fps).
    short = video(0.4, 24, 32, 32, 9)
    with pytest.raises(InvalidRequestError, match="must run 0.54 s at least"):
        runner.pipeline.prepare_encode(DenoiseState("short", SamplingParams(
            references=(short,), **base), 1))
    # Files the edge cannot read.
    with pytest.raises(InvalidRequestError, match="not a readable video"):
        decode_reference(b"\0\0\0\x18ftypmp42" + b"\0" * 32)
    # A replica whose processor folder lacks the video processor takes images only.
    bare = tmp_path / "bare"
    bare.mkdir()
    for part in replica.iterdir():
        if part.name != "processor":
            (bare / part.name).symlink_to(part.resolve() if part.is_symlink() else part)
    (bare / "processor").mkdir()
    for part in (replica / "processor").iterdir():
        if part.name != "video_preprocessor_config.json":
            (bare / "processor" / part.name).symlink_to(part.resolve())
    with open_runner(bare, device="cpu") as images_only:
        limits_without = images_only.limits
    with pytest.raises(InvalidRequestError, match="no video_preprocessor_config.json"):
        SamplingParams(references=(clip,), **base).validate_for(limits_without)


def test_decode_reads_as_diffusers_reads_a_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3VideoReference

    from ditserve.engine.media import video_reference

    data = mp4(1.5, 30, 48, 32, 4, sound_rate=RATE)
    ours = video_reference.probe(data)
    assert (ours.width, ours.height, ours.count, ours.fps) == (48, 32, 45, 30.0)
    assert (ours.audio_rate, ours.audio_channels) == (RATE, 1)
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    theirs = MiniMaxH3VideoReference.from_file(str(path))
    frames, sound, rate = video_reference.decode(ours)
    assert np.array_equal(frames, theirs.frames) and rate == theirs.sample_rate
    assert torch.equal(sound, theirs.audio)
    # Only the frames a clip can read: the first ones, unchanged.
    first, _, _ = video_reference.decode(ours, limit=10)
    assert np.array_equal(first, theirs.frames[:10])
    assert video_reference.frames_needed(ours, 24, 24.0) == 31  # 24 frames at 24 fps of 30


def test_generate_takes_a_video_reference(replica, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import av

    from ditserve.engine.cli.main import main

    clip = tmp_path / "dance.mov"
    clip.write_bytes(mp4(1.0, 25, 48, 32, 12, sound_rate=RATE))
    out = tmp_path / "out.mp4"
    assert main(["generate", "--model", str(replica), "--device", "cpu", "--prompt", "dance",
                 "--steps", "1", "--seed", "2", "--height", "32", "--width", "64",
                 "--num-frames", str(FRAMES), "--reference", str(clip), "--audio",
                 "--out", str(out)]) == 0
    with av.open(str(out)) as container:
        assert container.streams.video[0].frames == FRAMES
        assert container.streams.audio[0].rate == RATE


def test_container_files_are_told_from_images() -> None:
    import av

    from ditserve.engine.media.reference_input import is_video

    def container(fmt: str, codec: str) -> bytes:
        out = io.BytesIO()
        with av.open(out, mode="w", format=fmt) as file:
            stream = file.add_stream(codec, rate=24)
            stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
            frame = av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")
            for packet in [*stream.encode(frame), *stream.encode()]:
                file.mux(packet)
        return out.getvalue()

    for fmt, codec in (("mp4", "libx264"), ("mov", "libx264"), ("matroska", "libx264"),
                       ("avi", "mpeg4")):
        assert is_video(container(fmt, codec)), fmt
    # A QuickTime file from before the ftyp atom starts with another atom.
    assert is_video(b"\0\0\0\x08wide\0\0\0\x10mdat" + bytes(8))
    png = io.BytesIO()
    picture_pixels = np.zeros((4, 4, 3), np.uint8)
    from PIL import Image

    Image.fromarray(picture_pixels).save(png, format="PNG")
    assert not is_video(png.getvalue())
