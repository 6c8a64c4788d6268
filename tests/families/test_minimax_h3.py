"""MiniMax-H3 on its tiny model: equal to diffusers' own modular pipeline (``t2va``, and
``fl2va`` with a first and/or last frame) for the same seed, every frame and every audio
sample, and its own result alone == batched == under DLO == over two sequence-parallel ranks
(gloo).

The clips are MiniMax-H3's shortest (5 s at 24 fps: 124 frames, 37 latent frames; diffusers
refuses shorter ones) on a 32 px high canvas, so a request is a few hundred rows."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import (
    EngineConfig,
    OffloadConfig,
    ParallelConfig,
    RunnerConfig,
    SchedulerConfig,
)
from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.request import ConditionImage, SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner
from ditserve.engine.step.denoise_state import DenoiseState
from ditserve.engine.step.input_batch import InputBatchBuilder

VARIANT = "minimax-h3"
TOLERANCE = 1e-3  # fp32, pixels in [0, 1] (as the other families' reference tests)
# fp32 waveform samples in [-1, 1]: the same ops on the same latents, so as tight as pixels.
AUDIO_TOLERANCE = 1e-3
SAME = 1e-4  # ours against ours (batching, offload, SP sum in another order)
FRAMES = 124  # 5 s at 24 fps, 17 n + 5

CASES: dict[str, SamplingParams] = {
    "wide": SamplingParams(prompt="a red cat", num_frames=FRAMES, height=32, width=64,
                           num_inference_steps=2, seed=7, guidance_scale=1.0, audio=True),
    "tall-rounded": SamplingParams(prompt="waves on a beach at dusk", num_frames=121,
                                   height=64, width=32, num_inference_steps=3, seed=9,
                                   guidance_scale=1.0, audio=True),
}


def reference(model_dir: Any, p: SamplingParams, device: str = "cpu"
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' modular pipeline on the same directory: (1, F, 3, H, W), (1, 2, samples).
    A request with images runs diffusers' ``fl2va`` workflow (``image``: the first frame,
    ``last_image``: the last)."""
    import diffusers
    from transformers import AutoImageProcessor
    from transformers.processing_utils import ProcessorMixin

    from ditserve.engine.pipelines.conditioning import to_pil

    pipe = diffusers.ModularPipeline.from_pretrained(str(model_dir))
    parts = ("transformer", "text_encoder", "tokenizer", "vae", "audio_vae", "scheduler",
             "audio_scheduler")
    pipe.load_components(names=list(parts), dtype=torch.float32)
    for name in ("transformer", "text_encoder", "vae", "audio_vae"):
        getattr(pipe, name).to(device)
    pipe.set_progress_bar_config(disable=True)
    # The Qwen3-VL processor needs torchvision for its video half (not installed here); the
    # t2va and fl2va branches call its image processor (transformers' own, from the model's
    # processor folder) and create_mm_token_type_ids (transformers' function, given the ids).
    config = pipe.text_encoder.config
    ids = types.SimpleNamespace(image_token_ids=[config.image_token_id],
                                video_token_ids=[config.video_token_id], audio_token_ids=[])
    pipe.processor = types.SimpleNamespace(
        image_processor=AutoImageProcessor.from_pretrained(str(model_dir / "processor")),
        create_mm_token_type_ids=lambda x: ProcessorMixin.create_mm_token_type_ids(ids, x))
    frames = [to_pil(image) for image in p.images]
    keyframes: dict[str, Any] = {}
    if frames:
        keyframes["last_image" if p.last_frame else "image"] = frames[-1]
        if len(frames) == 2:
            keyframes["image"] = frames[0]
    # diffusers counts its sigma grid's points: one more than the forwards (pipeline doc).
    out = pipe(prompt=p.prompt, num_frames=p.num_frames, height=p.height, width=p.width,
               num_inference_steps=p.num_inference_steps + 1,
               generator=torch.Generator().manual_seed(p.seed or 0), output_type="pt",
               output=["videos", "audio"], **keyframes)
    return out["videos"].cpu(), out["audio"].cpu()


