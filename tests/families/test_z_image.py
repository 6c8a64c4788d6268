"""Z-Image (Turbo and Base) on the tiny model: equal to diffusers' own ZImagePipeline for the
same seed (without guidance, with CFG and a negative prompt, several images), and to its
ZImageImg2ImgPipeline and ZImageInpaintPipeline from a source image (and a mask), batched equal
to alone (different sizes, steps, guidance and prompt lengths in one step), layerwise offload
equal to resident, and the checkpoint's defaults (Turbo's 8 steps without guidance)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig
from ditserve.engine.request import ConditionImage, SamplingParams
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
    resident, _ = drive(ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cpu")),
                                    model_dir=model), arrivals, max_num_seqs=5)
    runner = ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cpu",
                                                      offload=OffloadConfig(enabled=True,
                                                                            checkpoint_mmap="off"))),
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
    from ditserve.engine.makers.builders import dit_class, dit_config

    with torch.device("meta"):  # shapes only: nothing allocated
        model = dit_class(VARIANT)(**dit_config(VARIANT, "full"))
    params = sum(p.numel() for p in model.parameters())
    assert 6.0e9 <= params <= 6.3e9, f"{params / 1e9:.2f}B parameters"  # 6.15B released
    assert [len(model.get_submodule(n)) for n in ("noise_refiner", "context_refiner",
                                                   "layers")] == [2, 2, 30]
    assert model.config.dim == 3840 and model.config.n_heads == 30


def source_image(width: int, height: int, seed: int) -> ConditionImage:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
    return ConditionImage(width, height, pixels.numpy().tobytes())


def mask_image(width: int, height: int) -> ConditionImage:
    """White (repaint) on the left half, black (keep) on the right, as a grey RGB image."""
    pixels = torch.zeros(height, width, 3, dtype=torch.uint8)
    pixels[:, : width // 2] = 255
    return ConditionImage(width, height, pixels.numpy().tobytes())


EDIT_CASES: dict[str, SamplingParams] = {
    "img2img": SamplingParams(prompt="a red cat", guidance_scale=0.0, num_inference_steps=5,
                              seed=21, height=32, width=64, strength=0.6,
                              images=(source_image(64, 32, 1),)),
    "img2img-cfg-two": SamplingParams(prompt="a castle", negative_prompt="fog",
                                      guidance_scale=2.0, num_inference_steps=4, seed=22,
                                      height=32, width=32, strength=0.8, num_images=2,
                                      images=(source_image(32, 32, 2),)),
    "inpaint": SamplingParams(prompt="a blue dog", guidance_scale=0.0, num_inference_steps=4,
                              seed=23, height=32, width=64, strength=1.0,
                              images=(source_image(64, 32, 3),), mask=mask_image(64, 32)),
    "inpaint-partial-cfg": SamplingParams(prompt="a tree", guidance_scale=3.0,
                                          num_inference_steps=5, seed=24, height=64,
                                          width=32, strength=0.7,
                                          images=(source_image(32, 64, 4),),
                                          mask=mask_image(32, 64)),
}


def edit_reference(model_dir: Path, p: SamplingParams) -> torch.Tensor:
    import diffusers

    from ditserve.engine.pipelines.conditioning import to_pil

    cls = diffusers.ZImageInpaintPipeline if p.mask is not None \
        else diffusers.ZImageImg2ImgPipeline
    pipe = cls.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    extra = {"mask_image": to_pil(p.mask)} if p.mask is not None else {}
    return pipe(p.prompt, image=to_pil(p.images[0]), strength=p.strength,
                negative_prompt=p.negative_prompt, height=p.height, width=p.width,
                num_inference_steps=p.num_inference_steps, guidance_scale=p.guidance_scale,
                num_images_per_prompt=p.num_images,
                generator=torch.Generator("cpu").manual_seed(p.seed or 0), output_type="pt",
                **extra).images.float()


@pytest.mark.parametrize("case", sorted(EDIT_CASES))
def test_edits_match_diffusers(family_dir, family_runner, case: str) -> None:  # type: ignore[no-untyped-def]
    params = EDIT_CASES[case]
    ours, _ = drive(family_runner(VARIANT), {0: [(case, params)]}, max_num_seqs=1)
    expected = edit_reference(family_dir(VARIANT), params)
    got = ours[case]
    assert got.shape == expected.shape == (params.num_images, 3, params.height, params.width)
    diff = (got - expected).abs().max().item()
    assert diff <= TOLERANCE, f"max abs diff {diff}"


def test_edits_batched_with_generations_equal_alone(family_runner) -> None:  # type: ignore[no-untyped-def]
    runner = family_runner(VARIANT)
    arrivals = {0: [("img2img", EDIT_CASES["img2img"]),
                    ("text", SamplingParams(prompt="a ship", guidance_scale=0.0, seed=5,
                                            num_inference_steps=3, height=32, width=64))],
                1: [("inpaint", EDIT_CASES["inpaint-partial-cfg"])]}
    batched, sizes = drive(runner, arrivals, max_num_seqs=3)
    assert max(sizes) == 3
    for requests in arrivals.values():
        for rid, params in requests:
            alone, _ = drive(runner, {0: [(f"alone-{rid}", params)]}, max_num_seqs=1)
            diff = (batched[rid] - alone[f"alone-{rid}"]).abs().max().item()
            assert diff <= BATCH_TOLERANCE, f"request {rid}: max abs diff {diff}"


def test_strength_defaults_and_steps_follow_diffusers(family_runner) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.errors import InvalidRequestError

    limits = family_runner(VARIANT).limits
    assert limits.image_strength == (0.6, 1.0)  # diffusers' img2img and inpaint defaults
    assert limits.condition_images == (0, 1)
    source = source_image(32, 32, 1)
    base = SamplingParams(prompt="x", height=32, width=32, num_inference_steps=8,
                          images=(source,))
    filled = base.validate_for(limits)
    # diffusers' get_timesteps: 8 - int(8 - 8 * 0.6) = 5 of the 8 steps run
    assert filled.strength == 0.6 and filled.denoise_steps == 5
    masked = dataclasses.replace(base, mask=mask_image(32, 32)).validate_for(limits)
    assert masked.strength == 1.0 and masked.denoise_steps == 8
    with pytest.raises(InvalidRequestError, match="runs no step"):
        dataclasses.replace(base, strength=0.0).validate_for(limits)
    with pytest.raises(InvalidRequestError, match="source image"):
        SamplingParams(prompt="x", height=32, width=32, mask=mask_image(32, 32)
                       ).validate_for(limits)


def test_fp8_quantizes_the_blocks_linears_and_runs_close(family_runner) -> None:  # type: ignore[no-untyped-def]
    import copy

    from ditserve.engine.formats.fp8_linear import FP8Linear
    from ditserve.engine.formats.fp8_select import FP8Rule, quantize_fp8, select_linears

    dit = copy.deepcopy(family_runner(VARIANT).pipeline.transformer)
    kept = select_linears(dit, FP8Rule(include_modulation=False)).kept
    assert kept["layers.0.adaLN_modulation.0"] == "modulation"
    assert kept["cap_embedder.1"] == "outside the streamed blocks"
    generator = torch.Generator().manual_seed(0)
    images = [torch.randn(16, 1, 4, 4, generator=generator)]
    captions = [torch.randn(7, 32, generator=generator)]
    t = torch.full((1,), 0.5)
    with torch.no_grad():
        want = dit(images, t, captions, return_dict=False)[0][0]
        report = quantize_fp8(dit)
        got = dit(images, t, captions, return_dict=False)[0][0]
    assert isinstance(dit.layers[0].attention.to_q, FP8Linear)
    assert isinstance(dit.noise_refiner[0].attention.to_out[0], FP8Linear)
    # The tiny FFN is 85 wide (dim * 8/3), off scaled_mm's 16-grid; the released 10240 is on.
    assert report.layers > 0
    assert 0 < ((got - want).norm() / want.norm()) < 0.05  # emulated e4m3 on the CPU


def test_regional_compilation_equals_eager(family_dir) -> None:  # type: ignore[no-untyped-def]
    # aot_eager traces the repeated ZImageTransformerBlock (dynamo) without generating code.
    model = family_dir(VARIANT)
    arrivals = {0: [
        ("plain", SamplingParams(prompt="a red fox", guidance_scale=0.0, seed=1,
                                 num_inference_steps=2, height=32, width=32)),
        ("cfg", SamplingParams(prompt="a castle at night in the rain", guidance_scale=2.0,
                               seed=2, num_inference_steps=2, height=32, width=64))]}
    eager, _ = drive(ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cpu")),
                                 model_dir=model), arrivals, max_num_seqs=2)
    compiled, _ = drive(ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cpu",
                                                                 compile="aot_eager")),
                                    model_dir=model),
                        arrivals, max_num_seqs=2)
    for rid, want in eager.items():
        diff = (compiled[rid] - want).abs().max().item()
        assert diff <= DLO_TOLERANCE, f"request {rid}: max abs diff {diff}"
