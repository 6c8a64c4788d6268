"""Equal to diffusers by default: a `ditserve generate` that names only the prompt, seed, size,
steps (and frames) equals a DEFAULT diffusers pipeline call with the same arguments - no
guidance, CFG scale or text length given on either side - on each family's `init-tiny` model.

Both sides take everything else from the pipeline: diffusers from its call signature, ditserve
from ``server.model_defaults`` (guidance 3.5 for Flux, true CFG 4.0 for Qwen-Image, CFG 5.0
for Wan, 512 text tokens for all). An empty negative prompt with true CFG runs CFG against the
empty prompt, as diffusers does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.cli.generate import generation_params
from ditserve.engine.cli.main import build_parser
from ditserve.engine.request import SamplingParams
from ditserve.engine.server.model_defaults import model_defaults

TOLERANCE = 1e-3  # fp32, pixels in [0, 1], as the other reference tests

# (variant, the only diffusers arguments; the same flags are given to `ditserve generate`)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "flux": ("flux", dict(prompt="a red fox in the snow", height=32, width=64,
                          num_inference_steps=3)),
    "flux-negative-without-cfg": ("flux", dict(prompt="a red fox", negative_prompt="blurry",
                                               height=32, width=32, num_inference_steps=2)),
    "qwen-image": ("qwen-image", dict(prompt="a red cat on a mat", height=32, width=64,
                                      num_inference_steps=3)),
    "qwen-image-empty-negative": ("qwen-image", dict(prompt="a red cat", negative_prompt="",
                                                     height=32, width=32,
                                                     num_inference_steps=3)),
    "wan": ("wan", dict(prompt="waves at dusk", height=32, width=32, num_frames=5,
                        num_inference_steps=3)),
    "wan2.2": ("wan2.2", dict(prompt="waves at dusk", height=32, width=32, num_frames=5,
                              num_inference_steps=4)),
}
SEED = 11


def _generate_flags(model: Path, call: dict[str, Any]) -> list[str]:
    flags = ["generate", "--model", str(model), "--prompt", call["prompt"], "--seed", str(SEED),
             "--height", str(call["height"]), "--width", str(call["width"]),
             "--steps", str(call["num_inference_steps"])]
    if "num_frames" in call:
        flags += ["--num-frames", str(call["num_frames"])]
    if "negative_prompt" in call:
        flags += ["--negative-prompt", call["negative_prompt"]]
    return flags


def ditserve_params(model: Path, call: dict[str, Any]) -> SamplingParams:
    """What `ditserve generate` with these flags runs."""
    args = build_parser().parse_args(_generate_flags(model, call))
    return generation_params(args, model_defaults(model))


def default_diffusers_call(model: Path, call: dict[str, Any]) -> torch.Tensor:
    import diffusers

    index = (model / "model_index.json").read_text()
    name = next(n for n in ("FluxPipeline", "QwenImagePipeline", "WanPipeline") if n in index)
    pipe = getattr(diffusers, name).from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(**call, generator=torch.Generator("cpu").manual_seed(SEED), output_type="pt")
    return (out.frames if name == "WanPipeline" else out.images).float()


@pytest.mark.parametrize("case", sorted(CASES))
def test_default_generate_equals_a_default_diffusers_call(  # type: ignore[no-untyped-def]
    family_dir, family_runner, case: str,
) -> None:
    variant, call = CASES[case]
    model = family_dir(variant)
    params = ditserve_params(model, call)
    ours, _ = drive(family_runner(variant), {0: [(case, params)]}, max_num_seqs=1)
    expected = default_diffusers_call(model, call)
    got = ours[case]
    assert got.shape == expected.shape
    diff = (got - expected).abs().max().item()
    assert diff <= TOLERANCE, f"max abs diff {diff} ({params})"
    assert got.std().item() > 1e-3  # not a constant image: the comparison means something


def test_an_empty_negative_prompt_runs_true_cfg(family_dir) -> None:  # type: ignore[no-untyped-def]
    # Qwen-Image's default true_cfg_scale (4.0) with negative_prompt "": CFG against "", as in
    # diffusers; without a negative prompt it is off, as there.
    model = family_dir("qwen-image")
    with_empty = ditserve_params(model, CASES["qwen-image-empty-negative"][1]).validate()
    without = ditserve_params(model, CASES["qwen-image"][1]).validate()
    assert with_empty.uses_true_cfg and with_empty.rows == 2
    assert not without.uses_true_cfg and without.rows == 1


@pytest.mark.parametrize("variant", ["flux", "wan"])
def test_max_sequence_length_is_an_option_as_in_diffusers(  # type: ignore[no-untyped-def]
    family_dir, family_runner, variant: str,
) -> None:
    model = family_dir(variant)
    call: dict[str, Any] = dict(prompt="a lighthouse", height=32, width=32,
                                num_inference_steps=2, max_sequence_length=24)
    if variant == "wan":
        call["num_frames"] = 5
    args = build_parser().parse_args(
        [*_generate_flags(model, call), "--max-sequence-length", "24"])
    params = generation_params(args, model_defaults(model))
    assert params.max_sequence_length == 24
    ours, _ = drive(family_runner(variant), {0: [("short", params)]}, max_num_seqs=1)
    expected = default_diffusers_call(model, call)
    assert (ours["short"] - expected).abs().max().item() <= TOLERANCE


def test_a_text_length_beyond_the_model_is_refused(family_runner) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.errors import InvalidRequestError

    limits = family_runner("flux").limits
    assert limits.max_text_tokens == 512  # FluxPipeline refuses more
    too_long = SamplingParams(prompt="x", max_sequence_length=limits.max_text_tokens + 1)
    with pytest.raises(InvalidRequestError, match="max_sequence_length"):
        too_long.validate_for(limits)