def run_pipeline(runner: ModelRunner, requests: Sequence[tuple[str, SamplingParams]]
                 ) -> dict[str, DenoiseState]:
    """Every request through the runner's pipeline at once (one forward per step over the
    ones still running), by hand: what a step's result is, with the sound track."""
    pipeline = runner.pipeline
    states = {rid: DenoiseState(rid, p, p.seed or 0) for rid, p in requests}
    for state in states.values():
        pipeline.prepare_encode(state)
    builder = InputBatchBuilder()
    while running := [s for s in states.values()
                      if s.step_index < s.params.num_inference_steps]:
        batch = builder.build(running)
        output = pipeline.denoise_step(batch)
        for state, rows in zip(running, batch.split(output), strict=True):
            pipeline.step(state, rows)
    for state in states.values():
        pipeline.post_decode(state)
    return states


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
    negative = SamplingParams(prompt="x", negative_prompt="y", true_cfg_scale=4.0,
                              num_frames=FRAMES, height=32, width=32)
    with pytest.raises(InvalidRequestError, match="guidance-distilled"):
        pipeline.prepare_encode(DenoiseState("cfg", negative, 1))


BASE = {"num_frames": FRAMES, "height": 32, "width": 64, "guidance_scale": 1.0}
MIXED: dict[int, list[tuple[str, SamplingParams]]] = {
    0: [("long", SamplingParams(prompt="a red fox running through the snow at dusk",
                                num_inference_steps=4, seed=11, **BASE))],
    1: [("short", SamplingParams(prompt="sea", num_inference_steps=2, seed=12, **BASE)),
        ("two", SamplingParams(prompt="two cats", num_inference_steps=2, seed=14,
                               num_images=2, **BASE))],
}


@pytest.fixture(scope="module")
def alone(family_runner) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    out: dict[str, torch.Tensor] = {}
    for requests in MIXED.values():
        for rid, params in requests:
            pixels, _ = drive(family_runner(VARIANT), {0: [(rid, params)]}, max_num_seqs=1)
            out[rid] = pixels[rid]
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for rid, pixels in want.items():
        assert got[rid].shape == pixels.shape
        diff = (got[rid] - pixels).abs().max().item()
        assert diff <= SAME, f"request {rid}: max abs diff {diff}"


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


def test_offload_equals_resident(family_dir, alone) -> None:  # type: ignore[no-untyped-def]
    model = family_dir(VARIANT)
    runner = ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cpu",
                                                      offload=OffloadConfig(enabled=True))),
                         model_dir=model)
    try:
        assert runner.offload is not None
        report = runner.offload_report()
        # The refiner's block and the two blocks stream.
        assert report is not None and report["blocks"] == 3
        # The Qwen3-VL conditioner is placed by the whole-pipeline plan: streamed by DLO.
        assert runner.pipeline_report()["memory"]["encoder_modes"] == {
            "text_encoder": "streamed"}
        offloaded, _ = drive(runner, MIXED, max_num_seqs=4)
    finally:
        runner.close()
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
    pixels, _ = drive(family_runner(VARIANT), {0: [keyframed]}, max_num_seqs=1)
    alone = {**alone, keyframed[0]: pixels[keyframed[0]]}
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


def test_offload_keeps_the_vaes_own_tiling(family_dir) -> None:  # type: ignore[no-untyped-def]
    # MiniMax-H3's released frames are its VAE's blended 256 px tiles (on by default): the
    # engine's decode tiling (512 px tiles, off below 480p) must leave them as they are.
    model = family_dir(VARIANT)
    runner = ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cpu",
                                                      offload=OffloadConfig(enabled=True))),
                         model_dir=model)
    try:
        vae: Any = runner.pipeline.vae
        assert vae.use_tiling and vae.tile_sample_min_height == 256
        assert runner.whole.tiling is None
    finally:
        runner.close()


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
    resident = ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cuda")),
                           model_dir=model)
    try:
        params = CASES["wide"]
        state = run_pipeline(resident, [("wide", params)])["wide"]
        want, _ = drive(resident, MIXED, max_num_seqs=4)
    finally:
        resident.close()
    video, sound = reference(model, params, device="cuda")
    assert state.pixels is not None and state.audio is not None
    assert (state.pixels - video).abs().max().item() <= TOLERANCE
    assert (state.audio - sound.float()).abs().max().item() <= AUDIO_TOLERANCE
    offloaded = ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cuda",
                                                         offload=OffloadConfig(enabled=True))),
                            model_dir=model)
    try:
        got, sizes = drive(offloaded, MIXED, max_num_seqs=4)
    finally:
        offloaded.close()
    assert max(sizes) >= 3
    assert_same(got, want)


