"""MiniMax-H3's keyframe workflow (``fl2va``) on its tiny model: a first and/or last frame,
equal to diffusers' own modular pipeline for the same seed, every frame and every audio
sample; keyframe requests batched with text-only ones under DLO == alone; what it refuses.

The clips are the family's shortest (see test_minimax_h3.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from engine.driver import drive  # type: ignore[import-not-found]
from families.family_support import (  # type: ignore[import-not-found]
    AUDIO_TOLERANCE,
    TOLERANCE,
    assert_same,
    drive_alone,
    open_runner,
    run_pipeline,
)
from families.minimax_support import (  # type: ignore[import-not-found]
    BASE,
    FRAMES,
    KEYFRAME_MIX,
    frame,
    reference,
)

from ditserve.engine.config import OffloadConfig
from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.request import SamplingParams
from ditserve.engine.step.denoise_state import DenoiseState

VARIANT = "minimax-h3"
KEYFRAME_BASE = {**BASE, "audio": True}
KEYFRAMES: dict[str, SamplingParams] = {
    # Another aspect ratio: stretched onto the canvas.
    "first": SamplingParams(prompt="a red cat", num_inference_steps=2, seed=7,
                            images=(frame(40, 24, 1),), **KEYFRAME_BASE),
    "last": SamplingParams(prompt="a red cat", num_inference_steps=2, seed=7,
                           images=(frame(64, 32, 2),), last_frame=True, **KEYFRAME_BASE),
    # The follower is cover-cropped onto the first frame's canvas.
    "first-last": SamplingParams(prompt="waves on a beach", num_inference_steps=3, seed=9,
                                 images=(frame(64, 32, 3), frame(50, 40, 4)),
                                 last_frame=True, **KEYFRAME_BASE),
}


@pytest.mark.parametrize("case", sorted(KEYFRAMES))
def test_keyframes_match_diffusers(family_dir, family_runner, case: str) -> None:  # type: ignore[no-untyped-def]
    params = KEYFRAMES[case]
    state = run_pipeline(family_runner(VARIANT), [(case, params)])[case]
    video, sound = reference(family_dir(VARIANT), params)
    assert state.pixels is not None and state.audio is not None
    assert state.pixels.shape == video.shape == (1, FRAMES, 3, params.height, params.width)
    diff = (state.pixels - video).abs().max().item()
    assert diff <= TOLERANCE, f"max abs pixel diff {diff}"
    assert state.audio.shape == sound.shape
    audio_diff = (state.audio - sound.float()).abs().max().item()
    assert audio_diff <= AUDIO_TOLERANCE, f"max abs audio diff {audio_diff}"
    # The keyframes condition the result: the text-only request differs.
    plain = dataclasses.replace(params, images=(), last_frame=False)
    text_only = run_pipeline(family_runner(VARIANT), [("plain", plain)])["plain"]
    assert text_only.pixels is not None
    assert (text_only.pixels - state.pixels).abs().max().item() > 1e-3


def test_keyframe_requests_are_refused_as_diffusers_refuses(family_runner) -> None:  # type: ignore[no-untyped-def]
    runner = family_runner(VARIANT)
    limits = runner.limits
    assert limits.condition_images == (0, 2) and limits.last_frame
    base = dict(prompt="x", **KEYFRAME_BASE)
    with pytest.raises(InvalidRequestError, match="needs its image"):
        SamplingParams(last_frame=True, **base).validate_for(limits)
    with pytest.raises(InvalidRequestError, match="at most 2"):
        SamplingParams(images=(frame(32, 32, 1),) * 3, last_frame=True,
                       **base).validate_for(limits)
    both = SamplingParams(images=(frame(32, 32, 1),) * 2, **base)
    with pytest.raises(InvalidRequestError, match="mark the last one"):
        both.validate_for(limits)
    with pytest.raises(InvalidRequestError, match="last frame"):  # the pipeline's own check
        runner.pipeline.prepare_encode(DenoiseState("both", both, 1))


def test_the_prompt_cache_keys_on_the_keyframes_pixels(family_runner) -> None:  # type: ignore[no-untyped-def]
    # The cache in front of _encode_prompt: the same prompt with another keyframe of the
    # same size is another presentation; the same keyframe again is a hit.
    encode = family_runner(VARIANT).pipeline._encode_prompt
    one, other = frame(64, 32, 11), frame(64, 32, 12)
    first, tags = encode("a red cat", (one,), (64, 32))
    second, _ = encode("a red cat", (other,), (64, 32))
    assert (first - second).abs().max().item() > 1e-6
    assert encode("a red cat", (frame(64, 32, 11),), (64, 32))[0] is first
    text_only, text_tags = encode("a red cat")
    assert tags.shape[0] > text_tags.shape[0] == text_only.shape[1]
    assert int((tags == 0).sum()) > 0 and int((text_tags == 0).sum()) == 0  # vision rows


def test_a_last_frame_is_refused_by_a_first_frame_model() -> None:
    from ditserve.engine.model_limits import ModelLimits

    wan_i2v = ModelLimits(condition_images=(1, 1))
    params = SamplingParams(prompt="x", images=(frame(32, 32, 1),), last_frame=True)
    with pytest.raises(InvalidRequestError, match="takes no last frame") as e:
        params.validate_for(wan_i2v)
    assert e.value.field == "last_frame"


def test_keyframes_batched_with_text_to_video_under_dlo_equal_alone(family_offload_runner, family_runner) -> None:  # type: ignore[no-untyped-def]
    # Keyframe requests beside a text-only one, at other steps, two videos of one request
    # with their own keyframe noise: under DLO, every result equals the request alone.
    single = drive_alone(family_runner(VARIANT), KEYFRAME_MIX)
    outputs: list[Any] = []
    together, sizes = drive(family_offload_runner(VARIANT), KEYFRAME_MIX, max_num_seqs=4,
                            outputs=outputs)
    assert max(sizes) >= 3, "the scenario must actually batch"
    assert_same(together, single)
    assert (together["both"][0] - together["both"][1]).abs().max().item() > 1e-3


def test_generate_takes_a_first_and_a_last_image(family_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import av
    from PIL import Image

    from ditserve.engine.cli.main import main
    from ditserve.engine.pipelines.conditioning import to_pil

    paths = []
    for name, image in (("first.png", frame(64, 32, 9)), ("last.png", frame(48, 48, 10))):
        to_pil(image).save(tmp_path / name)
        paths.append(str(tmp_path / name))
    out = tmp_path / "keyframes.mp4"
    code = main(["generate", "--model", str(family_dir(VARIANT)), "--device", "cpu",
                 "--prompt", "a red cat", "--steps", "2", "--seed", "4", "--height", "32",
                 "--width", "64", "--num-frames", str(FRAMES), "--image", paths[0],
                 "--last-image", paths[1], "--out", str(out)])
    assert code == 0
    with av.open(str(out)) as container:
        assert container.streams.video[0].frames == FRAMES
    assert Image.open(paths[1]).size == (48, 48)


@pytest.mark.gpu
def test_keyframes_on_cuda_match_diffusers_and_dlo_equals_resident(family_dir) -> None:  # type: ignore[no-untyped-def]
    # On the device machine: fl2va equal to diffusers on CUDA (fp32), and DLO (copy stream,
    # pinned slabs) == resident with keyframe and text-only requests batched.
    model = family_dir(VARIANT)
    params = KEYFRAMES["first-last"]
    with open_runner(model, device="cuda") as resident:
        state = run_pipeline(resident, [("first-last", params)])["first-last"]
        want, _ = drive(resident, KEYFRAME_MIX, max_num_seqs=4)
    video, sound = reference(model, params, device="cuda")
    assert state.pixels is not None and state.audio is not None
    assert (state.pixels - video).abs().max().item() <= TOLERANCE
    assert (state.audio - sound.float()).abs().max().item() <= AUDIO_TOLERANCE
    with open_runner(model, device="cuda", offload=OffloadConfig(enabled=True)) as offloaded:
        got, sizes = drive(offloaded, KEYFRAME_MIX, max_num_seqs=4)
    assert max(sizes) >= 3
    assert_same(got, want)


@pytest.mark.parametrize("case", sorted(KEYFRAMES))
def test_work_counts_the_keyframes_rows(family_runner, case: str) -> None:  # type: ignore[no-untyped-def]
    """The work rule's conditioning is the keyframe rows the packed sequence holds."""
    runner = family_runner(VARIANT)
    params = KEYFRAMES[case]
    state = DenoiseState(case, params, seed=0)
    runner.pipeline.prepare_encode(state)
    rule = runner.work_rule
    conditioning = rule.tokens_per_row(params) - rule.generated_tokens_per_row(params)
    assert conditioning == state.host["layout"].condition_rows > 0
