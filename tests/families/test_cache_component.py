"""`cachectl build --component`: Wan 2.2's second expert gets its own node-cache entry, the
one the engine's runtime cache then hits for ``transformer_2``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from ditserve.cachectl.cli import main as cachectl
from ditserve.cachectl.model_build import ModelRequest, describe_loader, plan_model
from ditserve.engine.weights import loader


def test_each_expert_is_its_own_entry(family_dir: Callable[[str], Path], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    model = family_dir("wan2.2")
    root = tmp_path / "cache"
    root.mkdir()
    keys = {}
    for component in ("transformer", "transformer_2"):
        rc = cachectl(["--root", str(root), "build", "--model", str(model), "--dtype",
                       "float32", "--component", component, "--json"])
        assert rc == 0
        keys[component] = json.loads(capsys.readouterr().out)["key"]
    assert keys["transformer"] != keys["transformer_2"]
    # The engine's recipe for the second expert resolves to the entry built for it.
    described = describe_loader(loader)
    for component, key in keys.items():
        recipe = plan_model(ModelRequest(model, "float32", component=component), described).recipe
        manifest = json.loads((root / "v1" / "entries" / key / "manifest.json").read_text())
        assert manifest["identity"]["components"] == [component]
        assert recipe.components == (component,)
