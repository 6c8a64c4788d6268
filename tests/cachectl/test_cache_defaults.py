"""The README's cache flow with its own defaults: `cachectl build --model ./m` (no --dtype,
a relative path) builds the entry that `ditserve serve --model ./m --dlo-runtime-cache` (no
--dtype) maps. Both default to the dtype the checkpoint is stored in, and a relative model
path names the same files on both sides."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ditserve.cachectl.cli import main as cachectl
from ditserve.engine.cli.main import build_parser
from ditserve.engine.config.flags import engine_config_from_args


def _bf16_copy(model: Path, target: Path) -> Path:
    """The tiny model as a bf16 release ships: the DiT's safetensors in bfloat16."""
    shutil.copytree(model, target)
    for path in (target / "transformer").glob("*.safetensors"):
        tensors = load_file(path)
        save_file({n: t.to(torch.bfloat16) for n, t in tensors.items()}, path)
    return target


def _engine_config(*flags: str):  # type: ignore[no-untyped-def]
    return engine_config_from_args(build_parser().parse_args(["serve", *flags]))


def _build(*flags: str, capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    assert cachectl(["build", *flags, "--json"]) == 0
    return dict(json.loads(capsys.readouterr().out))


def test_both_default_to_the_checkpoints_dtype(tiny_model: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    bf16 = _bf16_copy(tiny_model, tmp_path / "bf16")
    root = str(tmp_path / "cache")
    assert _engine_config("--model", str(bf16)).dtype == "bfloat16"
    assert _engine_config("--model", str(tiny_model)).dtype == "float32"
    assert _engine_config().dtype == "float32"  # the embedded tiny model is float32
    assert _engine_config("--model", str(bf16), "--dtype", "float32").dtype == "float32"
    built = _build("--root", root, "--model", str(bf16), capsys=capsys)
    assert cachectl(["list", "--root", root, "--json"]) == 0
    (entry,) = [e for e in json.loads(capsys.readouterr().out) if e["key"] == built["key"]]
    assert entry["identity"]["dtype"] == "bfloat16"


def test_a_relative_model_path_hits_the_entry_built_from_it(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from ditserve.engine.weights.backing_choice import prepare_dit

    work = tmp_path / "work"
    _bf16_copy(tiny_model, work / "models" / "tiny")
    monkeypatch.chdir(work)
    # The dtype named on both sides: this is about the path alone.
    built = _build("--root", "cache", "--model", "./models/tiny", "--dtype", "bfloat16",
                   capsys=capsys)
    config = _engine_config("--model", "./models/tiny", "--dtype", "bfloat16", "--offload",
                            "dlo", "--dlo-runtime-cache", "--cache-root", "cache")
    _, plan = prepare_dit(config.model, dtype=config.dtype, offload=config.offload)
    assert str(plan.kind) == "runtime_cache", plan.reason
    assert plan.skipped_materialization, plan.reason
    assert str(built["key"])[:12] in plan.reason
