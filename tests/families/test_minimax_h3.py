"""MiniMax-H3 on its tiny model: equal to diffusers' own modular pipeline (``t2va``) for the
same seed, every frame and every audio sample, and its own result alone == batched == under
DLO == over two sequence-parallel ranks (gloo). The keyframe workflow (``fl2va``) is
test_minimax_h3_fl2va.py's, the omni-reference one (``ref2va``) test_minimax_h3_ref2va.py's.

The clips are MiniMax-H3's shortest (5 s at 24 fps: 124 frames, 37 latent frames; diffusers
refuses shorter ones) on a 32 px high canvas, so a request is a few hundred rows."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]
from families.family_support import (  # type: ignore[import-not-found]
    AUDIO_TOLERANCE,
    SAME,
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
    reference,
)

from ditserve.engine.config import EngineConfig, OffloadConfig, ParallelConfig, SchedulerConfig
from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.request import SamplingParams
from ditserve.engine.step.denoise_state import DenoiseState

VARIANT = "minimax-h3"

CASES: dict[str, SamplingParams] = {
    "wide": SamplingParams(prompt="a red cat", num_frames=FRAMES, height=32, width=64,
                           num_inference_steps=2, seed=7, guidance_scale=1.0, audio=True),
    "tall-rounded": SamplingParams(prompt="waves on a beach at dusk", num_frames=121,
                                   height=64, width=32, num_inference_steps=3, seed=9,
                                   guidance_scale=1.0, audio=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_diffusers(family_dir, family_runner, case: str) -> None:  # type: ignore[no-untyped-def]
    params = CASES[case]
    state = run_pipeline(family_runner(VARIANT), [(case, params)])[case]
    video, sound = reference(family_dir(VARIANT), params)
    assert state.pixels is not None and state.audio is not None
    frames = FRAMES  # 121 is rounded up to 124, as diffusers does
    assert state.pixels.shape == video.shape == (1, frames, 3, params.height, params.width)
    diff = (state.pixels - video).abs().max().item()
    assert diff <= TOLERANCE, f"max abs pixel diff {diff}"
    assert state.pixels.std().item() > 1e-3  # not a constant video
    assert state.audio.shape == sound.shape and sound.shape[:2] == (1, 2)
    audio_diff = (state.audio - sound.float()).abs().max().item()
    assert audio_diff <= AUDIO_TOLERANCE, f"max abs audio diff {audio_diff}"
    assert state.audio.std().item() > 1e-4
    assert state.audio_rate == 8000  # the tiny audio VAE's


def test_refuses_what_diffusers_refuses(family_runner) -> None:  # type: ignore[no-untyped-def]
    pipeline = family_runner(VARIANT).pipeline
    short = SamplingParams(prompt="x", num_frames=9, height=32, width=32, guidance_scale=1.0)
    with pytest.raises(InvalidRequestError, match="5 to 15 s"):
        pipeline.prepare_encode(DenoiseState("short", short, 1))
    # Guidance-distilled: no input for guidance, so asking for it is refused, not ignored
    # (the request edge validates against these limits before a job is made).
    limits = family_runner(VARIANT).limits
    plain = SamplingParams(prompt="x", num_frames=FRAMES, height=32, width=32, guidance_scale=1.0)
    assert plain.validate_for(limits).num_frames == FRAMES
    # Any count is rounded up to the 17 n + 5 the VAE encodes, as diffusers does, before the
    # request is queued (a video job reports the frames its MP4 will have).
    assert dataclasses.replace(plain, num_frames=FRAMES - 4).validate_for(limits).num_frames \
        == FRAMES
    assert limits.aligned_frames(FRAMES + 1) == FRAMES + 17
    for field, change in (("negative_prompt", dict(negative_prompt="y", true_cfg_scale=4.0)),
                          ("negative_prompt", dict(negative_prompt="y")),
                          ("guidance_scale", dict(guidance_scale=3.0)),
                          ("true_cfg_scale", dict(true_cfg_scale=2.0))):
        with pytest.raises(InvalidRequestError, match="guidance-distilled") as refused:
            dataclasses.replace(plain, **change).validate_for(limits)
        assert refused.value.field == field


MIXED: dict[int, list[tuple[str, SamplingParams]]] = {
    0: [("long", SamplingParams(prompt="a red fox running through the snow at dusk",
                                num_inference_steps=4, seed=11, **BASE))],
    1: [("short", SamplingParams(prompt="sea", num_inference_steps=2, seed=12, **BASE)),
        ("two", SamplingParams(prompt="two cats", num_inference_steps=2, seed=14,
                               num_images=2, **BASE))],
}


@pytest.fixture(scope="module")
def alone(family_runner) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    return drive_alone(family_runner(VARIANT), MIXED)


def test_batched_equals_alone(family_runner, alone) -> None:  # type: ignore[no-untyped-def]
    batched, sizes = drive(family_runner(VARIANT), MIXED, max_num_seqs=4)
    assert max(sizes) >= 3, "the scenario must actually batch"
    assert_same(batched, alone)
    assert (batched["long"] - batched["short"]).abs().max().item() > 1e-3
    assert (batched["two"][0] - batched["two"][1]).abs().max().item() > 1e-3


def test_batched_sound_equals_alone(family_runner) -> None:  # type: ignore[no-untyped-def]
    # Requests at different steps with other prompts in one forward: each one's sound too.
    runner = family_runner(VARIANT)
    wanted = [(rid, SamplingParams(**{**p.__dict__, "audio": True}))
              for group in MIXED.values() for rid, p in group]
    together = run_pipeline(runner, wanted)
    single = run_pipeline(runner, [wanted[1]])[wanted[1][0]]
    got = together[wanted[1][0]].audio
    assert got is not None and single.audio is not None
    assert (got - single.audio).abs().max().item() <= SAME
    assert together["two"].audio is not None and together["two"].audio.shape[0] == 2


def test_offload_equals_resident(family_offload_runner, alone) -> None:  # type: ignore[no-untyped-def]
    runner = family_offload_runner(VARIANT)
    assert runner.offload is not None
    report = runner.offload_report()
    # The refiner's block and the two blocks stream.
    assert report is not None and report["blocks"] == 3
    # The Qwen3-VL conditioner is placed by the whole-pipeline plan: streamed by DLO.
    assert runner.pipeline_report()["memory"]["encoder_modes"] == {
        "text_encoder": "streamed"}
    offloaded, _ = drive(runner, MIXED, max_num_seqs=4)
    assert_same(offloaded, alone)


def test_a_tiny_models_default_request_is_a_5_s_clip(family_dir) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.server.model_defaults import model_defaults

    defaults = model_defaults(family_dir(VARIANT))
    assert defaults.output == "video" and defaults.frames == FRAMES
    assert defaults.width % 32 == 0 and defaults.height % 32 == 0


def test_generate_muxes_the_sound_track(family_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import av

    from ditserve.engine.cli.main import main

    out = tmp_path / "cat.mp4"
    code = main(["generate", "--model", str(family_dir(VARIANT)), "--device", "cpu",
                 "--prompt", "a red cat", "--steps", "2", "--seed", "4", "--height", "32",
                 "--width", "64", "--num-frames", str(FRAMES), "--audio", "--out", str(out)])
    assert code == 0
    with av.open(str(out)) as container:
        assert container.streams.video[0].frames == FRAMES
        sound = container.streams.audio[0]
        assert sound.codec_context.name == "aac" and sound.rate == 8000
        assert sound.channels == 2


@pytest.mark.slow
def test_sp2_equals_alone(family_dir, family_runner, alone, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Two gloo ranks, DLO streaming over them; the packed sequences' odd lengths pad the
    # shards. A keyframe request (its conditioning rows split like the others) rides along.
    from ditserve.engine.loop.engine import DiffusionEngine

    monkeypatch.setenv("DITSERVE_WORKER_TIMEOUT_S", "120")
    keyframed = KEYFRAME_MIX[0][1]
    alone = {**alone, **drive_alone(family_runner(VARIANT), {0: [keyframed]})}
    wanted = [(rid, p) for group in MIXED.values() for rid, p in group] + [keyframed]
    config = EngineConfig(model=str(family_dir(VARIANT)), device="cpu",
                          offload=OffloadConfig(enabled=True),
                          parallel=ParallelConfig(sequence_parallel_size=2),
                          scheduler=SchedulerConfig(max_num_seqs=4))
    engine = DiffusionEngine(config).start()
    try:
        dit: Any = engine.runner.pipeline.transformer
        assert type(dit.transformer_blocks[0].attn.processor).__name__ == \
            "MiniMaxH3UlyssesProcessor"
        handles = {rid: engine.add_request(p) for rid, p in wanted}
        results = {rid: h.result(timeout=240).pixels for rid, h in handles.items()}
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert_same(results, alone)
    assert stats.mean_batch_rows > 1  # the requests shared forwards


def test_offload_keeps_the_vaes_own_tiling(family_offload_runner) -> None:  # type: ignore[no-untyped-def]
    # MiniMax-H3's released frames are its VAE's blended 256 px tiles (on by default): the
    # engine's decode tiling (512 px tiles, off below 480p) must leave them as they are.
    runner = family_offload_runner(VARIANT)
    vae: Any = runner.pipeline.vae
    assert vae.use_tiling and vae.tile_sample_min_height == 256
    assert runner.whole.tiling is None


def test_step_cache_is_refused_with_the_reason(family_runner) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.config.step_cache import StepCacheSpec

    runner = family_runner(VARIANT)
    assert runner.step_cache.policies == ()
    with pytest.raises(InvalidRequestError, match="packed"):
        runner.step_cache.check(StepCacheSpec(policy="first-block"))


@pytest.mark.gpu
def test_on_cuda_matches_diffusers_and_dlo_equals_resident(family_dir) -> None:  # type: ignore[no-untyped-def]
    # On the device machine: the same equality on CUDA (fp32), and DLO (copy stream, pinned
    # slabs) == resident, alone and batched.
    model = family_dir(VARIANT)
    params = CASES["wide"]
    with open_runner(model, device="cuda") as resident:
        state = run_pipeline(resident, [("wide", params)])["wide"]
        want, _ = drive(resident, MIXED, max_num_seqs=4)
    video, sound = reference(model, params, device="cuda")
    assert state.pixels is not None and state.audio is not None
    assert (state.pixels - video).abs().max().item() <= TOLERANCE
    assert (state.audio - sound.float()).abs().max().item() <= AUDIO_TOLERANCE
    with open_runner(model, device="cuda", offload=OffloadConfig(enabled=True)) as offloaded:
        got, sizes = drive(offloaded, MIXED, max_num_seqs=4)
    assert max(sizes) >= 3
    assert_same(got, want)


def test_two_shape_groups_under_dlo_equal_alone(family_offload_runner, family_runner) -> None:  # type: ignore[no-untyped-def]
    # Requests of two sizes in one step: one packed forward per shape group, interleaved
    # block by block under DLO (each group's forward reads its own items).
    shapes = {0: [("wide", SamplingParams(prompt="a lighthouse", num_inference_steps=2,
                                          seed=21, **BASE)),
                  ("tall", SamplingParams(prompt="a tall tower at night",
                                          num_inference_steps=2, seed=22,
                                          **{**BASE, "height": 64, "width": 32}))]}
    single = drive_alone(family_runner(VARIANT), shapes)
    together, sizes = drive(family_offload_runner(VARIANT), shapes, max_num_seqs=2)
    assert max(sizes) == 2  # both shape groups in the same steps
    assert_same(together, single)
