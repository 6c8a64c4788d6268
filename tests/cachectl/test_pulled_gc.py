"""Pulled models in the cache's housekeeping: ``list`` shows them, ``rm`` and ``gc`` remove them
in one LRU order with runtime entries, never one a process leases (an engine serving from it)
or a pull holds, and gc sweeps partial pulls that are over and old. Models come from the local
hub (127.0.0.1 only)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from cachectl_support import (
    cachectl_argv,
    in_mount_namespace,
    light_env,
    make_identity,
    read_only_bind,
    require_mounts,
    synthetic_tensors,
)
from model_sources import FILES, LocalHub, Repo, weights

from ditserve.cachectl import locks, pulled_gc
from ditserve.cachectl.cli import main
from ditserve.cachectl.layout import Layout
from ditserve.cachectl.model_lease import lease_pulled_model, pulled_entry_of
from ditserve.cachectl.node_status import model_rows
from ditserve.cachectl.pulled import PulledModel
from ditserve.cachectl.pulls import PullRequest, pull
from ditserve.cachectl.store import CacheStore

T0 = 1_700_000_000.0
DAY = 24 * 3600.0


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalHub]:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # tests/conftest.py sets it
    other = {"model_index.json": b'{"_class_name": "FluxPipeline"}',
             "transformer/diffusion_pytorch_model.safetensors": weights(120_000, 5)}
    fixture = LocalHub(repos={"org/tiny": Repo(dict(FILES)), "org/other": Repo(other)})
    with fixture.running() as running:
        monkeypatch.setenv("HF_ENDPOINT", running.url)
        yield running


def _pulled(root: Path, repo: str = "org/tiny") -> PulledModel:
    return pull(root, PullRequest(f"hf://{repo}"))


def _runtime(store: CacheStore, seed: int) -> str:
    with store.publish(make_identity(seed), synthetic_tensors(seed)) as entry:
        return entry.key


def _last_used(path: Path, when: float) -> None:
    os.utime(path, (when, when))


def _listing(root: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, dict]:
    capsys.readouterr()
    assert main(["list", "--root", str(root), "--json"]) == 0
    return {e["key"]: e for e in json.loads(capsys.readouterr().out)}


def test_list_shows_pulled_models_beside_runtime_entries(
    hub: LocalHub, store: CacheStore, capsys: pytest.CaptureFixture[str],
) -> None:
    runtime = _runtime(store, 0)
    model = _pulled(store.root)
    listing = _listing(store.root, capsys)
    assert listing[runtime]["kind"] == "runtime" and listing[runtime]["uri"] is None
    row = listing[model.key]
    assert row["kind"] == "pulled" and row["uri"] == "hf://org/tiny"
    assert row["bytes"] == sum(len(b) for b in FILES.values())
    assert row["in_use"] is False and row["problem"] is None
    assert row["identity"]["revision"] == hub.repos["org/tiny"].commit

    with lease_pulled_model(model.model_dir):
        assert _listing(store.root, capsys)[model.key]["in_use"] is True
        assert main(["list", "--root", str(store.root)]) == 0
        line = next(ln for ln in capsys.readouterr().out.splitlines()
                    if ln.startswith(model.key[:16]))
        assert " pulled " in line and " yes " in line and line.endswith("hf://org/tiny")
        # The daemon's NodeCache: runtime entries as `entries`, pulled ones as `models`.
        rows = model_rows(pulled_gc.list_models(store.layout), [], previous=None, now="now")
        assert [(r["key"], r["state"], r["uri"], r["inUse"]) for r in rows] == [
            (model.key, "Ready", "hf://org/tiny", True)]
    assert [i.key for i in store.list()] == [runtime]
    assert not model_rows(pulled_gc.list_models(store.layout), [], previous=None,
                          now="now")[0]["inUse"]


def test_rm_removes_a_pulled_model_unless_leased_or_being_pulled(
    hub: LocalHub, store: CacheStore, capsys: pytest.CaptureFixture[str],
) -> None:
    model = _pulled(store.root)
    layout, rm = store.layout, ["rm", "--root", str(store.root), model.key]

    lease = lease_pulled_model(model.model_dir / "transformer")  # any path inside counts
    assert lease is not None
    assert main(rm) == 3  # in use: exit 3, as for a runtime entry
    assert "in use" in capsys.readouterr().err and model.path.is_dir()
    lease.release()

    pulling = locks.try_exclusive(layout.build_lock(model.key))  # a pull of this key runs
    assert pulling is not None
    assert main(rm) == 3 and model.path.is_dir()
    pulling.release()

    assert main(rm) == 0
    assert not os.path.lexists(model.path)
    assert not [p for p in layout.tmp.iterdir() if p.name.startswith(model.key)]
    assert main(rm) == 3 and "no entry" in capsys.readouterr().err
    assert _pulled(store.root).downloaded  # a new pull fetches it again


def test_gc_evicts_both_kinds_in_one_lru_order_and_keeps_a_leased_pulled_model(
    hub: LocalHub, store: CacheStore,
) -> None:
    old_runtime, new_runtime = _runtime(store, 0), _runtime(store, 1)
    model, other = _pulled(store.root), _pulled(store.root, "org/other")
    layout = store.layout
    # Last use: old runtime < pulled model < other pulled model < new runtime.
    _last_used(layout.entry(old_runtime), T0)
    _last_used(model.path, T0 + 10)
    _last_used(other.path, T0 + 20)
    _last_used(layout.entry(new_runtime), T0 + 30)
    sizes = {i.key: i.bytes for i in store.list_all()}
    budget = sizes[new_runtime] + sizes[model.key]

    dry = store.gc(budget, dry_run=True)
    assert dry.removed == [old_runtime, model.key] and dry.bytes_before == sum(sizes.values())
    assert {i.key for i in store.list_all()} == set(sizes)  # dry run removed nothing

    with lease_pulled_model(model.model_dir):  # an engine serves from the older pulled model
        assert os.stat(model.path).st_mtime > T0 + DAY  # the lease marked it used ...
        _last_used(model.path, T0 + 10)  # ... which a read-only mount cannot: gc keeps it anyway
        report = store.gc(budget)
    assert report.removed == [old_runtime, other.key]
    assert report.kept_in_use == [model.key]
    assert {i.key for i in store.list_all()} == {model.key, new_runtime}
    assert report.bytes_after == sizes[model.key] + sizes[new_runtime]

    report = store.gc(0)  # the lease is gone: now it can go too
    assert sorted(report.removed) == sorted([model.key, new_runtime])
    assert store.list_all() == [] and list(layout.tmp.iterdir()) == []


def test_a_pull_that_joins_refreshes_last_use(hub: LocalHub, store: CacheStore) -> None:
    model = _pulled(store.root)
    _last_used(model.path, T0)
    again = _pulled(store.root)
    assert not again.downloaded
    assert os.stat(model.path).st_mtime > T0 + DAY


def test_gc_sweeps_partials_of_pulls_that_are_over_and_old(tmp_path: Path) -> None:
    store = CacheStore(tmp_path / "cache", clock=lambda: T0 + 10 * DAY)
    layout = store.layout

    def partial(key: str, changed: float) -> Path:
        f = layout.partial(key) / "model" / "transformer" / "part.safetensors"
        f.parent.mkdir(parents=True)
        f.write_bytes(b"x" * 1000)
        for p in (f, f.parent, f.parent.parent, layout.partial(key)):
            _last_used(p, changed)
        return layout.partial(key)

    stale, recent, pulling = "a" * 64, "b" * 64, "c" * 64
    partial(stale, T0)               # interrupted ten days ago
    partial(recent, T0 + 9.5 * DAY)  # interrupted twelve hours ago: a retry resumes it
    partial(pulling, T0)             # old, but a pull works on it now
    held = locks.try_exclusive(layout.build_lock(pulling))

    dry = store.gc(10**12, dry_run=True)
    assert dry.partials_removed == [stale] and dry.partial_bytes_freed == 1000
    assert layout.partial(stale).is_dir()

    report = store.gc(10**12)
    assert report.partials_removed == [stale]
    assert sorted(report.partials_kept) == [recent, pulling]
    assert not layout.partial(stale).exists() and layout.partial(recent).is_dir()
    assert held is not None
    held.release()
    assert store.gc(10**12, partial_max_age_s=0).partials_removed == [recent, pulling]
    assert list(layout.partials.iterdir()) == []


def test_gc_dry_run_judges_pulled_models_on_a_read_only_root(
    hub: LocalHub, tmp_path: Path,
) -> None:
    require_mounts()
    root = tmp_path / "cache"
    model = _pulled(root)
    stale = Layout(root).partial("d" * 64)
    (stale / "model").mkdir(parents=True)
    _last_used(stale / "model", T0)
    _last_used(stale, T0)
    before = sorted((str(p), p.stat().st_mtime_ns) for p in root.rglob("*"))
    view = tmp_path / "ro-view"
    out = in_mount_namespace(read_only_bind(root, view), cachectl_argv(
        "--root", str(view), "gc", "--max-bytes", "0", "--dry-run", "--json"), env=light_env())
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["removed"] == [model.key] and report["partials_removed"] == ["d" * 64]
    out = in_mount_namespace(read_only_bind(root, view), cachectl_argv(
        "--root", str(view), "rm", model.key), env=light_env())
    assert out.returncode == 3 and "read-only here" in out.stderr
    assert sorted((str(p), p.stat().st_mtime_ns) for p in root.rglob("*")) == before


def test_only_paths_inside_a_pulled_entry_take_a_lease(hub: LocalHub, tmp_path: Path) -> None:
    model = _pulled(tmp_path / "cache")
    link = tmp_path / "pod" / "models" / "model"
    link.parent.mkdir(parents=True)
    link.symlink_to(model.model_dir)  # what `cachectl pull --link` leaves in the pod
    assert pulled_entry_of(link) == model.path
    assert pulled_entry_of(link / "transformer" / "config.json") == model.path
    assert pulled_entry_of(model.path) is None  # the entry itself is not its model folder
    assert pulled_entry_of(tmp_path) is None and lease_pulled_model(tmp_path) is None
    look_alike = tmp_path / "v1" / "models" / model.key / "model"  # no manifest: not an entry
    look_alike.mkdir(parents=True)
    assert pulled_entry_of(look_alike) is None


def test_the_engine_holds_the_lease_while_it_serves_a_pulled_model(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from huggingface_hub import constants

    from ditserve.engine.config import EngineConfig
    from ditserve.engine.loop.engine import DiffusionEngine

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    files = {p.relative_to(tiny_model).as_posix(): p.read_bytes()
             for p in tiny_model.rglob("*") if p.is_file()}
    root, link = tmp_path / "cache", tmp_path / "pod" / "models" / "model"
    with LocalHub(repos={"org/tiny-flux": Repo(files)}).running() as running:
        monkeypatch.setenv("HF_ENDPOINT", running.url)
        assert main(["pull", "hf://org/tiny-flux", "--root", str(root), "--no-daemon",
                     "--link", str(link), "--json"]) == 0
    key = json.loads(capsys.readouterr().out)["key"]
    store = CacheStore(root, create=False)

    engine = DiffusionEngine(EngineConfig(model=str(link), device="cpu")).start()
    try:
        assert engine.ready
        assert next(i for i in store.list_all() if i.key == key).in_use
        assert main(["rm", "--root", str(root), key]) == 3
        assert store.gc(0).kept_in_use == [key]
    finally:
        engine.shutdown()
    assert not next(i for i in store.list_all() if i.key == key).in_use
    assert main(["rm", "--root", str(root), key]) == 0


def test_a_pulled_model_removed_as_the_engine_starts_is_a_clear_load_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # rm / gc may take the entry between the pod's pull and the engine's lease: the start
    # fails naming the model and what to do, not with a bare FileNotFoundError.
    from ditserve.cachectl import model_lease
    from ditserve.engine.config import EngineConfig
    from ditserve.engine.errors import ModelLoadError
    from ditserve.engine.loop.startup import ModelLeases

    def removed(path: object, **_: object) -> None:
        raise FileNotFoundError(2, "No such file or directory", str(path))

    monkeypatch.setattr(model_lease, "lease_pulled_model", removed)
    leases = ModelLeases()
    with pytest.raises(ModelLoadError, match="removed from the node cache.*restart the pod"):
        leases.take(EngineConfig(model="/models/model", device="cpu"))
    assert leases.held == []
