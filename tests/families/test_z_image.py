"""Z-Image (Turbo and Base) on the tiny model: equal to diffusers' own ZImagePipeline for the
same seed (without guidance, with CFG and a negative prompt, several images), batched equal
to alone (different sizes, steps, guidance and prompt lengths in one step), layerwise offload
equal to resident, and the checkpoint's defaults (Turbo's 8 steps without guidance)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, OffloadConfig
from ditserve.engine.request import SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner

VARIANT = "z-image"
TOLERANCE = 1e-3  # fp32, pixels in [0, 1] (as the other families' reference tests)
BATCH_TOLERANCE = 1e-4  # batched vs alone, as tests/families/test_batching.py
# Offloaded vs resident: equal math on other buffers; CPU float32 kernels came out up to
# 1.3e-6 apart on the tiny model (tests/families/test_offload.py documents 3e-7 for others).
DLO_TOLERANCE = 1e-5

CASES: dict[str, SamplingParams] = {
    # Turbo's way: no guidance, one row per image.
    "turbo": SamplingParams(prompt="a red cat", guidance_scale=0.0, num_inference_steps=4,
                            seed=7, height=32, width=64),
    # Base's way: CFG against the empty prompt (diffusers' default negative).
    "cfg-empty-negative": SamplingParams(prompt="a castle at night", guidance_scale=4.0,
                                         num_inference_steps=3, seed=8, height=64, width=32),
    "cfg-negative-two": SamplingParams(prompt="two dogs on a beach", negative_prompt="blurry",
                                       guidance_scale=2.5, num_inference_steps=3, seed=9,
                                       height=32, width=32, num_images=2),
}


def reference(model_dir: Path, p: SamplingParams) -> torch.Tensor:
    import diffusers

    pipe = diffusers.ZImagePipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator("cpu").manual_seed(p.seed or 0)
    return pipe(p.prompt, negative_prompt=p.negative_prompt, height=p.height, width=p.width,
                num_inference_steps=p.num_inference_steps, guidance_scale=p.guidance_scale,
                num_images_per_prompt=p.num_images, generator=generator,
                output_type="pt").images.float()


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_diffusers(family_dir, family_runner, case: str) -> None:  # type: ignore[no-untyped-def]
    params = CASES[case]
    ours, _ = drive(family_runner(VARIANT), {0: [(case, params)]}, max_num_seqs=1)
    expected = reference(family_dir(VARIANT), params)
    got = ours[case]
    assert got.shape == expected.shape == (params.num_images, 3, params.height, params.width)
    diff = (got - expected).abs().max().item()
    assert diff <= TOLERANCE, f"max abs diff {diff}"
    assert got.std().item() > 1e-3  # not a constant image: the comparison means something


def scenario() -> dict[int, list[tuple[str, SamplingParams]]]:
    return {
        0: [("long", SamplingParams(prompt="a red fox in the snow at dusk, photograph",
                                    guidance_scale=0.0, seed=11, num_inference_steps=6,
                                    height=32, width=32))],
        2: [("cfg", SamplingParams(prompt="a castle", negative_prompt="blurry",
                                   guidance_scale=3.0, seed=13, num_inference_steps=3,
                                   height=32, width=32)),
            ("short", SamplingParams(prompt="sea", guidance_scale=0.0, seed=12,
                                     num_inference_steps=2, height=32, width=32)),
            ("wide", SamplingParams(prompt="a long train", guidance_scale=0.0, seed=15,
                                    num_inference_steps=3, height=32, width=64))],
        3: [("two", SamplingParams(prompt="two cats", guidance_scale=1.5, seed=14,
                                   num_inference_steps=2, num_images=2, height=64,
                                   width=32))],
    }


def test_batched_equals_alone(family_runner) -> None:  # type: ignore[no-untyped-def]
    runner = family_runner(VARIANT)
    arrivals = scenario()
    batched, sizes = drive(runner, arrivals, max_num_seqs=5)
    assert max(sizes) >= 4, "the scenario must actually batch"
    for requests in arrivals.values():
        for rid, params in requests:
            alone, _ = drive(runner, {0: [(f"alone-{rid}", params)]}, max_num_seqs=1)
            expected = alone[f"alone-{rid}"]
            assert batched[rid].shape == expected.shape
            diff = (batched[rid] - expected).abs().max().item()
            assert diff <= BATCH_TOLERANCE, f"request {rid}: max abs diff {diff}"
    assert (batched["long"] - batched["short"]).abs().max().item() > 1e-3


def test_dlo_equals_resident(family_dir) -> None:  # type: ignore[no-untyped-def]
    # Two fresh runners with the same history: a shared one's prompt cache may hold a caption
    # encoded in another batch (equal to float noise, not bitwise).
    arrivals = scenario()
    model = family_dir(VARIANT)
    resident, _ = drive(ModelRunner(EngineConfig(model=str(model), device="cpu"),
                                    model_dir=model), arrivals, max_num_seqs=5)
    runner = ModelRunner(EngineConfig(model=str(model), device="cpu",
                                      offload=OffloadConfig(enabled=True,
                                                            checkpoint_mmap="off")),
                         model_dir=model)
    try:
        report = runner.offload_report()
        # noise refiner (1) + context refiner (1) + layers (3) of the tiny DiT
        assert report["streamed_blocks"] == report["blocks"] == 5
        offloaded, sizes = drive(runner, arrivals, max_num_seqs=5)
        passes = runner.offload_report()["passes"]
    finally:
        runner.close()
    assert max(sizes) >= 4
    assert passes == len(sizes)  # several shape groups per step, one pass of weights
    for rid, want in resident.items():
        diff = (offloaded[rid] - want).abs().max().item()
        assert diff <= DLO_TOLERANCE, f"request {rid}: max abs diff {diff}"


def test_turbo_checkpoint_defaults_to_eight_steps_without_guidance(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.families.z_image import TURBO_SCHEDULER
    from ditserve.engine.server.model_defaults import model_defaults

    def model(name: str, scheduler: dict[str, object]) -> Path:
        root = tmp_path / name
        for part, config in {"transformer": {"dim": 3840}, "vae": {"sample_size": 1024},
                             "scheduler": scheduler}.items():
            (root / part).mkdir(parents=True)
            name_ = "scheduler_config.json" if part == "scheduler" else "config.json"
            (root / part / name_).write_text(json.dumps(config))
        (root / "model_index.json").write_text(json.dumps({"_class_name": "ZImagePipeline"}))
        return root

    turbo = model_defaults(model("turbo", dict(TURBO_SCHEDULER)))
    assert (turbo.width, turbo.height, turbo.steps, turbo.guidance) == (1024, 1024, 8, 0.0)
    base = model_defaults(model("base", {"shift": 6.0, "use_dynamic_shifting": False}))
    assert (base.steps, base.guidance) == (50, 5.0)  # ZImagePipeline's own call defaults


def test_work_rule_counts_cfg_rows_as_the_pipeline_builds_them(family_runner) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.step.denoise_state import DenoiseState

    runner = family_runner(VARIANT)
    for guidance, rows in ((0.0, 2), (0.5, 4)):
        params = SamplingParams(prompt="x", guidance_scale=guidance, num_images=2, seed=1,
                                height=32, width=64)
        state = DenoiseState("w", params, seed=1)
        runner.pipeline.prepare_encode(state)
        work = runner.work_rule.of(params)
        assert state.rows == work.rows == rows
        assert work.tokens_per_row == (32 // 16) * (64 // 16)


def test_full_size_dit_has_the_released_shape() -> None:
    from ditserve.engine.model_builders import dit_class, dit_config

    with torch.device("meta"):  # shapes only: nothing allocated
        model = dit_class(VARIANT)(**dit_config(VARIANT, "full"))
    params = sum(p.numel() for p in model.parameters())
    assert 6.0e9 <= params <= 6.3e9, f"{params / 1e9:.2f}B parameters"  # 6.15B released
    assert [len(model.get_submodule(n)) for n in ("noise_refiner", "context_refiner",
                                                   "layers")] == [2, 2, 30]
    assert model.config.dim == 3840 and model.config.n_heads == 30
