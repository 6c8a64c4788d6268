"""A read-only cache root, as engine pods mount it: a real read-only bind mount in a private
mount namespace, which refuses writes even to root. Every reading command works, every
writing one says it cannot write here, and nothing under the root changes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from cachectl_support import (
    cachectl_argv,
    in_mount_namespace,
    light_env,
    make_identity,
    make_light_model,
    read_only_bind,
    require_mounts,
    synthetic_tensors,
)

from ditserve.cachectl.cli import main
from ditserve.cachectl.store import CacheStore


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if not p.is_symlink()}


@pytest.fixture
def published(tmp_path: Path, capsys: pytest.CaptureFixture[str],
              monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, str]:
    """A cache with one entry built by `cachectl build` from a light model, and the model."""
    require_mounts()
    root = tmp_path / "cache"
    model = make_light_model(tmp_path / "node" / "model")
    monkeypatch.setenv("DITSERVE_CACHECTL_LOADER", "cachectl_support:LIGHT_LOADER")
    assert main(["build", "--root", str(root), "--model", str(model), "--json"]) == 0
    monkeypatch.delenv("DITSERVE_CACHECTL_LOADER")
    key = json.loads(capsys.readouterr().out)["key"]
    CacheStore(root).publish(make_identity(seed=3), synthetic_tensors(seed=3)).close()
    return root, model, key


def _ro(tmp_path: Path, root: Path, *cli: str) -> tuple[int, str, str]:
    view = tmp_path / "ro-view"
    out = in_mount_namespace(read_only_bind(root, view),
                             cachectl_argv("--root", str(view), *cli), env=light_env())
    return out.returncode, out.stdout, out.stderr


def test_reading_commands_work_on_a_read_only_root(
    tmp_path: Path, published: tuple[Path, Path, str],
) -> None:
    root, _model, key = published
    before = _tree(root)
    rc, out, _ = _ro(tmp_path, root, "list", "--json")
    assert rc == 0 and key in {e["key"] for e in json.loads(out)}
    rc, out, _ = _ro(tmp_path, root, "verify", "--json")
    assert rc == 0 and all(r["ok"] for r in json.loads(out))
    rc, out, _ = _ro(tmp_path, root, "gc", "--max-bytes", "0", "--dry-run", "--json")
    assert rc == 0 and len(json.loads(out)["removed"]) == 2
    assert _tree(root) == before


@pytest.mark.parametrize("command", [["gc", "--max-bytes", "0"], ["rm", "KEY"]])
def test_writing_commands_say_they_cannot_write_here(
    tmp_path: Path, published: tuple[Path, Path, str], command: list[str],
) -> None:
    root, _model, key = published
    before = _tree(root)
    rc, _, err = _ro(tmp_path, root, *[key if c == "KEY" else c for c in command])
    assert rc == 3 and "is read-only here" in err and "Traceback" not in err
    assert _tree(root) == before


def test_a_build_that_misses_says_it_cannot_write_and_a_hit_joins(
    tmp_path: Path, published: tuple[Path, Path, str],
) -> None:
    root, model, key = published
    before = _tree(root)
    other = make_light_model(tmp_path / "other", seed=7)
    rc, _, err = _ro(tmp_path, root, "build", "--model", str(other))
    assert rc == 3 and "cannot build entry" in err and "read-only here" in err
    # The model the entry was built from, seen at another path (a pod's mount): a recipe hit.
    pod_view = tmp_path / "pod" / "models" / "m"
    view = tmp_path / "ro-view"
    out = in_mount_namespace(
        [*read_only_bind(root, view), *read_only_bind(model, pod_view)],
        cachectl_argv("--root", str(view), "build", "--model", str(pod_view), "--json"),
        env=light_env())
    assert out.returncode == 0, out.stderr
    joined = json.loads(out.stdout)
    assert joined["key"] == key and joined["via_recipe"] and not joined["built"]
    assert joined["validated_by"] == "stamp"  # the builder stamped it: no re-hash here
    assert _tree(root) == before


def test_after_a_recipe_miss_a_read_only_join_keeps_the_valid_entry(
    tmp_path: Path, published: tuple[Path, Path, str],
) -> None:
    # No recipe record (another loader path built it, or GC dropped it): the process hashes
    # the model, finds the entry by its key, joins it, and only fails to record the recipe.
    root, model, key = published
    for record in (root / "v1" / "recipes").iterdir():
        record.unlink()
    before = _tree(root)
    code = ("import json, sys; from pathlib import Path;"
            "from cachectl_support import LIGHT_LOADER;"
            "from ditserve.cachectl.store import CacheStore;"
            "from ditserve.cachectl.model_build import ModelRequest, ensure_model;"
            "e = ensure_model(CacheStore(sys.argv[1]), ModelRequest(Path(sys.argv[2]), 'bfloat16'),"
            " LIGHT_LOADER);"
            "print(json.dumps({'key': e.key, 'built': e.built, 'recorded': e.recipe_recorded}))")
    view = tmp_path / "ro-view"
    out = in_mount_namespace(read_only_bind(root, view),
                             [sys.executable, "-c", code, str(view), str(model)],
                             env=light_env())
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"key": key, "built": False, "recorded": False}
    assert _tree(root) == before  # no temp file left behind either
