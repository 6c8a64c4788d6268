"""FLUX.2 [dev] and [klein]: ditserve's output equals diffusers' own Flux2Pipeline /
Flux2KleinPipeline for the same model, prompt, size, steps, guidance, reference images and
seed (every pixel within 1e-3); alone, batched with other sizes and with text-only requests,
under DLO, with the step cache; and the tiny models' tokenizers and encoders are what the
pipelines accept."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]
from PIL import Image

from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig
from ditserve.engine.request import ConditionImage, SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner

TOLERANCE = 1e-3  # fp32, pixels in [0, 1]


def picture(width: int, height: int, seed: int) -> ConditionImage:
    """A smooth random picture (what a VAE sees in practice, unlike white noise)."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (max(2, height // 8), max(2, width // 8), 3), dtype=np.uint8)
    image = Image.fromarray(coarse).resize((width, height), Image.BILINEAR)
    return ConditionImage(width, height, image.tobytes())


def as_pil(image: ConditionImage) -> Any:
    return Image.frombytes("RGB", (image.width, image.height), image.rgb)


def reference(model_dir: Path, p: SamplingParams) -> torch.Tensor:
    """diffusers' own pipeline on ``p`` (the class model_index.json names)."""
    import diffusers

    klein = "Flux2KleinPipeline" in (model_dir / "model_index.json").read_text()
    cls = diffusers.Flux2KleinPipeline if klein else diffusers.Flux2Pipeline
    pipe = cls.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    kwargs: dict[str, Any] = {}
    if p.images:
        kwargs["image"] = [as_pil(i) for i in p.images]
    return pipe(prompt=p.prompt, height=p.height, width=p.width,
                num_inference_steps=p.num_inference_steps, guidance_scale=p.guidance_scale,
                num_images_per_prompt=p.num_images,
                generator=torch.Generator("cpu").manual_seed(p.seed or 0), output_type="pt",
                **kwargs).images.float()


