"""MiniMax-H3's omni-reference workflow (``ref2va``) on its tiny model: a ref2va replica
(``write_ref2va_replica``: the checkpoint's ``transformer_ref`` as its DiT) equal to
diffusers' own modular ``ref2va`` workflow for the same seed, every frame and every audio
sample, with one and two image references and with an audio reference; batched with
another reference request of another size == alone; what it refuses.

The tiny model encodes an image reference at a 64 px short edge (its index's
``reference_image_short_edge``; the released model's is 2048)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
)
from families.minimax_support import frame as picture  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, OffloadConfig
from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.reference_media import ReferenceAudio
from ditserve.engine.request import SamplingParams
from ditserve.engine.step.denoise_state import DenoiseState

VARIANT = "minimax-h3"
RATE = 8000  # the tiny audio VAE's


def sound(seconds: float, channels: int, seed: int) -> ReferenceAudio:
    wave = torch.rand((channels, int(seconds * RATE)),
                      generator=torch.Generator().manual_seed(seed)) * 1.6 - 0.8
    return ReferenceAudio(RATE, channels, wave.numpy().astype("<f4").tobytes())


BASE = {**CLIP, "audio": True}  # every request here asks for its sound track
CASES: dict[str, SamplingParams] = {
    "one-image": SamplingParams(prompt="a red cat", num_inference_steps=2, seed=7,
                                references=(picture(40, 24, 1),), **BASE),
    # Two images of other sizes (each at its own 64 px short edge): two blocks of rows.
    "two-images": SamplingParams(prompt="waves on a beach", num_inference_steps=3, seed=9,
                                 references=(picture(64, 32, 2), picture(30, 50, 3)), **BASE),
    # A mono voice after an image: its label and clean rows, truncated to the clip.
    "image-and-audio": SamplingParams(prompt="a dog barks", num_inference_steps=2, seed=5,
                                      references=(picture(48, 48, 4), sound(1.5, 1, 6)),
                                      **BASE),
}


@pytest.fixture(scope="module")
def replica(family_dir, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    from ditserve.engine.families.minimax_h3.references import write_ref2va_replica

    return write_ref2va_replica(family_dir(VARIANT),
                                tmp_path_factory.mktemp("ref2va") / "replica")


@pytest.fixture(scope="module")
def runner(replica) -> Any:  # type: ignore[no-untyped-def]
    with open_runner(replica, device="cpu") as runner:
        yield runner


def reference(model_dir: Path, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' modular pipeline, ``workflow="ref2va"``, on the checkpoint itself (its
    ``transformer_ref``): (1, F, 3, H, W), (1, 2, samples)."""
    from diffusers.modular_pipelines.minimax_h3 import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
    )

    from ditserve.engine.pipelines.conditioning import to_pil

    pipe = diffusers_pipeline(model_dir, "transformer_ref", workflow="ref2va")
    references: list[Any] = []
    for item in p.references:
        if isinstance(item, ReferenceAudio):
            wave = torch.frombuffer(bytearray(item.samples), dtype=torch.float32)
            references.append(MiniMaxH3AudioReference(audio=wave.view(item.channels, -1),
                                                      sample_rate=item.sample_rate))
        else:
            references.append(MiniMaxH3ImageReference(image=to_pil(item)))
    out = pipe(prompt=p.prompt, references=references, num_frames=p.num_frames,
               height=p.height, width=p.width, num_inference_steps=p.num_inference_steps + 1,
               generator=torch.Generator().manual_seed(p.seed or 0), output_type="pt",
               output=["videos", "audio"])
    return out["videos"].cpu(), out["audio"].cpu()


@pytest.mark.parametrize("case", sorted(CASES))
def test_ref2va_matches_diffusers(family_dir, runner, case: str) -> None:  # type: ignore[no-untyped-def]
    params = CASES[case].validate_for(runner.limits)
    state = run_pipeline(runner, [(case, params)])[case]
    video, audio = reference(family_dir(VARIANT), params)
    assert state.pixels is not None and state.audio is not None
    assert state.pixels.shape == video.shape == (1, FRAMES, 3, params.height, params.width)
    diff = (state.pixels - video).abs().max().item()
    assert diff <= TOLERANCE, f"max abs pixel diff {diff}"
    assert state.pixels.std().item() > 1e-3
    assert state.audio.shape == audio.shape
    audio_diff = (state.audio - audio.float()).abs().max().item()
    assert audio_diff <= AUDIO_TOLERANCE, f"max abs audio diff {audio_diff}"
    # The references condition the result: another reference is another video (a small
    # change through the tiny random DiT: ~3e-4 on pixels, far above fp32 noise).
    other = SamplingParams(**{**params.__dict__,
                              "references": (picture(40, 24, 99),) + params.references[1:]})
    moved = run_pipeline(runner, [("other", other)])["other"]
    assert moved.pixels is not None
    assert (moved.pixels - state.pixels).abs().max().item() > 2e-5


def test_replica_serves_transformer_ref(family_dir, replica, runner) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file

    dit: Any = runner.pipeline.transformer
    (weights,) = (family_dir(VARIANT) / "transformer_ref").glob("*.safetensors")
    (plain,) = (family_dir(VARIANT) / "transformer").glob("*.safetensors")
    name = "proj_out.weight"
    assert torch.equal(dit.state_dict()[name], load_file(weights)[name])
    assert not torch.equal(load_file(plain)[name], load_file(weights)[name])
    limits = runner.limits
    assert limits.references is not None and limits.references.images == 9
    assert limits.condition_images == (0, 0) and not limits.last_frame


