"""Cosmos3 on its tiny model: equal to diffusers' own Cosmos3OmniPipeline for the same seed
(text-to-video, text-to-image, image-to-video, the sound track; every frame and every audio
sample), and its own result alone == batched == under DLO == over two sequence-parallel
ranks (gloo). Its DiT's own checks are test_cosmos3_dit.py's, what it writes and serves
(MP4 with sound, PNG) test_cosmos3_outputs.py's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]
from families.cosmos3_support import (  # type: ignore[import-not-found]
    BASE,
    CASES,
    VARIANT,
    picture,
    reference,
    reference_on,
    run_pipeline,
)
from families.family_support import (  # type: ignore[import-not-found]
    AUDIO_TOLERANCE,
    SAME,
    TOLERANCE,
    assert_same,
    drive_alone,
    open_runner,
)

from ditserve.engine.config import EngineConfig, OffloadConfig, ParallelConfig, SchedulerConfig
from ditserve.engine.request import SamplingParams
from ditserve.engine.step.denoise_state import DenoiseState


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
    return drive_alone(family_runner(VARIANT), MIXED)


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


def test_offload_equals_resident(family_offload_runner, alone) -> None:  # type: ignore[no-untyped-def]
    runner = family_offload_runner(VARIANT)
    assert runner.offload is not None
    report = runner.offload_report()
    assert report is not None and report["blocks"] == 2  # the two decoder layers stream
    # The token table and the unused language-model head are neither streamed nor
    # resident: they stay in host memory.
    dit: Any = runner.pipeline.transformer
    assert {id(m) for m in runner.pipeline.host_modules} == {id(dit.embed_tokens),
                                                             id(dit.lm_head)}
    offloaded, _ = drive(runner, MIXED, max_num_seqs=4)
    assert_same(offloaded, alone)


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


SHAPES: dict[int, list[tuple[str, SamplingParams]]] = {
    0: [("square", SamplingParams(prompt="a fox", num_frames=5, num_inference_steps=4,
                                  seed=21, guidance_scale=3.0, **BASE))],
    1: [("wide", SamplingParams(prompt="sea waves", num_frames=9, num_inference_steps=3,
                                seed=22, guidance_scale=1.0, height=32, width=96)),
        ("animated", SamplingParams(prompt="the cat walks", num_frames=5,
                                    num_inference_steps=2, seed=23, guidance_scale=2.0,
                                    images=(picture(40, 40, 2),), **BASE))],
}


def test_shape_groups_under_offload_equal_alone(family_offload_runner, family_runner) -> None:  # type: ignore[no-untyped-def]
    # Three shape groups in one step: under DLO their forwards interleave at layer
    # boundaries (one pass of weights), each with its own packed sequences.
    single = drive_alone(family_runner(VARIANT), SHAPES)
    outputs: list[Any] = []
    together, _ = drive(family_offload_runner(VARIANT), SHAPES, max_num_seqs=3,
                        outputs=outputs)
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
        with open_runner(model, device="cuda", offload=offload) as runner:
            dit: Any = runner.pipeline.transformer
            assert dit.embed_tokens.weight.device.type == "cpu"
            assert dit.lm_head.weight.device.type == "cpu"
            results[name] = run_pipeline(runner, requests)
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
