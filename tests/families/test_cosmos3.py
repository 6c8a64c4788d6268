"""Cosmos3 on its tiny model: equal to diffusers' own Cosmos3OmniPipeline for the same seed
(text-to-video, text-to-image, image-to-video, the sound track; every frame and every audio
sample), and its own result alone == batched == under DLO == over two sequence-parallel
ranks (gloo)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import (
    EngineConfig,
    OffloadConfig,
    ParallelConfig,
    PipelineConfig,
    ResolvedOffload,
    RunnerConfig,
    SchedulerConfig,
)
from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.request import ConditionImage, SamplingParams
from ditserve.engine.runner.group_forwards import shape_groups
from ditserve.engine.runner.model_runner import ModelRunner
from ditserve.engine.server.streaming import parse_sse
from ditserve.engine.step.denoise_state import DenoiseState
from ditserve.engine.step.input_batch import InputBatchBuilder

VARIANT = "cosmos3"
TOLERANCE = 1e-3  # fp32, pixels in [0, 1] (as the other families' reference tests)
AUDIO_TOLERANCE = 1e-3  # fp32, waveform samples in [-1, 1]
SAME = 1e-4  # ours against ours (batching, offload, SP sum in another order)


def picture(width: int, height: int, seed: int) -> ConditionImage:
    rng = np.random.default_rng(seed)
    return ConditionImage(width, height, rng.integers(0, 256, (height, width, 3),
                                                      dtype=np.uint8).tobytes())


BASE = {"height": 64, "width": 64}
CASES: dict[str, SamplingParams] = {
    "t2v-cfg": SamplingParams(prompt="a red cat", negative_prompt="fog", num_frames=5,
                              num_inference_steps=3, seed=7, guidance_scale=4.0, **BASE),
    "t2v-plain": SamplingParams(prompt="waves on a beach", num_frames=9, guidance_scale=1.0,
                                num_inference_steps=4, seed=9, height=32, width=96),
    "t2i": SamplingParams(prompt="a lighthouse", num_frames=1, num_inference_steps=3, seed=5,
                          guidance_scale=3.0, **BASE),
    "i2v": SamplingParams(prompt="the cat walks", negative_prompt="blur", num_frames=5,
                          num_inference_steps=3, seed=3, guidance_scale=5.0,
                          images=(picture(80, 48, 1),), **BASE),
    "sound": SamplingParams(prompt="rain on a roof", num_frames=5, num_inference_steps=3,
                            seed=4, guidance_scale=2.0, audio=True, **BASE),
}


def reference(model_dir: Any, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    import diffusers

    pipe = diffusers.Cosmos3OmniPipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    return reference_on(pipe, p)  # (1, F, 3, H, W), (channels, samples)


def run_pipeline(runner: ModelRunner, requests: Sequence[tuple[str, SamplingParams]]
                 ) -> dict[str, DenoiseState]:
    """Every request through the runner's pipeline at once (one forward per step and shape
    group over the ones still running), by hand: what a step's result is, with the sound track."""
    pipeline = runner.pipeline
    states = {rid: DenoiseState(rid, p, p.seed or 0) for rid, p in requests}
    for state in states.values():
        pipeline.prepare_encode(state)
    builder = InputBatchBuilder()
    while running := [s for s in states.values()
                      if s.step_index < s.params.num_inference_steps]:
        for group in shape_groups(running):  # one forward per shape group, as the runner
            batch = builder.build(group)
            output = pipeline.denoise_step(batch)
            for state, rows in zip(group, batch.split(output), strict=True):
                pipeline.step(state, rows)
    for state in states.values():
        pipeline.post_decode(state)
    return states


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_diffusers(family_dir, family_runner, case: str) -> None:  # type: ignore[no-untyped-def]
    params = CASES[case]
    state = run_pipeline(family_runner(VARIANT), [(case, params)])[case]
    video, sound = reference(family_dir(VARIANT), params)
    assert state.pixels is not None
    assert state.pixels.shape == video.shape == (1, params.num_frames, 3, params.height,
                                                 params.width)
    diff = (state.pixels - video).abs().max().item()
    assert diff <= TOLERANCE, f"max abs pixel diff {diff}"
    assert state.pixels.std().item() > 1e-3  # not a constant video
    if params.audio:
        assert sound is not None and state.audio is not None
        assert state.audio.shape == (1, *sound.shape)
        audio_diff = (state.audio[0] - sound.float()).abs().max().item()
        assert audio_diff <= AUDIO_TOLERANCE, f"max abs audio diff {audio_diff}"
        assert state.audio.std().item() > 1e-4
    else:
        assert state.audio is None


