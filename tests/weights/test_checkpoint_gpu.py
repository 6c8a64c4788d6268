"""Checkpoint files on a CUDA device: a GGUF file (Q8_0, Q4_K) and an FP8 file served through
the model runner with DLO equal the same file resident, bit for bit (the quantized blocks stream
as stored and dequantize, or run FP8 GEMMs, on the device). bf16 256-wide tiny Flux."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]
from weights.support import wide_flux  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig
from ditserve.engine.request import SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner
from ditserve.engine.weights.convert import convert

pytestmark = pytest.mark.gpu
ARRIVALS = {0: [("a", SamplingParams(prompt="a red fox", num_inference_steps=3, seed=11)),
                ("b", SamplingParams(prompt="a cat", num_inference_steps=2, seed=5))]}


@pytest.fixture(scope="module")
def wide_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return wide_flux(tiny_model_dir, tmp_path_factory.mktemp("wide") / "flux")


def generate(model_dir: Path, checkpoint: Path, **changes: object) -> dict[str, torch.Tensor]:
    config = EngineConfig(model=str(model_dir), checkpoint=str(checkpoint), device="cuda",
                          dtype="bfloat16").replace(**changes)
    runner = ModelRunner(RunnerConfig.of(config), model_dir=model_dir)
    try:
        return drive(runner, ARRIVALS, max_num_seqs=2)[0]
    finally:
        runner.close()


@pytest.mark.parametrize("to", ["gguf:Q8_0", "gguf:Q4_K", "fp8"])
def test_dlo_equals_resident_on_cuda(wide_dir: Path, tmp_path: Path, to: str) -> None:
    if to == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need sm89+")
    path = tmp_path / ("f.gguf" if to.startswith("gguf") else "f.safetensors")
    convert(wide_dir, path, to=to)
    resident = generate(wide_dir, path)
    offloaded = generate(wide_dir, path, offload=OffloadConfig(enabled=True))
    assert resident.keys() == offloaded.keys()
    assert all(torch.equal(resident[k], offloaded[k]) for k in resident)


@pytest.mark.parametrize("to", ["gguf:Q8_0", "fp8"])
def test_node_cache_entry_streams_equal_to_private_memory_on_cuda(
        wide_dir: Path, tmp_path: Path, to: str) -> None:
    """The checkpoint's node cache entry (tests/weights/test_checkpoint_cache.py on CPU): built
    by the first engine, mapped without reading the file by the second, registered with a pin
    limit; both stream the stored bytes and equal the file in private pinned memory."""
    if to == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need sm89+")
    path = tmp_path / ("f.gguf" if to.startswith("gguf") else "f.safetensors")
    convert(wide_dir, path, to=to)
    private = generate(wide_dir, path, offload=OffloadConfig(enabled=True))
    cache = OffloadConfig(enabled=True, runtime_cache=True, cache_root=str(tmp_path / "cache"),
                          pin_limit_gib=4.0)
    built = generate(wide_dir, path, offload=cache)
    mapped = generate(wide_dir, path, offload=cache)
    for got in (built, mapped):
        assert got.keys() == private.keys()
        assert all(torch.equal(private[k], got[k]) for k in private)