def test_two_shape_groups_under_dlo_equal_alone(family_dir, family_runner) -> None:  # type: ignore[no-untyped-def]
    # Requests of two sizes in one step: one packed forward per shape group, interleaved
    # block by block under DLO (each group's forward reads its own items).
    shapes = {0: [("wide", SamplingParams(prompt="a lighthouse", num_inference_steps=2,
                                          seed=21, **BASE)),
                  ("tall", SamplingParams(prompt="a tall tower at night",
                                          num_inference_steps=2, seed=22,
                                          **{**BASE, "height": 64, "width": 32}))]}
    single: dict[str, torch.Tensor] = {}
    for rid, params in shapes[0]:
        pixels, _ = drive(family_runner(VARIANT), {0: [(rid, params)]}, max_num_seqs=1)
        single[rid] = pixels[rid]
    model = family_dir(VARIANT)
    runner = ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cpu",
                                                      offload=OffloadConfig(enabled=True))),
                         model_dir=model)
    try:
        together, sizes = drive(runner, shapes, max_num_seqs=2)
    finally:
        runner.close()
    assert max(sizes) == 2  # both shape groups in the same steps
    assert_same(together, single)


# -- the keyframe workflow (fl2va) -------------------------------------------------------------
def frame(width: int, height: int, seed: int) -> ConditionImage:
    """A keyframe of random pixels (every pixel reaches the VAE and the vision tower)."""
    pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(seed))
    return ConditionImage(width, height, pixels.numpy().tobytes())


KEYFRAME_BASE = {"num_frames": FRAMES, "height": 32, "width": 64, "guidance_scale": 1.0,
                 "audio": True}
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


KEYFRAME_MIX: dict[int, list[tuple[str, SamplingParams]]] = {
    0: [("first", SamplingParams(prompt="a lighthouse at dawn", num_inference_steps=3, seed=31,
                                 images=(frame(64, 32, 5),), **BASE)),
        # The same keyframe size: one packed forward with "first", another anchor.
        ("last", SamplingParams(prompt="sea", num_inference_steps=2, seed=32,
                                images=(frame(64, 32, 6),), last_frame=True, **BASE)),
        ("text", SamplingParams(prompt="two cats", num_inference_steps=2, seed=33, **BASE))],
    1: [("both", SamplingParams(prompt="a storm", num_inference_steps=2, seed=34, num_images=2,
                                images=(frame(64, 32, 7), frame(40, 40, 8)), last_frame=True,
                                **BASE))],
}


def test_keyframes_batched_with_text_to_video_under_dlo_equal_alone(family_dir, family_runner) -> None:  # type: ignore[no-untyped-def]
    # Keyframe requests beside a text-only one, at other steps, two videos of one request
    # with their own keyframe noise: under DLO, every result equals the request alone.
    single: dict[str, torch.Tensor] = {}
    for group in KEYFRAME_MIX.values():
        for rid, params in group:
            pixels, _ = drive(family_runner(VARIANT), {0: [(rid, params)]}, max_num_seqs=1)
            single[rid] = pixels[rid]
    model = family_dir(VARIANT)
    runner = ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cpu",
                                      offload=OffloadConfig(enabled=True))), model_dir=model)
    try:
        outputs: list[Any] = []
        together, sizes = drive(runner, KEYFRAME_MIX, max_num_seqs=4, outputs=outputs)
    finally:
        runner.close()
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
    resident = ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cuda")), model_dir=model)
    try:
        state = run_pipeline(resident, [("first-last", params)])["first-last"]
        want, _ = drive(resident, KEYFRAME_MIX, max_num_seqs=4)
    finally:
        resident.close()
    video, sound = reference(model, params, device="cuda")
    assert state.pixels is not None and state.audio is not None
    assert (state.pixels - video).abs().max().item() <= TOLERANCE
    assert (state.audio - sound.float()).abs().max().item() <= AUDIO_TOLERANCE
    offloaded = ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cuda",
                                         offload=OffloadConfig(enabled=True))), model_dir=model)
    try:
        got, sizes = drive(offloaded, KEYFRAME_MIX, max_num_seqs=4)
    finally:
        offloaded.close()
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