def test_image_condition_is_the_first_frame(family_runner) -> None:  # type: ignore[no-untyped-def]
    # The i2v case is conditioned: without its image the same seed gives another video.
    params = CASES["i2v"]
    plain = SamplingParams(**{**params.__dict__, "images": ()})
    runner = family_runner(VARIANT)
    with_image = run_pipeline(runner, [("with", params)])["with"].pixels
    without = run_pipeline(runner, [("without", plain)])["without"].pixels
    assert with_image is not None and without is not None
    assert (with_image[:, 0] - without[:, 0]).abs().max().item() > 1e-2


MIXED: dict[int, list[tuple[str, SamplingParams]]] = {
    0: [("long", SamplingParams(prompt="a red fox running through the snow at dusk",
                                num_frames=5, num_inference_steps=5, seed=11,
                                guidance_scale=4.0, negative_prompt="blurry", **BASE))],
    2: [("short", SamplingParams(prompt="sea", num_frames=5, num_inference_steps=2, seed=12,
                                 guidance_scale=1.0, **BASE)),
        ("sound", SamplingParams(prompt="thunder", num_frames=5, num_inference_steps=3,
                                 seed=13, guidance_scale=3.0, audio=True, **BASE))],
    3: [("two", SamplingParams(prompt="two cats", num_frames=5, num_inference_steps=2,
                               seed=14, num_images=2, guidance_scale=2.0, **BASE))],
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


def test_batched_sound_equals_alone(family_runner) -> None:  # type: ignore[no-untyped-def]
    # Requests with and without a sound track, at different steps, in one forward.
    runner = family_runner(VARIANT)
    requests = [(rid, p) for group in MIXED.values() for rid, p in group]
    together = run_pipeline(runner, requests)
    single = run_pipeline(runner, [("sound", dict(requests)["sound"])])["sound"]
    assert together["sound"].audio is not None and single.audio is not None
    assert (together["sound"].audio - single.audio).abs().max().item() <= SAME
    assert together["long"].audio is None


def test_offload_equals_resident(family_dir, alone) -> None:  # type: ignore[no-untyped-def]
    model = family_dir(VARIANT)
    runner = ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cpu",
                                                      offload=OffloadConfig(enabled=True))),
                         model_dir=model)
    try:
        assert runner.offload is not None
        report = runner.offload_report()
        assert report is not None and report["blocks"] == 2  # the two decoder layers stream
        # The token table and the unused language-model head are neither streamed nor
        # resident: they stay in host memory.
        dit: Any = runner.pipeline.transformer
        assert {id(m) for m in runner.pipeline.host_modules} == {id(dit.embed_tokens),
                                                                 id(dit.lm_head)}
        offloaded, _ = drive(runner, MIXED, max_num_seqs=4)
    finally:
        runner.close()
    assert_same(offloaded, alone)


def test_audio_refused_without_sound(family_runner) -> None:  # type: ignore[no-untyped-def]
    # Another family's model has no sound track: the request is refused at the edge.
    limits = family_runner("wan").limits
    with pytest.raises(InvalidRequestError, match="audio"):
        SamplingParams(prompt="x", num_frames=5, audio=True).validate_for(limits)
    assert family_runner(VARIANT).limits.audio