MIXED: dict[int, list[tuple[str, SamplingParams]]] = {
    0: [("wide", SamplingParams(prompt="a lighthouse", num_inference_steps=3, seed=21,
                                references=(picture(64, 32, 11),), **BASE)),
        ("tall", SamplingParams(prompt="a tall tower at night", num_inference_steps=2, seed=22,
                                references=(picture(32, 32, 12), picture(50, 30, 13)),
                                **{**BASE, "height": 64, "width": 32}))],
    1: [("later", SamplingParams(prompt="sea", num_inference_steps=2, seed=23,
                                 references=(picture(64, 32, 14),), **BASE))],
}


@pytest.fixture(scope="module")
def alone(runner) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    return drive_alone(runner, MIXED)


def test_batched_equals_alone(runner, alone) -> None:  # type: ignore[no-untyped-def]
    together, sizes = drive(runner, MIXED, max_num_seqs=4)
    assert max(sizes) >= 2, "the scenario must actually batch"
    assert_same(together, alone)


def test_offload_equals_resident(replica, alone) -> None:  # type: ignore[no-untyped-def]
    # DLO streams the replica's DiT (the checkpoint's transformer_ref, through the links).
    with open_runner(replica, device="cpu", offload=OffloadConfig(enabled=True)) as offloaded:
        report = offloaded.offload_report()
        assert report is not None and report["blocks"] == 3
        together, _ = drive(offloaded, MIXED, max_num_seqs=4)
    assert_same(together, alone)


def test_ref2va_refusals(runner, family_runner) -> None:  # type: ignore[no-untyped-def]
    limits = runner.limits
    base = dict(prompt="x", **BASE)
    with pytest.raises(InvalidRequestError, match="at least one image or video reference") as e:
        SamplingParams(**base).validate_for(limits)  # text only: diffusers refuses it too
    assert e.value.field == "references"
    with pytest.raises(InvalidRequestError, match="at most 9 image references"):
        SamplingParams(references=(picture(32, 32, 1),) * 10, **base).validate_for(limits)
    with pytest.raises(InvalidRequestError, match="at least one image or video reference"):
        SamplingParams(references=(sound(1.0, 2, 1),), **base).validate_for(limits)
    with pytest.raises(InvalidRequestError, match="8000 Hz"):
        SamplingParams(references=(picture(32, 32, 1), ReferenceAudio(16000, 1, b"\0" * 64)),
                       **base).validate_for(limits)
    with pytest.raises(InvalidRequestError, match="input image"):  # keyframes
        SamplingParams(images=(picture(32, 32, 1),), references=(picture(32, 32, 1),),
                       **base).validate_for(limits)
    narrow = SamplingParams(references=(picture(10, 50, 1),), **base)
    with pytest.raises(InvalidRequestError, match="1:4"):
        runner.pipeline.prepare_encode(DenoiseState("narrow", narrow, 1))
    # A t2va replica takes no references.
    t2va = family_runner(VARIANT).limits
    with pytest.raises(InvalidRequestError, match="ref2va replica") as e:
        SamplingParams(references=(picture(32, 32, 1),), **base).validate_for(t2va)
    assert e.value.field == "references"


def test_generate_takes_references(replica, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import wave

    import av
    import numpy as np

    from ditserve.engine.cli.main import main
    from ditserve.engine.pipelines.conditioning import to_pil

    image = tmp_path / "cat.png"
    to_pil(picture(48, 32, 8)).save(image)
    voice = tmp_path / "voice.wav"
    with wave.open(str(voice), "wb") as writer:
        writer.setnchannels(2)
        writer.setsampwidth(2)
        writer.setframerate(RATE)
        writer.writeframes((np.sin(np.arange(2 * RATE)) * 9000).astype("<i2").tobytes())
    out = tmp_path / "ref.mp4"
    code = main(["generate", "--model", str(replica), "--device", "cpu", "--prompt", "a cat",
                 "--steps", "1", "--seed", "4", "--height", "32", "--width", "64",
                 "--num-frames", str(FRAMES), "--reference", str(image), "--reference",
                 str(voice), "--audio", "--out", str(out)])
    assert code == 0
    with av.open(str(out)) as container:
        assert container.streams.video[0].frames == FRAMES
        assert container.streams.audio[0].rate == RATE
    # A file that cannot be read is refused before the model loads.
    assert main(["generate", "--model", str(replica), "--device", "cpu", "--prompt", "x",
                 "--reference", str(tmp_path / "missing.png"), "--out", str(out)]) != 0
    assert "--reference" in capsys.readouterr().err


@pytest.mark.slow
def test_sp2_equals_alone(replica, alone, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Two gloo ranks, DLO streaming over them (the warm-up itself runs a reference request):
    # the reference blocks are rows like any other, split with the rest.
    from ditserve.engine.config import ParallelConfig, SchedulerConfig
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


@pytest.mark.parametrize("case", sorted(CASES))
def test_work_counts_the_reference_rows(runner, case: str) -> None:  # type: ignore[no-untyped-def]
    """The work rule's conditioning is the image references' rows of the packed sequence
    (each at its own short edge, whatever the canvas); soundtracks are not counted."""
    params = CASES[case]
    state = DenoiseState(case, params, seed=0)
    runner.pipeline.prepare_encode(state)
    rule = runner.work_rule
    conditioning = rule.tokens_per_row(params) - rule.generated_tokens_per_row(params)
    assert conditioning == state.host["layout"].condition_rows > 0
    # The planner's worst case: nine references at 1:4 (the tiny model's 64 px short edge:
    # 256x64, 8 x 2 rows of 32 px) and three videos over the longest clip (345 frames) on the
    # tiny canvas's area (32 x 64: 2 rows a frame).
    pipe = runner.pipeline
    assert pipe.max_frames == 345
    assert pipe.most_condition_tokens == 9 * 8 * 2 + 3 * 345 * 2
