"""The node cache inside an operator pod, from the engine's side: the model at its mount path,
the cache root mounted read-only (real read-only bind mounts in a private mount namespace).
The entry `cachectl build` made from the node path is a hit: the DiT load is skipped and its
tensors are the entry's shared mapping. After an ordinary load, an existing entry is joined
only if its content digest matches; otherwise the engine keeps its own tensors and says why."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from cachectl_support import in_mount_namespace, read_only_bind, require_mounts

from ditserve.cachectl.cli import engine_loader, main
from ditserve.cachectl.model_build import ModelRequest, plan_model
from ditserve.cachectl.store import CacheStore

CHILD = Path(__file__).parent / "engine_child.py"


def _build(root: Path, model: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["build", "--root", str(root), "--model", str(model), "--dtype", "float32",
                 "--json"]) == 0
    return str(json.loads(capsys.readouterr().out)["key"])


def _prepare(model: Path, root: Path) -> tuple[torch.nn.Module, object]:
    from ditserve.engine.config import OffloadConfig
    from ditserve.engine.weights.backing_choice import prepare_dit

    offload = OffloadConfig(enabled=True, runtime_cache=True, cache_root=str(root))
    return prepare_dit(model, dtype="float32", offload=offload)


def test_a_pod_maps_the_entry_built_from_the_node_path(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    require_mounts()
    root = tmp_path / "node-cache"
    key = _build(root, tiny_model, capsys)  # the daemon / init container, at the node path
    pod_model, pod_cache = tmp_path / "pod" / "models" / "flux", tmp_path / "pod" / "cache"
    out = in_mount_namespace(
        [*read_only_bind(tiny_model, pod_model), *read_only_bind(root, pod_cache)],
        [sys.executable, str(CHILD), str(pod_model), str(pod_cache)], timeout=300)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["kind"] == "runtime_cache", seen["reason"]
    assert seen["skipped_load"] is True and "DiT load skipped" in seen["reason"]
    assert key[:12] in seen["reason"]
    # Every DiT tensor lives in the entry's file mapping: one shared copy per node.
    assert seen["in_entry_mapping"] == seen["tensors"] > 0
    assert seen["mapped_files"] and all(f"/v1/entries/{key}/" in p for p in seen["mapped_files"])


def _identity(model: Path):  # type: ignore[no-untyped-def]
    plan = plan_model(ModelRequest(model, "float32"), engine_loader())
    return plan.recipe, plan.recipe.identity(plan.model_digest())


def test_a_content_mismatch_after_a_load_keeps_the_engines_tensors(
    tiny_model: Path, tmp_path: Path,
) -> None:
    from ditserve.engine.weights.loader import load_dit_state_dict

    store = CacheStore(tmp_path / "cache")
    recipe, identity = _identity(tiny_model)
    loaded = load_dit_state_dict(tiny_model, dtype="float32")
    name = sorted(loaded)[0]
    other = {**loaded, name: loaded[name] + 1}  # what a loader that changed would produce
    store.publish(identity, other).close()  # same identity, other bytes; no recipe record
    dit, plan = _prepare(tiny_model, store.root)
    assert str(plan.kind) == "ordinary"  # type: ignore[attr-defined]
    reason = plan.reason  # type: ignore[attr-defined]
    assert "not joined" in reason and "other tensor content" in reason and name in reason
    assert torch.equal(dit.state_dict()[name], loaded[name])  # its own tensors, not the entry's
    assert store.resolve_recipe(recipe) is None  # no later process maps it on trust


def test_an_entry_with_matching_content_is_joined_after_a_load(
    tiny_model: Path, tmp_path: Path,
) -> None:
    from ditserve.engine.weights.loader import load_dit_state_dict

    store = CacheStore(tmp_path / "cache")
    recipe, identity = _identity(tiny_model)
    store.publish(identity, load_dit_state_dict(tiny_model, dtype="float32")).close()
    _dit, plan = _prepare(tiny_model, store.root)
    assert str(plan.kind) == "runtime_cache"  # type: ignore[attr-defined]
    assert "joined (content digest matched)" in plan.reason  # type: ignore[attr-defined]
    assert store.resolve_recipe(recipe) == identity.key
    plan.close()  # type: ignore[attr-defined]


def _hub_snapshot(model: Path, hub: Path) -> Path:
    """A hub-cache-style copy: every file a relative symlink into blobs/."""
    snapshot, blobs = hub / "snapshots" / "0123abcd", hub / "blobs"
    blobs.mkdir(parents=True)
    for f in sorted(p for p in model.rglob("*") if p.is_file()):
        rel = f.relative_to(model)
        blob = blobs / f"{len(list(blobs.iterdir())):04d}"
        shutil.copyfile(f, blob)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


def test_a_hub_style_model_dir_builds_and_hits(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    snapshot = _hub_snapshot(tiny_model, tmp_path / "hub")
    root = tmp_path / "cache"
    key = _build(root, snapshot, capsys)
    _dit, plan = _prepare(snapshot, root)
    assert str(plan.kind) == "runtime_cache"  # type: ignore[attr-defined]
    assert plan.skipped_materialization and key[:12] in plan.reason  # type: ignore[attr-defined]
    plan.close()  # type: ignore[attr-defined]
