"""A request with LoRA adapters equals diffusers' pipeline with ``load_lora_weights`` +
``set_adapters`` at the same scales (Flux, Qwen-Image, Wan, Z-Image, FLUX.2 [dev] and [klein]; one adapter, two stacked, and a
kohya-format Flux file converted by diffusers); requests with different adapters and one
without, in one step, each equal their solo runs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.adapters.bank import startup_refs
from ditserve.engine.request import LoraRef, SamplingParams

TOLERANCE = 1e-3  # fp32 on CPU, pixels in [0, 1]


def params(family: str, **extra: Any) -> SamplingParams:
    base: dict[str, Any] = {"prompt": "a red cat", "num_inference_steps": 3, "seed": 7,
                            "height": 32, "width": 32}
    if family == "wan":
        base |= {"guidance_scale": 1.0, "num_frames": 5}
    return SamplingParams(**(base | extra))


def refs(runner: Any, chosen: dict[str, float]) -> tuple[LoraRef, ...]:
    """The runner's startup adapters named in ``chosen``, at those scales."""
    known = {ref.name: ref for ref in startup_refs(runner.config.adapters)}
    return tuple(LoraRef(name, known[name].path, scale=scale, version=known[name].version)
                 for name, scale in chosen.items())


def reference(model_dir, files, family: str, p: SamplingParams,  # type: ignore[no-untyped-def]
              chosen: dict[str, float]) -> torch.Tensor:
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    for name in chosen:
        pipe.load_lora_weights(str(files[name]), adapter_name=name)
    if chosen:
        pipe.set_adapters(list(chosen), adapter_weights=list(chosen.values()))
    generator = torch.Generator("cpu").manual_seed(p.seed)
    common = {"height": p.height, "width": p.width, "num_inference_steps": p.num_inference_steps,
              "generator": generator, "output_type": "pt"}
    if family == "wan":
        return pipe(p.prompt, num_frames=p.num_frames, guidance_scale=p.guidance_scale,
                    **common).frames.float()
    if family in ("flux", "z-image"):
        return pipe(p.prompt, guidance_scale=p.guidance_scale, **common).images.float()
    if family in ("flux", "flux2", "flux2-klein"):  # FLUX.2's first argument is ``image``
        return pipe(prompt=p.prompt, guidance_scale=p.guidance_scale, **common).images.float()
    return pipe(p.prompt, **common).images.float()


CASES = {
    "flux-one": ("flux", {"a": 1.0}),
    "flux-two-stacked": ("flux", {"a": 0.7, "b": 1.3}),
    "flux-kohya": ("flux", {"kohya": 0.8}),
    "qwen-one": ("qwen-image", {"b": 1.0}),
    "qwen-two-stacked": ("qwen-image", {"a": 1.5, "b": 0.5}),
    "wan-one": ("wan", {"a": 1.0}),
    "wan-two-stacked": ("wan", {"a": 0.6, "b": 1.2}),
    "z-image-one": ("z-image", {"a": 1.0}),
    "z-image-two-stacked": ("z-image", {"a": 0.8, "b": 1.1}),
    "flux2-two-stacked": ("flux2", {"a": 0.7, "b": 1.3}),
    "flux2-klein-one": ("flux2-klein", {"b": 1.0}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_diffusers_lora(adapter_runner, adapter_models, lora_files,  # type: ignore[no-untyped-def]
                                case: str) -> None:
    family, chosen = CASES[case]
    runner = adapter_runner(family)
    p = params(family, loras=refs(runner, chosen))
    ours, _ = drive(runner, {0: [(case, p)]}, max_num_seqs=1)
    expected = reference(adapter_models(family), lora_files(family), family, p, chosen)
    plain, _ = drive(runner, {0: [(f"{case}-plain", params(family))]}, max_num_seqs=1)
    got = ours[case]
    assert got.shape == expected.shape
    diff = (got - expected).abs().max().item()
    assert diff <= TOLERANCE, f"{case}: max abs diff {diff}"
    # The adapter changes the image: the comparison is not of two base-model outputs.
    assert (got - plain[f"{case}-plain"]).abs().max().item() > 10 * TOLERANCE


@pytest.mark.parametrize("family", ["flux", "qwen-image", "wan", "z-image", "flux2"])
def test_mixed_adapters_in_one_step_equal_solo(adapter_runner, family: str) -> None:  # type: ignore[no-untyped-def]
    runner = adapter_runner(family)
    requests = [
        ("with-a", params(family, loras=refs(runner, {"a": 1.0}))),
        ("with-b", params(family, loras=refs(runner, {"b": 0.9}), prompt="a blue dog")),
        ("none", params(family, prompt="a green tree")),
        ("stacked", params(family, loras=refs(runner, {"a": 0.5, "b": 0.5}), seed=3)),
    ]
    together, sizes = drive(runner, {0: requests}, max_num_seqs=4)
    assert max(sizes) == 4, "the four requests must share a step"
    for rid, p in requests:
        alone, _ = drive(runner, {0: [(f"alone-{rid}", p)]}, max_num_seqs=1)
        diff = (together[rid] - alone[f"alone-{rid}"]).abs().max().item()
        assert diff <= 1e-4, f"{family} {rid}: batched differs from solo by {diff}"