@pytest.mark.slow
def test_sp2_equals_alone(family_dir, alone, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Two gloo ranks, DLO streaming over them; 64 px at 5 frames is 2 x 2 x 2 vision
    # tokens, the prompts' odd lengths pad the prompt pathway's shards.
    from ditserve.engine.loop.engine import DiffusionEngine

    monkeypatch.setenv("DITSERVE_WORKER_TIMEOUT_S", "120")
    wanted = [(rid, p) for group in MIXED.values() for rid, p in group]
    config = EngineConfig(model=str(family_dir(VARIANT)), device="cpu",
                          offload=OffloadConfig(enabled=True),
                          parallel=ParallelConfig(sequence_parallel_size=2),
                          scheduler=SchedulerConfig(max_num_seqs=4))
    engine = DiffusionEngine(config).start()
    try:
        # Rank 0 runs in this process: its layers attend through the Ulysses processor.
        dit: Any = engine.runner.pipeline.transformer
        assert type(dit.layers[0].self_attn.processor).__name__ == "Cosmos3UlyssesProcessor"
        handles = {rid: engine.add_request(p) for rid, p in wanted}
        results = {rid: h.result(timeout=240).pixels for rid, h in handles.items()}
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert_same(results, alone)
    assert stats.mean_batch_rows > 1  # the requests shared forwards


def test_generate_muxes_the_sound_track(family_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import av

    from ditserve.engine.cli.main import main

    out = tmp_path / "rain.mp4"
    code = main(["generate", "--model", str(family_dir(VARIANT)), "--device", "cpu",
                 "--prompt", "rain on a roof", "--steps", "2", "--seed", "4", "--height", "64",
                 "--width", "64", "--num-frames", "9", "--audio", "--out", str(out)])
    assert code == 0
    with av.open(str(out)) as container:
        assert container.streams.video[0].frames == 9
        sound = container.streams.audio[0]
        assert sound.codec_context.name == "aac" and sound.rate == 8000  # the tiny tokenizer's
        assert sound.channels == 2


def test_step_cache_is_refused_with_the_reason(family_dir) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.config.step_cache import StepCacheSpec

    model = family_dir(VARIANT)
    runner = ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cpu")),
                         model_dir=model)
    try:
        assert runner.step_cache.policies == ()
        with pytest.raises(InvalidRequestError, match="packed"):
            runner.step_cache.check(StepCacheSpec(policy="first-block"))
    finally:
        runner.close()


def test_a_model_that_asks_for_the_safety_checker_loads_without_it(family_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # A released model_index.json may name the guardrail (a package ditserve does not
    # install) and turn it on: the loader leaves it out instead of failing.
    import json
    import shutil

    from ditserve.engine.weights.loader import load_components

    model = tmp_path / "released-like"
    shutil.copytree(family_dir(VARIANT), model)
    index = json.loads((model / "model_index.json").read_text())
    index.update(enable_safety_checker=True,
                 safety_checker=["cosmos_guardrail", "CosmosSafetyChecker"])
    (model / "model_index.json").write_text(json.dumps(index))
    loaded = load_components(model)
    assert loaded.pipeline.safety_checker is None
    assert loaded.config["enable_safety_checker"] is False


SHAPES: dict[int, list[tuple[str, SamplingParams]]] = {
    0: [("square", SamplingParams(prompt="a fox", num_frames=5, num_inference_steps=4,
                                  seed=21, guidance_scale=3.0, **BASE))],
    1: [("wide", SamplingParams(prompt="sea waves", num_frames=9, num_inference_steps=3,
                                seed=22, guidance_scale=1.0, height=32, width=96)),
        ("animated", SamplingParams(prompt="the cat walks", num_frames=5,
                                    num_inference_steps=2, seed=23, guidance_scale=2.0,
                                    images=(picture(40, 40, 2),), **BASE))],
}


def test_shape_groups_under_offload_equal_alone(family_dir, family_runner) -> None:  # type: ignore[no-untyped-def]
    # Three shape groups in one step: under DLO their forwards interleave at layer
    # boundaries (one pass of weights), each with its own packed sequences.
    single = {}
    for requests in SHAPES.values():
        for rid, params in requests:
            pixels, _ = drive(family_runner(VARIANT), {0: [(rid, params)]}, max_num_seqs=1)
            single[rid] = pixels[rid]
    model = family_dir(VARIANT)
    runner = ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cpu",
                                                      offload=OffloadConfig(enabled=True))),
                         model_dir=model)
    outputs: list[Any] = []
    try:
        together, _ = drive(runner, SHAPES, max_num_seqs=3, outputs=outputs)
    finally:
        runner.close()
    assert max(out.forward_groups for out in outputs) == 3
    assert_same(together, single)


