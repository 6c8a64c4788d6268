"""FLUX.2 and Z-Image GGUF files in the node cache: ``cachectl build --model FILE --base-model
DIR`` stores the file's DiT as the engine runs it (block linears as their GGUF bytes), the
entry verifies, and an engine under ``--dlo-runtime-cache`` maps it without reading the file
and makes the file's own images bit for bit (tiny models, Q8_0, CPU)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.cachectl.cli import main
from ditserve.cachectl.store import CacheStore
from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig
from ditserve.engine.request import SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner
from ditserve.engine.weights.checkpoint_cache import FORMS_KEY
from ditserve.engine.weights.convert import convert

PARAMS = SamplingParams(prompt="a red cat", num_inference_steps=2, seed=7, guidance_scale=0.0,
                        height=32, width=32)


def generate(model_dir: Path, checkpoint: Path, **offload: object
             ) -> tuple[torch.Tensor, dict[str, object]]:
    config = EngineConfig(model=str(model_dir), checkpoint=str(checkpoint), device="cpu",
                          offload=OffloadConfig(enabled=True, **offload))  # type: ignore[arg-type]
    runner = ModelRunner(RunnerConfig.of(config), model_dir=model_dir)
    try:
        report = runner.offload_report()
        return drive(runner, {0: [("x", PARAMS)]}, max_num_seqs=1)[0]["x"], report
    finally:
        runner.close()


@pytest.mark.parametrize("family", ["flux2", "z-image"])
def test_a_gguf_entry_builds_verifies_and_serves_the_files_images(
        family: str, tiny_variant_dir: Callable[[str], Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    base = tiny_variant_dir(family)
    path = tmp_path / f"{family}-Q8_0.gguf"
    convert(base, path, to="gguf:Q8_0")
    root = tmp_path / "cache"
    assert main(["build", "--root", str(root), "--model", str(path), "--base-model", str(base),
                 "--dtype", "float32", "--json"]) == 0
    built = json.loads(capsys.readouterr().out)
    assert built["built"] and built["status"] == "ready", built
    with CacheStore(root).join(str(built["key"])) as entry:
        forms = json.loads(entry.manifest.metadata[FORMS_KEY])
        tensors = entry.tensors()
    assert forms and set(forms.values()) == {"gguf:Q8_0"}
    assert all(tensors[f"{layer}.weight_q"].dtype == torch.uint8 for layer in forms)
    assert main(["verify", "--root", str(root), str(built["key"])]) == 0
    capsys.readouterr()

    direct, _ = generate(base, path)
    mapped, report = generate(base, path, runtime_cache=True, cache_root=str(root))
    assert report["backing_kind"] == "runtime_cache", report["backing_reason"]
    assert "file load skipped" in str(report["backing_reason"])
    assert torch.equal(direct, mapped)