CASES: dict[str, tuple[str, SamplingParams]] = {
    "dev-plain": ("flux2", SamplingParams(
        prompt="a red cat", height=32, width=48, num_inference_steps=3, seed=7,
        guidance_scale=4.0)),
    "dev-two-images": ("flux2", SamplingParams(
        prompt="a blue dog on a mat", height=48, width=32, num_inference_steps=2, seed=3,
        guidance_scale=2.5, num_images=2)),
    "dev-one-reference": ("flux2", SamplingParams(
        prompt="make it red", height=32, width=32, num_inference_steps=2, seed=5,
        guidance_scale=3.0, images=(picture(72, 64, 1),))),
    "dev-two-references": ("flux2", SamplingParams(
        prompt="the cat from one on the mat of two", height=32, width=48,
        num_inference_steps=2, seed=6, guidance_scale=4.0,
        images=(picture(64, 80, 2), picture(96, 64, 3)))),
    "klein-cfg": ("flux2-klein", SamplingParams(
        prompt="a red cat", height=32, width=48, num_inference_steps=3, seed=7,
        guidance_scale=4.0)),
    "klein-no-cfg-two": ("flux2-klein", SamplingParams(
        prompt="waves", height=32, width=32, num_inference_steps=2, seed=8,
        guidance_scale=1.0, num_images=2)),
    "klein-cfg-reference": ("flux2-klein", SamplingParams(
        prompt="make it blue", height=32, width=32, num_inference_steps=2, seed=9,
        guidance_scale=3.0, images=(picture(64, 64, 4),))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_diffusers(family_dir: Callable[[str], Path], family_runner: Any,
                           case: str) -> None:
    variant, params = CASES[case]
    ours, _ = drive(family_runner(variant), {0: [(case, params)]}, max_num_seqs=1)
    expected = reference(family_dir(variant), params)
    got = ours[case]
    assert got.shape == expected.shape
    diff = (got - expected).abs().max().item()
    assert diff <= TOLERANCE, f"max abs diff {diff}"
    assert got.std().item() > 1e-3  # not a constant image: the comparison means something


def test_klein_rows_follow_guidance(family_runner: Any) -> None:
    """[klein] adds the empty prompt's rows only when guidance_scale > 1 (true CFG)."""
    rule = family_runner("flux2-klein").work_rule
    assert rule.rows(SamplingParams(prompt="x", guidance_scale=4.0)) == 2
    assert rule.rows(SamplingParams(prompt="x", guidance_scale=1.0)) == 1
    dev = family_runner("flux2").work_rule
    assert dev.rows(SamplingParams(prompt="x", guidance_scale=4.0)) == 1  # guidance embedding


def _runner(model: Path, **config: Any) -> ModelRunner:
    return ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cpu", **config)),
                       model_dir=model)


MIXED = {  # text-only and edits of other sizes arriving together and mid-run
    "text-a": SamplingParams(prompt="a red cat", height=32, width=32, num_inference_steps=3,
                             seed=1, guidance_scale=4.0),
    "text-b": SamplingParams(prompt="a tall tower", height=48, width=32,
                             num_inference_steps=2, seed=2, guidance_scale=2.0),
    "edit-a": SamplingParams(prompt="make it red", height=32, width=32, num_inference_steps=3,
                             seed=3, guidance_scale=4.0, images=(picture(64, 64, 5),)),
    "edit-b": SamplingParams(prompt="swap them", height=32, width=32, num_inference_steps=2,
                             seed=4, guidance_scale=4.0,
                             images=(picture(64, 64, 6), picture(80, 64, 7))),
}


@pytest.mark.parametrize("variant", ["flux2", "flux2-klein"])
@pytest.mark.parametrize("dlo", [False, True], ids=["resident", "dlo"])
def test_mixed_batch_equals_solo(family_dir: Callable[[str], Path], family_runner: Any,
                                 variant: str, dlo: bool) -> None:
    """Text-only requests and edits of several sizes sharing steps (and DLO streaming the
    blocks) give each request its solo resident image."""
    solo = {rid: drive(family_runner(variant), {0: [(rid, p)]}, max_num_seqs=1)[0][rid]
            for rid, p in MIXED.items()}
    runner = (_runner(family_dir(variant), offload=OffloadConfig(enabled=True)) if dlo
              else family_runner(variant))
    items = list(MIXED.items())
    got, sizes = drive(runner, {0: items[:2], 1: items[2:]}, max_num_seqs=4)
    assert max(sizes) > 1  # requests really shared steps
    for rid, image in solo.items():
        assert (got[rid] - image).abs().max().item() <= TOLERANCE, rid


# Released DiT sizes (parameters), block counts and widths: FLUX.2 [dev] 32B, [klein] 4B / 9B.
FULL = {"flux2": (31.5e9, 33e9, (8, 48), 6144), "flux2-klein": (3.7e9, 4.1e9, (5, 20), 3072),
        "flux2-klein-9b": (8.8e9, 9.4e9, (8, 24), 4096)}


@pytest.mark.parametrize("variant", sorted(FULL))
def test_full_size_dits_have_the_released_shapes(variant: str) -> None:
    from ditserve.engine.makers.builders import dit_class, dit_config

    low, high, blocks, width = FULL[variant]
    with torch.device("meta"):  # shapes only: nothing allocated
        model = dit_class(variant)(**dit_config(variant, "full"))
    params = sum(p.numel() for p in model.parameters())
    assert low <= params <= high, f"{variant}: {params / 1e9:.2f}B parameters"
    assert (len(model.transformer_blocks), len(model.single_transformer_blocks)) == blocks
    assert model.config.num_attention_heads * model.config.attention_head_dim == width
    # The text input is three stacked encoder layers.
    assert model.config.joint_attention_dim == 3 * {6144: 5120, 3072: 2560, 4096: 4096}[width]


def test_tiny_tokenizer_templates() -> None:
    """The in-code tokenizers render the chat layouts the released ones do."""
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input

    from ditserve.engine.families.flux2.builders import make_tokenizer
    from ditserve.engine.families.flux2_klein import builders as klein

    mistral = make_tokenizer()
    text = mistral.apply_chat_template(format_input(["ünï cat"], "sys")[0], tokenize=False)
    assert text == "<s>[SYSTEM_PROMPT]sys[/SYSTEM_PROMPT][INST]ünï cat[/INST]"
    qwen = klein.make_tokenizer().apply_chat_template(
        [{"role": "user", "content": "cat"}], tokenize=False, add_generation_prompt=True,
        enable_thinking=False)
    assert qwen == "<|im_start|>user\ncat<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_distilled_klein_ignores_guidance(family_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """A step-distilled [klein] (``is_distilled`` in model_index.json) runs no CFG rows at
    guidance 4, as diffusers' pipeline, and equals it."""
    import json
    import shutil

    model = tmp_path / "distilled"
    shutil.copytree(family_dir("flux2-klein"), model)
    index = json.loads((model / "model_index.json").read_text())
    (model / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    runner = _runner(model)
    params = SamplingParams(prompt="a red cat", height=32, width=32, num_inference_steps=2,
                            seed=4, guidance_scale=4.0)
    state_rows: list[int] = []
    encode = runner.pipeline.prepare_encode

    def recording(state: Any) -> None:
        encode(state)
        state_rows.append(state.rows)

    runner.pipeline.prepare_encode = recording
    ours, _ = drive(runner, {0: [("d", params)]}, max_num_seqs=1)
    assert state_rows == [1]
    assert runner.work_rule.rows(params) == 1  # admitted as the one row it runs
    assert (ours["d"] - reference(model, params)).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize(("width", "height"), [(64, 64), (1024, 1024), (1025, 1024),
                                               (2000, 1500), (4000, 16), (16, 4000), (3000, 17),
                                               (1536, 640), (777, 1999), (4096, 4096)])
def test_reference_size_is_the_size_diffusers_prepares(width: int, height: int) -> None:
    # The work rule counts a reference's tokens from ``reference_size`` without resizing a
    # pixel; the image diffusers' Flux2Pipeline actually encodes must have exactly that size.
    # (A side under 16 crops to nothing in diffusers; the edge refuses references under 64
    # pixels a side or beyond 1:8 before this.)
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    from ditserve.engine.families.flux2.pipeline import MAX_REFERENCE_PIXELS, reference_size

    multiple = 16  # the VAE's 8x and the 2x2 patch
    image = Flux2ImageProcessor._resize_if_exceeds_area(Image.new("RGB", (width, height)),
                                                        MAX_REFERENCE_PIXELS)
    w, h = image.size
    processed = Flux2ImageProcessor(vae_scale_factor=8).preprocess(
        image, height=h // multiple * multiple, width=w // multiple * multiple,
        resize_mode="crop")
    assert reference_size(width, height, multiple) == (processed.shape[-1], processed.shape[-2])