@pytest.mark.gpu
def test_on_cuda_dlo_equals_resident_and_diffusers(family_dir) -> None:  # type: ignore[no-untyped-def]
    # The device path: the token table stays on the host (its rows uploaded), DLO streams
    # the layers through the copy stream and equals resident exactly; both equal diffusers'
    # own pipeline on the same device, the sound track included.
    model = family_dir(VARIANT)
    requests = [(rid, CASES[rid]) for rid in ("t2v-cfg", "i2v", "sound")]
    results = {}
    for name, offload in (("resident", OffloadConfig()),
                          ("dlo", OffloadConfig(enabled=True, checkpoint_mmap="off"))):
        config = RunnerConfig.of(EngineConfig(model=str(model), device="cuda", offload=offload))
        runner = ModelRunner(config, model_dir=model)
        try:
            dit: Any = runner.pipeline.transformer
            assert dit.embed_tokens.weight.device.type == "cpu"
            assert dit.lm_head.weight.device.type == "cpu"
            results[name] = run_pipeline(runner, requests)
        finally:
            runner.close()
    import diffusers

    pipe = diffusers.Cosmos3OmniPipeline.from_pretrained(model).to("cuda")
    pipe.set_progress_bar_config(disable=True)
    for rid, params in requests:
        resident, offloaded = results["resident"][rid], results["dlo"][rid]
        assert torch.equal(resident.pixels, offloaded.pixels), rid
        video, sound = reference_on(pipe, params)
        assert (resident.pixels - video).abs().max().item() <= TOLERANCE, rid
        if params.audio:
            assert resident.audio is not None and sound is not None
            assert (resident.audio[0] - sound.float().cpu()).abs().max().item() <= AUDIO_TOLERANCE


