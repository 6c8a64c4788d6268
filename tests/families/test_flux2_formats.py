"""FLUX.2 [dev] and [klein] under the host weight formats, served end to end on the tiny
models in bfloat16: packed bf16 streaming (``compress="lossless"``) gives the plain DLO
images bit for bit, and FP8 (``--quantization fp8``) DLO gives resident FP8's; on CPU here,
on CUDA in the ``gpu`` tests at the bottom (resident == DLO == packed, bit-identical)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig
from ditserve.engine.request import ConditionImage, SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner


def _reference(width: int, height: int) -> ConditionImage:
    g = torch.Generator().manual_seed(width * height)
    rgb = (torch.rand(height, width, 3, generator=g) * 255).to(torch.uint8)
    return ConditionImage(width, height, rgb.numpy().tobytes())


REQUESTS = [
    ("text", SamplingParams(prompt="a red fox", height=32, width=32, num_inference_steps=3,
                            seed=1, guidance_scale=4.0)),
    ("edit", SamplingParams(prompt="make it red", height=32, width=48, num_inference_steps=2,
                            seed=2, guidance_scale=3.0, images=(_reference(64, 72),))),
]


def generate(model: Path, device: str, **config: Any) -> dict[str, torch.Tensor]:
    runner = ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device=device, dtype="bfloat16",
                                                      **config)), model_dir=model)
    try:
        out, sizes = drive(runner, {0: REQUESTS}, max_num_seqs=2)
    finally:
        runner.close()
    assert max(sizes) == 2  # the text-only request and the edit shared steps
    return out


def assert_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for rid in want:
        assert torch.equal(got[rid], want[rid]), rid


@pytest.mark.parametrize("variant", ["flux2", "flux2-klein"])
def test_packed_dlo_equals_plain_dlo(family_dir: Callable[[str], Path], variant: str) -> None:
    plain = generate(family_dir(variant), "cpu", offload=OffloadConfig(enabled=True))
    packed = generate(family_dir(variant), "cpu",
                      offload=OffloadConfig(enabled=True, compress="lossless"))
    assert_identical(packed, plain)


def test_fp8_dlo_equals_resident_fp8(family_dir: Callable[[str], Path]) -> None:
    resident = generate(family_dir("flux2"), "cpu", quantization="fp8")
    offloaded = generate(family_dir("flux2"), "cpu", quantization="fp8",
                         offload=OffloadConfig(enabled=True))
    assert_identical(offloaded, resident)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["flux2", "flux2-klein"])
def test_cuda_resident_dlo_and_packed_are_bit_identical(family_dir: Callable[[str], Path],
                                                         variant: str) -> None:
    model = family_dir(variant)
    resident = generate(model, "cuda")
    dlo = generate(model, "cuda", offload=OffloadConfig(enabled=True, checkpoint_mmap="off"))
    packed = generate(model, "cuda", offload=OffloadConfig(enabled=True, compress="lossless"))
    assert_identical(dlo, resident)
    assert_identical(packed, resident)


@pytest.mark.gpu
def test_cuda_fp8_dlo_equals_resident_fp8(family_dir: Callable[[str], Path]) -> None:
    resident = generate(family_dir("flux2"), "cuda", quantization="fp8")
    offloaded = generate(family_dir("flux2"), "cuda", quantization="fp8",
                         offload=OffloadConfig(enabled=True))
    assert_identical(offloaded, resident)
