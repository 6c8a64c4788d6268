"""DiT checkpoint files in the node cache (issue 49): ``cachectl build --model FILE --base-model
DIR`` stores the DiT as the engine runs it (GGUF blocks and FP8 bytes as stored), content-checked
like any entry, and an engine under ``--dlo-runtime-cache`` maps it - on a recipe hit without
reading the file - with generations equal to the same file served from private memory (tiny
Flux, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.cachectl.cli import main
from ditserve.cachectl.store import CacheStore
from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig
from ditserve.engine.config.rules import checkpoint_problems
from ditserve.engine.request import SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner
from ditserve.engine.weights.checkpoint_cache import FORMS_KEY, load_checkpoint_state_dict
from ditserve.engine.weights.convert import convert

ARRIVALS = {0: [("fox", SamplingParams(prompt="a red fox", num_inference_steps=2, seed=11))]}


@pytest.fixture(scope="module")
def files(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for to, name in (("gguf:Q8_0", "flux-Q8_0.gguf"), ("fp8", "flux-fp8.safetensors"),
                     ("single-file", "flux.safetensors")):
        out[to] = root / name
        convert(tiny_model_dir, out[to], to=to)
    return out


def build(root: Path, checkpoint: Path, base: Path, capsys: pytest.CaptureFixture[str],
          *extra: str) -> dict[str, object]:
    assert main(["build", "--root", str(root), "--model", str(checkpoint), "--base-model",
                 str(base), "--dtype", "float32", "--json", *extra]) == 0
    result: dict[str, object] = json.loads(capsys.readouterr().out)
    return result


def generate(model_dir: Path, checkpoint: Path, **offload: object) -> dict[str, torch.Tensor]:
    config = EngineConfig(model=str(model_dir), checkpoint=str(checkpoint), device="cpu",
                          offload=OffloadConfig(enabled=True, **offload))  # type: ignore[arg-type]
    runner = ModelRunner(RunnerConfig.of(config), model_dir=model_dir)
    try:
        generate.report = runner.offload_report()  # type: ignore[attr-defined]
        return drive(runner, ARRIVALS, max_num_seqs=1)[0]
    finally:
        runner.close()


@pytest.mark.parametrize("form", ["gguf:Q8_0", "fp8", "single-file"])
def test_build_stores_the_dit_as_the_engine_runs_it(
        form: str, files: dict[str, Path], tiny_model_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "cache"
    built = build(root, files[form], tiny_model_dir, capsys)
    assert built["built"] and built["status"] == "ready"
    want, metadata = load_checkpoint_state_dict(files[form], tiny_model_dir, dtype="float32")
    with CacheStore(root).join(str(built["key"])) as entry:
        got = entry.tensors()
        assert got.keys() == want.keys()
        assert all(got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8),
                                                           v.view(torch.uint8))
                   for k, v in want.items())
        forms = json.loads(entry.manifest.metadata[FORMS_KEY])
        assert forms == json.loads(metadata[FORMS_KEY])
    stored = {v.dtype for v in want.values()}
    if form == "gguf:Q8_0":  # the blocks as stored: uint8 bytes, not dequantized floats
        assert torch.uint8 in stored and set(forms.values()) == {"gguf:Q8_0"}
    elif form == "fp8":
        assert torch.float8_e4m3fn in stored and set(forms.values()) == {"fp8"}
    else:
        assert stored == {torch.float32} and forms == {}

    # The entry is checked like any other: clean, then a flipped byte is found.
    assert main(["verify", "--root", str(root), str(built["key"])]) == 0
    capsys.readouterr()
    again = build(root, files[form], tiny_model_dir, capsys)  # recipe hit: nothing loaded
    assert again["key"] == built["key"] and again["via_recipe"] and not again["built"]


def test_a_flipped_byte_in_a_checkpoint_entry_is_caught(
        files: dict[str, Path], tiny_model_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "cache"
    built = build(root, files["gguf:Q8_0"], tiny_model_dir, capsys)
    shard = next(Path(str(built["path"])).glob("*.safetensors"))
    shard.chmod(0o644)
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["verify", "--root", str(root), str(built["key"])]) == 1


def test_another_file_or_dtype_is_another_entry(
        files: dict[str, Path], tiny_model_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "cache"
    q8 = build(root, files["gguf:Q8_0"], tiny_model_dir, capsys)
    fp8 = build(root, files["fp8"], tiny_model_dir, capsys)
    assert main(["build", "--root", str(root), "--model", str(tiny_model_dir), "--dtype",
                 "float32", "--json"]) == 0
    folder = json.loads(capsys.readouterr().out)
    assert len({q8["key"], fp8["key"], folder["key"]}) == 3


def test_checkpoint_flags_are_checked(files: dict[str, Path], tiny_model_dir: Path,
                                      tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = str(tmp_path / "cache")
    # a file without its base model: a usage error that says how to pass it, with or without
    # --dtype (not a guess at its dtype first)
    for dtype in (["--dtype", "float32"], []):
        assert main(["build", "--root", root, "--model", str(files["fp8"]), *dtype]) == 2
        err = capsys.readouterr().err
        assert "is a checkpoint file: pass it with --base-model DIR" in err and "dtype" not in err
    # --base-model with a directory as --model: a usage error
    assert main(["build", "--root", root, "--model", str(tiny_model_dir), "--base-model",
                 str(tiny_model_dir), "--dtype", "float32"]) == 2
    assert "goes with --model FILE" in capsys.readouterr().err


def test_the_runtime_cache_takes_a_checkpoint_file() -> None:
    config = EngineConfig(model="/m", checkpoint="/m/f.gguf",
                          offload=OffloadConfig(enabled=True, runtime_cache=True))
    assert checkpoint_problems(config) == []


@pytest.mark.parametrize("form", ["gguf:Q8_0", "fp8"])
def test_engine_maps_the_entry_cachectl_built_without_reading_the_file(
        form: str, files: dict[str, Path], tiny_model_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    private = generate(tiny_model_dir, files[form])
    assert generate.report["backing_kind"] == "ordinary"  # type: ignore[attr-defined]
    root = tmp_path / "cache"
    build(root, files[form], tiny_model_dir, capsys)
    mapped = generate(tiny_model_dir, files[form], runtime_cache=True, cache_root=str(root))
    report = generate.report  # type: ignore[attr-defined]
    assert report["backing_kind"] == "runtime_cache", report["backing_reason"]
    assert "file load skipped" in report["backing_reason"]
    assert report["skipped_materialization"] is True
    assert report["bound_tensors"] == report["expected_tensors"] > 0
    assert private.keys() == mapped.keys()
    assert all(torch.equal(private[k], mapped[k]) for k in private)


def test_engine_builds_the_entry_then_the_next_engine_hits(
        files: dict[str, Path], tiny_model_dir: Path, tmp_path: Path) -> None:
    form = "gguf:Q8_0"
    private = generate(tiny_model_dir, files[form])
    root = tmp_path / "cache"
    first = generate(tiny_model_dir, files[form], runtime_cache=True, cache_root=str(root))
    report = generate.report  # type: ignore[attr-defined]
    assert report["backing_kind"] == "runtime_cache", report["backing_reason"]
    assert "built after an ordinary load" in report["backing_reason"]
    second = generate(tiny_model_dir, files[form], runtime_cache=True, cache_root=str(root))
    assert "file load skipped" in generate.report["backing_reason"]  # type: ignore[attr-defined]
    assert all(torch.equal(private[k], first[k]) and torch.equal(private[k], second[k])
               for k in private)


def test_the_daemon_builds_the_entry_cachectl_and_engines_then_find(
        files: dict[str, Path], tiny_model_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    import logging

    from fastapi.testclient import TestClient

    from ditserve.cachectl.cli import engine_loader
    from ditserve.cachectl.daemon import Daemon, DaemonConfig, create_app

    root = tmp_path / "cache"
    daemon = Daemon(DaemonConfig(root=root, socket_path=tmp_path / "s.sock", scrub_interval_s=0,
                                 grace_s=30), logging.getLogger("test.cachectl"), engine_loader())
    try:
        with TestClient(create_app(daemon)) as client:
            answer = client.post("/v1/ensure", json={
                "model": str(tiny_model_dir), "checkpoint": str(files["fp8"]),
                "dtype": "float32", "wait_s": 120})
    finally:
        daemon.stop()
    assert answer.status_code == 200 and answer.json()["built"], answer.json()
    again = build(root, files["fp8"], tiny_model_dir, capsys)
    assert again["key"] == answer.json()["key"] and again["via_recipe"]
