"""Wan checkpoint files in the node cache (issue 49): ``cachectl build|ensure --model FILE
--base-model WAN_DIR`` stores a Wan single file, GGUF Q8_0 or GGUF Q4_K file as the engine runs
it (GGUF blocks as stored), the entry verifies, and an engine under ``--dlo-runtime-cache`` that
maps it - without reading the file - makes the same videos as the file served directly (tiny
Wan 64 wide for Q8_0 and the single file, 256 wide for Q4_K; CPU)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]
from weights.support import K_QUANT_WAN, wide_wan  # type: ignore[import-not-found]

from ditserve.cachectl.cli import main
from ditserve.cachectl.store import CacheStore
from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig
from ditserve.engine.request import SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner
from ditserve.engine.weights.checkpoint_cache import FORMS_KEY, load_checkpoint_state_dict
from ditserve.engine.weights.convert import convert

ARRIVALS = {0: [("waves", SamplingParams(prompt="waves", negative_prompt="fog", seed=3,
                                         num_inference_steps=2, guidance_scale=4.0,
                                         height=32, width=32, num_frames=5))]}
# form -> (the base folder's widths, the command that builds the entry)
FORMS = {"single-file": ("64", "build"), "gguf:Q8_0": ("64", "build"),
         "gguf:Q4_K": ("256", "ensure")}


@pytest.fixture(scope="module")
def bases(tiny_variant_dir: Callable[[str], Path],
          tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wan-bases")
    wan = tiny_variant_dir("wan")
    return {"64": wide_wan(wan, root / "wan64"), "256": wide_wan(wan, root / "wan256", K_QUANT_WAN)}


@pytest.fixture(scope="module")
def files(bases: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wan-checkpoints")
    out = {}
    for form, (width, _) in FORMS.items():
        suffix = ".gguf" if form.startswith("gguf:") else ".safetensors"
        out[form] = root / f"wan{width}-{form.replace(':', '-')}{suffix}"
        convert(bases[width], out[form], to=form)
    return out


def cachectl(command: str, root: Path, checkpoint: Path, base: Path,
             capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    extra = ["--no-daemon"] if command == "ensure" else []
    assert main([command, "--root", str(root), "--model", str(checkpoint), "--base-model",
                 str(base), "--dtype", "float32", "--json", *extra]) == 0
    result: dict[str, object] = json.loads(capsys.readouterr().out)
    return result


def generate(model_dir: Path, checkpoint: Path, **offload: object
             ) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    config = EngineConfig(model=str(model_dir), checkpoint=str(checkpoint), device="cpu",
                          offload=OffloadConfig(enabled=True, **offload))  # type: ignore[arg-type]
    runner = ModelRunner(RunnerConfig.of(config), model_dir=model_dir)
    try:
        report = runner.offload_report()
        return drive(runner, ARRIVALS, max_num_seqs=1)[0], report
    finally:
        runner.close()


@pytest.mark.parametrize("form", list(FORMS))
def test_a_wan_file_entry_builds_verifies_and_serves_the_files_videos(
        form: str, bases: dict[str, Path], files: dict[str, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    width, command = FORMS[form]
    base, path = bases[width], files[form]
    root = tmp_path / "cache"
    built = cachectl(command, root, path, base, capsys)
    assert built["built"] and built["status"] == "ready", built

    # The entry holds the DiT as the engine runs it: GGUF blocks as their uint8 bytes.
    want, metadata = load_checkpoint_state_dict(path, base, dtype="float32")
    with CacheStore(root).join(str(built["key"])) as entry:
        got = entry.tensors()
        assert got.keys() == want.keys()
        assert all(got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8),
                                                           v.view(torch.uint8))
                   for k, v in want.items())
        forms = json.loads(entry.manifest.metadata[FORMS_KEY])
    assert forms == json.loads(metadata[FORMS_KEY])
    if form.startswith("gguf:"):  # every block linear of both blocks, as stored
        assert len([n for n in forms if n.startswith("blocks.")]) == 2 * 10
        assert set(forms.values()) == {form}
        assert got["blocks.0.attn1.to_q.weight_q"].dtype == torch.uint8
    else:
        assert forms == {} and {v.dtype for v in got.values()} == {torch.float32}

    assert main(["verify", "--root", str(root), str(built["key"])]) == 0
    capsys.readouterr()
    again = cachectl(command, root, path, base, capsys)  # recipe hit: nothing loaded
    assert again["key"] == built["key"] and again["via_recipe"] and not again["built"]

    direct, direct_report = generate(base, path)
    assert direct_report["backing_kind"] == "ordinary"
    mapped, report = generate(base, path, runtime_cache=True, cache_root=str(root))
    assert report["backing_kind"] == "runtime_cache", report["backing_reason"]
    assert "file load skipped" in str(report["backing_reason"])
    assert report["bound_tensors"] == report["expected_tensors"] > 0  # type: ignore[operator]
    assert direct.keys() == mapped.keys()
    for name in direct:
        assert direct[name].shape == (1, 5, 3, 32, 32)  # (n, frames, 3, H, W)
        assert torch.equal(direct[name], mapped[name]), name


def test_an_engine_builds_a_wan_gguf_entry_and_the_next_engine_maps_it(
        bases: dict[str, Path], files: dict[str, Path], tmp_path: Path) -> None:
    base, path = bases["256"], files["gguf:Q4_K"]
    direct, _ = generate(base, path)
    root = tmp_path / "cache"
    first, report = generate(base, path, runtime_cache=True, cache_root=str(root))
    assert "built after an ordinary load" in str(report["backing_reason"]), report
    second, report = generate(base, path, runtime_cache=True, cache_root=str(root))
    assert "file load skipped" in str(report["backing_reason"]), report
    assert all(torch.equal(direct[k], first[k]) and torch.equal(direct[k], second[k])
               for k in direct)
    assert main(["verify", "--root", str(root)]) == 0


def test_a_flipped_byte_in_a_wan_gguf_entry_is_caught(
        bases: dict[str, Path], files: dict[str, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "cache"
    built = cachectl("build", root, files["gguf:Q4_K"], bases["256"], capsys)
    shard = next(Path(str(built["path"])).glob("*.safetensors"))
    shard.chmod(0o644)
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["verify", "--root", str(root), str(built["key"])]) == 1