def reference_on(pipe: Any, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """diffusers' call on an already loaded (and placed) pipeline, as ``reference``."""
    from PIL import Image

    image = None
    if p.images:
        i = p.images[0]
        image = Image.frombytes("RGB", (i.width, i.height), i.rgb)
    out = pipe(p.prompt, negative_prompt=p.negative_prompt, image=image,
               num_frames=p.num_frames, height=p.height, width=p.width,
               num_inference_steps=p.num_inference_steps, guidance_scale=p.guidance_scale,
               enable_sound=p.audio, generator=torch.Generator("cpu").manual_seed(p.seed),
               output_type="pt")
    return out.video.float().cpu()[None], out.sound


def test_work_rule_counts_the_dits_tokens(family_runner) -> None:  # type: ignore[no-untyped-def]
    # Sizes go by 16 px, tokens are 32-px patches: a 64x64, 5-frame video is 2 x 2 x 2 tokens
    # per row, as the pipeline's layout holds them; CFG doubles the rows.
    runner = family_runner(VARIANT)
    params = CASES["t2v-cfg"]
    work = runner.work_rule.of(params)
    state = run_pipeline(runner, [("w", params)])["w"]
    layout = state.host["layouts"][0]
    assert work.tokens_per_row == layout.num_vision == 8
    assert work.rows == state.rows == 2


def test_a_preview_leaves_the_request_alone(family_runner) -> None:  # type: ignore[no-untyped-def]
    import dataclasses

    from ditserve.engine.pipelines.base import decode_preview

    runner = family_runner(VARIANT)
    params = CASES["sound"]
    state = DenoiseState("p", params, params.seed or 0)
    runner.pipeline.prepare_encode(state)
    preview = decode_preview(runner.pipeline, state)  # before the first step
    assert preview.shape == (1, params.num_frames, 3, params.height, params.width)
    assert state.pixels is None and state.audio is None  # the request itself is untouched
    # A decode before the last step (a preview's) makes no sound track: only the result has one.
    early = dataclasses.replace(state, pixels=None)
    runner.pipeline.post_decode(early)
    assert early.pixels is not None and early.audio is None


def test_operator_judges_sp_by_the_key_value_heads() -> None:
    # Ulysses splits Cosmos3's 8 key-value heads: 8 ranks serve, 16 serve none of its models.
    from ditserve.engine.config.rules import family_sequence_parallel_problems

    assert family_sequence_parallel_problems(8, "Cosmos3") == []
    (problem,) = family_sequence_parallel_problems(16, "Cosmos3")
    assert "use one of 1, 2, 4, 8" in problem


def test_sliced_token_math_equals_whole(family_dir) -> None:  # type: ignore[no-untyped-def]
    # Slices of 3 tokens (the tiny sequences are tens long): the feed-forwards and the RoPE
    # run slice by slice and give the whole-sequence forward's result.
    from ditserve.engine.families.cosmos3 import block, packing
    from ditserve.engine.weights.loader import load_dit

    dit: Any = load_dit(family_dir(VARIANT), dtype="float32")
    dit.set_attn_processor(packing.PackedItemsProcessor())
    g = torch.Generator().manual_seed(0)
    und, gen = torch.randn(40, 32, generator=g), torch.randn(24, 32, generator=g)
    rope = tuple(torch.randn(n, 16, generator=g) for n in (40, 40, 24, 24))
    layer = dit.layers[0]
    whole = layer(und, gen, rope)
    block.chunk_token_math(dit, chunk_tokens=3)
    saved = packing.ROPE_CHUNK_TOKENS
    packing.ROPE_CHUNK_TOKENS = 3
    try:
        sliced = layer(und, gen, rope)
    finally:
        packing.ROPE_CHUNK_TOKENS = saved
    for a, b in zip(whole, sliced, strict=True):
        assert (a - b).abs().max().item() <= 1e-5


def test_sliced_token_math_never_upcasts_a_whole_sequence(family_dir) -> None:  # type: ignore[no-untyped-def]
    # diffusers' RMSNorm works in float32: over a 720p step's 88k tokens its copies of the
    # queries were the layer's largest tensors. Sliced, no float32 tensor spans a pathway.
    from torch.utils._python_dispatch import TorchDispatchMode

    from ditserve.engine.families.cosmos3 import block, packing
    from ditserve.engine.weights.loader import load_dit

    class Float32Rows(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.rows: set[int] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim():
                    self.rows.add(int(t.shape[0]))
            return out

    dit: Any = load_dit(family_dir(VARIANT), dtype="bfloat16")
    dit.set_attn_processor(packing.PackedItemsProcessor())
    block.chunk_token_math(dit, chunk_tokens=3)
    g = torch.Generator().manual_seed(0)
    und, gen = (torch.randn(n, 32, generator=g).to(torch.bfloat16) for n in (40, 24))
    rope = tuple(torch.randn(n, 16, generator=g).to(torch.bfloat16) for n in (40, 40, 24, 24))
    with torch.no_grad(), Float32Rows() as seen:
        dit.layers[0](und, gen, rope)
    assert seen.rows and not seen.rows & {40, 24}


def test_memory_plan_leaves_the_host_modules_out(family_runner) -> None:  # type: ignore[no-untyped-def]
    # The planner's resident DiT bytes are the tensors outside the layers and outside the
    # token table and LM head, which never reach the device.
    from ditserve.engine.placement.memory_estimates import budget_inputs

    runner = family_runner(VARIANT)
    dit: Any = runner.pipeline.transformer
    skipped = {id(t) for m in (dit.layers, dit.embed_tokens, dit.lm_head)
               for t in (*m.parameters(), *m.buffers())}
    resident = sum(t.numel() * t.element_size() for t in (*dit.parameters(), *dit.buffers())
                   if id(t) not in skipped)
    inputs = budget_inputs(runner.pipeline, scheduler=SchedulerConfig(),
                           pipeline_config=PipelineConfig(), offload=ResolvedOffload())
    assert inputs.dit_fixed == resident


def fp8_run(model: Any, device: str, offload: OffloadConfig) -> dict[str, torch.Tensor]:
    """Two requests (one with CFG) sharing steps, bfloat16 with ``--quantization fp8``."""
    runner = ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device=device, dtype="bfloat16",
                                                      quantization="fp8", offload=offload)),
                         model_dir=model)
    try:
        from ditserve.engine.formats.fp8_linear import FP8Linear

        # The tiny layers' attention projections (multiples of 16) are FP8; its MLP is not.
        assert any(isinstance(m, FP8Linear) for m in runner.pipeline.transformer.modules())
        requests = [(rid, CASES[rid]) for rid in ("t2v-cfg", "t2i")]
        out, sizes = drive(runner, {0: requests}, max_num_seqs=2)
    finally:
        runner.close()
    assert max(sizes) == 2
    return out


def test_fp8_dlo_equals_resident_fp8(family_dir) -> None:  # type: ignore[no-untyped-def]
    # The Super-sized DiT's bench streams FP8 layers: DLO of FP8 blocks == resident FP8.
    model = family_dir(VARIANT)
    resident = fp8_run(model, "cpu", OffloadConfig())
    offloaded = fp8_run(model, "cpu", OffloadConfig(enabled=True))
    assert set(resident) == set(offloaded)
    for rid in resident:
        assert torch.equal(offloaded[rid], resident[rid]), rid


@pytest.mark.gpu
def test_on_cuda_fp8_dlo_equals_resident_fp8(family_dir) -> None:  # type: ignore[no-untyped-def]
    model = family_dir(VARIANT)
    resident = fp8_run(model, "cuda", OffloadConfig())
    offloaded = fp8_run(model, "cuda", OffloadConfig(enabled=True, checkpoint_mmap="off"))
    for rid in resident:
        assert torch.equal(offloaded[rid], resident[rid]), rid


def test_a_tiny_models_default_request_is_tiny(family_dir) -> None:  # type: ignore[no-untyped-def]
    """Cosmos3's DiT config names its width ``hidden_size``: a tiny one is read as a test
    model (64x64, 4 steps, a short clip), not given the released 1280x720x189 at 35 steps,
    which a bare ``ditserve generate`` on ``init-tiny --family cosmos3`` would run for hours on
    a CPU."""
    from ditserve.engine.families.defaults import TINY, TINY_VIDEO_FRAMES
    from ditserve.engine.server.model_defaults import model_defaults

    defaults = model_defaults(family_dir(VARIANT))
    assert defaults.output == "video"
    assert (defaults.width, defaults.height, defaults.steps) == (TINY.width, TINY.height,
                                                                 TINY.steps)
    assert defaults.frames == TINY_VIDEO_FRAMES


def test_the_released_width_is_not_a_test_models() -> None:
    from ditserve.engine.families.base import dit_width

    assert dit_width({"hidden_size": 4096, "num_attention_heads": 32, "head_dim": 128}) == 4096


# Text-to-image as a user asks for it: an image, not a one-frame MP4.
T2I = CASES["t2i"]


def eight_bit(pixels: torch.Tensor) -> np.ndarray:
    """diffusers' [0, 1] pixels as the PNG writer rounds them (a 1e-3 difference may move a
    value across a rounding boundary: one level)."""
    from ditserve.engine.media.images import to_pil_images

    return np.asarray(to_pil_images(pixels)[0]).astype(np.int16)


def png_pixels(data: bytes) -> np.ndarray:
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        assert (image.format, image.mode) == ("PNG", "RGB")
        return np.asarray(image).astype(np.int16)


def test_image_route_answers_the_one_frame_as_a_png(family_dir) -> None:  # type: ignore[no-untyped-def]
    """POST /v1/images/generations on a Cosmos3 replica, through the OpenAI SDK: the PNG is
    diffusers' num_frames=1 call; n=2 gives two; the card and the document say it is served."""
    import asyncio
    import base64

    import httpx
    import openai

    from ditserve.engine.loop.engine import DiffusionEngine
    from ditserve.engine.server.app import create_app
    from ditserve.engine.server.config import ServerConfig

    model = family_dir(VARIANT)
    engine = DiffusionEngine(EngineConfig(model=str(model), device="cpu")).start()
    app = create_app(engine, ServerConfig(model_name="cosmos3-tiny"), start_engine=False)

    async def script() -> tuple[Any, Any, dict[str, Any], dict[str, Any], str]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused",
                                        http_client=http, max_retries=0)
            one = await client.images.generate(
                model="cosmos3-tiny", prompt=T2I.prompt, size="64x64",
                extra_body={"num_inference_steps": T2I.num_inference_steps, "seed": T2I.seed,
                            "guidance_scale": T2I.guidance_scale})
            two = await client.images.generate(
                model="cosmos3-tiny", prompt="a harbour", size="64x32", n=2,
                extra_body={"num_inference_steps": 2, "seed": 1})
            card = (await http.get("/v1/models/cosmos3-tiny")).json()
            streamed = await http.post("/v1/images/generations", json={
                "prompt": "a harbour", "size": "32x32", "stream": True, "partial_images": 1,
                "num_inference_steps": 2})
            return one, two, card, (await http.get("/openapi.json")).json(), streamed.text

    try:
        one, two, card, doc, streamed = asyncio.run(script())
    finally:
        app.state.server.stop()
    assert one.data is not None and len(one.data) == 1 and one.output_format == "png"
    got = png_pixels(base64.b64decode(one.data[0].b64_json or ""))
    want, _ = reference(model, T2I)  # (1, 1, 3, H, W)
    assert got.shape == (64, 64, 3)
    assert np.abs(got - eight_bit(want)).max() <= 1
    assert got.std() > 1  # not a constant image
    assert two.data is not None and len(two.data) == 2
    assert [png_pixels(base64.b64decode(d.b64_json or "")).shape for d in two.data] == \
        [(32, 64, 3)] * 2
    assert card["ditserve"]["output"] == "video" and card["ditserve"]["images"] is True
    assert {"/v1/images/generations", "/v1/videos"} <= set(doc["paths"])
    assert "ImageGenerationRequest" in doc["components"]["schemas"]
    images = [(kind, data) for kind, data in parse_sse(streamed)
              if kind.startswith("image_generation.")]  # between ditserve's progress events
    assert [kind for kind, _ in images] == ["image_generation.partial_image",
                                           "image_generation.completed"]
    assert all(png_pixels(base64.b64decode(data["b64_json"])).shape == (32, 32, 3)
               for _, data in images)


def test_generate_writes_a_png(family_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``generate --out x.png`` on a Cosmos3 model writes diffusers' num_frames=1 image (no
    --num-frames needed); an image cannot hold more frames or a sound track."""
    from ditserve.engine.cli.main import main

    model = family_dir(VARIANT)
    out = tmp_path / "lighthouse.png"
    common = ["generate", "--model", str(model), "--device", "cpu", "--prompt", T2I.prompt,
              "--steps", str(T2I.num_inference_steps), "--seed", str(T2I.seed),
              "--guidance-scale", str(T2I.guidance_scale), "--height", "64", "--width", "64"]
    assert main([*common, "--out", str(out)]) == 0
    want, _ = reference(model, T2I)
    assert np.abs(png_pixels(out.read_bytes()) - eight_bit(want)).max() <= 1
    for refused in (["--num-frames", "5"], ["--audio"]):
        assert main([*common, *refused, "--out", str(tmp_path / "no.png")]) == 2
    assert not (tmp_path / "no.png").exists()


def test_only_a_video_model_that_makes_still_images_writes_an_image(family_dir) -> None:  # type: ignore[no-untyped-def]
    """Cosmos3's defaults say it makes still images; a video model that does not (Wan) is
    refused an image ``--out`` before loading, as before."""
    from pathlib import Path

    from ditserve.engine.cli.generate import output_path
    from ditserve.engine.errors import ConfigError
    from ditserve.engine.server.model_defaults import model_defaults

    defaults = model_defaults(family_dir(VARIANT))
    assert defaults.output == "video" and defaults.still_images and defaults.makes_images
    out = Path("x.png")
    assert output_path(out, video=True, still_images=True) == out
    with pytest.raises(ConfigError, match="this is a video model"):
        output_path(out, video=True)
