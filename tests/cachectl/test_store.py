"""Publish, join, ensure and recipes of the store, on real files."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from cachectl_support import make_identity, synthetic_tensors
from safetensors.torch import load_file

from ditserve.cachectl import locks
from ditserve.cachectl.errors import (
    ContentMismatchError,
    EntryCorruptError,
    EntryNotFoundError,
    InsufficientSpaceError,
    LockTimeoutError,
)
from ditserve.cachectl.identity import recipe_for
from ditserve.cachectl.st_format import ITEMSIZE
from ditserve.cachectl.store import CacheStore


def _torch_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w32": torch.randn(64, 33, generator=g),
        "wbf16": torch.randn(17, 5, generator=g).to(torch.bfloat16),
        "w16": torch.randn(3, generator=g).half(),
        "ids": torch.arange(7),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "strided": torch.randn(8, 8, generator=g).t(),  # non-contiguous on purpose
    }


def test_publish_then_join_roundtrips_every_dtype(store: CacheStore) -> None:
    tensors = _torch_tensors()
    ident = make_identity()
    with store.publish(ident, tensors) as entry:
        assert entry.built and entry.key == ident.key
    with store.join(ident.key) as entry:
        for view in (entry.tensors(), entry.readonly_tensors()):
            assert view.keys() == tensors.keys()
            for name, t in tensors.items():
                assert view[name].dtype == t.dtype and torch.equal(view[name], t), name
        # Standard safetensors files: the stock loader reads every shard.
        loaded: dict[str, torch.Tensor] = {}
        for f in entry.files():
            loaded.update(load_file(f))
        assert all(torch.equal(loaded[n], t) for n, t in tensors.items())
        assert entry.manifest.total_bytes == sum(t.numel() * t.element_size() for t in tensors.values())


def test_shards_keep_every_tensor_aligned_and_within_budget(store: CacheStore) -> None:
    with store.publish(make_identity(), synthetic_tensors(n=40)) as entry:
        assert len(entry.manifest.files) > 1
        assert all(f.size <= store.shard_bytes + 4096 for f in entry.manifest.files)
        assert all(t.offset % ITEMSIZE[t.dtype] == 0 for t in entry.manifest.tensors)


def _maps_of(path: Path) -> list[str]:
    return [line.split()[1] for line in Path("/proc/self/maps").read_text().splitlines()
            if line.endswith(str(path))]


def test_tensors_are_file_backed_mappings_not_copies(store: CacheStore) -> None:
    with store.publish(make_identity(), {"w": torch.ones(4096)}) as entry:
        shard = entry.files()[0]
        cow = entry.tensors()["w"]
        ro = entry.readonly_tensors()["w"]
        perms = _maps_of(shard)
        assert "r--s" in perms  # readonly_tensors: PROT_READ, shared
        assert any(p.startswith("r") and p.endswith("p") for p in perms)  # safetensors: private
        assert torch.equal(cow, ro)


def test_ensure_builds_once_then_joins(store: CacheStore) -> None:
    calls = []

    def build() -> dict[str, np.ndarray]:
        calls.append(1)
        return synthetic_tensors()

    with store.ensure(make_identity(), build) as first:
        assert first.built
    with store.ensure(make_identity(), build) as second:
        assert not second.built and second.key == first.key
    assert len(calls) == 1


def test_a_known_recipe_maps_the_entry_without_hashing_or_loading(store: CacheStore) -> None:
    recipe = recipe_for(source_fingerprint="c" * 64, dtype="float32", loader="tests.synthetic",
                        loader_version="1")
    seen = []

    def digest() -> str:
        seen.append("digest")
        return "0" * 64

    def build() -> dict[str, np.ndarray]:
        seen.append("build")
        return synthetic_tensors()

    with store.ensure_recipe(recipe, model_digest=digest, build_fn=build) as e1:
        assert e1.built and not e1.via_recipe
    with store.ensure_recipe(recipe, model_digest=digest, build_fn=build) as e2:
        assert e2.via_recipe and e2.key == e1.key
    assert seen == ["digest", "build"]


def test_join_of_a_missing_entry_names_the_fix(store: CacheStore) -> None:
    with pytest.raises(EntryNotFoundError, match="cachectl build"):
        store.join(make_identity().key)


def test_stamp_skips_the_rehash_until_a_file_changes(tmp_path: Path) -> None:
    # A clock 10 s ahead makes the fresh files old enough to be stamped (see verify.py).
    store = CacheStore(tmp_path / "c", clock=lambda: time.time() + 10)
    ident = make_identity()
    with store.publish(ident, synthetic_tensors()) as e:
        assert e.validated_by == "publish"  # digests of the bytes just written
    with store.join(ident.key) as e:
        assert e.validated_by == "hash"
    with store.join(ident.key) as e:
        assert e.validated_by == "stamp"
        shard = e.files()[0]
    with store.join(ident.key, full=True) as e:
        assert e.validated_by == "hash"
    # Change a byte and give the file a distinct mtime: the stamp no longer matches.
    os.chmod(shard, 0o644)
    with open(shard, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    os.utime(shard, ns=(1, 1))
    with pytest.raises(EntryCorruptError, match="sha256 mismatch"):
        store.join(ident.key)


def test_files_changed_within_the_racy_window_are_never_stamped(tmp_path: Path) -> None:
    # A clock behind the files' ctime: a write right after the stamp could share its tick.
    store = CacheStore(tmp_path / "c", clock=lambda: time.time() - 10)
    ident = make_identity()
    store.publish(ident, synthetic_tensors()).close()
    with store.join(ident.key) as e:
        assert e.validated_by == "hash"
    assert not store.layout.stamp(ident.key).exists()
    with store.join(ident.key) as e:
        assert e.validated_by == "hash"


def test_stamp_waits_out_the_racy_window_then_lets_joins_skip_the_hash(
    store: CacheStore,
) -> None:
    ident = make_identity()
    store.publish(ident, synthetic_tensors()).close()
    assert store.stamp(ident.key).ok
    with store.join(ident.key) as e:
        assert e.validated_by == "stamp"


def test_ensure_times_out_with_the_holder_named(tmp_path: Path) -> None:
    store = CacheStore(tmp_path / "c", lock_timeout_s=0.2)
    ident = make_identity()
    held = locks.acquire(store.layout.build_lock(ident.key), shared=False, timeout_s=1)
    assert held is not None
    with held, pytest.raises(LockTimeoutError, match=f"pid {os.getpid()}"):
        store.ensure(ident, synthetic_tensors)


def test_a_corrupt_entry_is_never_rebuilt_silently(store: CacheStore) -> None:
    ident = make_identity()
    with store.publish(ident, synthetic_tensors()) as e:
        shard = e.files()[0]
    shard.unlink()
    with pytest.raises(EntryCorruptError, match="missing file"):
        store.ensure(ident, lambda: pytest.fail("must not rebuild over a corrupt entry"))


def test_a_failed_write_leaves_nothing_behind(tmp_path: Path) -> None:
    def fail(stage: str) -> None:
        if stage == "written":
            raise OSError(28, "No space left on device")

    store = CacheStore(tmp_path / "c", on_stage=fail)
    with pytest.raises(InsufficientSpaceError, match="not enough space"):
        store.publish(make_identity(), synthetic_tensors())
    assert store.keys() == [] and list(store.layout.tmp.iterdir()) == []
    with CacheStore(tmp_path / "c").publish(make_identity(), synthetic_tensors()) as e:
        assert e.built  # the lock was released with the failure


def test_publish_joins_an_existing_entry_only_with_the_same_content(store: CacheStore) -> None:
    ident = make_identity()
    store.publish(ident, synthetic_tensors()).close()
    with store.publish(ident, synthetic_tensors()) as again:  # same bytes: joined
        assert not again.built
    other = synthetic_tensors()
    other["blocks.2.weight"] = other["blocks.2.weight"] + 1
    with pytest.raises(ContentMismatchError, match="blocks.2.weight") as err:
        store.publish(ident, other)
    assert err.value.differing == ["blocks.2.weight"]
    with store.join(ident.key) as entry:  # untouched
        assert np.array_equal(entry.tensors()["blocks.2.weight"].numpy(),
                              synthetic_tensors()["blocks.2.weight"])


def test_a_content_mismatch_after_a_load_records_no_recipe(store: CacheStore) -> None:
    recipe = recipe_for(source_fingerprint="e" * 64, dtype="float32", loader="tests.synthetic",
                        loader_version="1")
    ident = recipe.identity("0" * 64)
    store.publish(ident, synthetic_tensors()).close()  # built by a loader that behaved
    loaded = {**synthetic_tensors(), "step": np.arange(4, dtype=np.int64)}  # one that did not
    with pytest.raises(ContentMismatchError, match="step"):
        store.ensure_recipe(recipe, model_digest=lambda: "0" * 64, build_fn=lambda: loaded,
                            expected=loaded)
    assert store.resolve_recipe(recipe) is None  # no later process maps it unchecked
    with store.ensure_recipe(recipe, model_digest=lambda: "0" * 64,
                             build_fn=synthetic_tensors, expected=synthetic_tensors()) as e:
        assert not e.built and e.recipe_recorded
    assert store.resolve_recipe(recipe) == ident.key


def test_try_join_stamped_never_hashes(tmp_path: Path) -> None:
    store = CacheStore(tmp_path / "c", clock=lambda: time.time() + 10)
    ident = make_identity()
    store.publish(ident, synthetic_tensors()).close()
    assert store.try_join_stamped(ident.key) is None  # no stamp yet: a re-hash is needed
    assert store.verify([ident.key])[0].ok  # records the stamp
    with store.try_join_stamped(ident.key) as e:  # type: ignore[union-attr]
        assert e.validated_by == "stamp"
    assert store.try_join_stamped(make_identity(seed=5).key) is None


def test_an_entry_that_is_a_symlink_out_of_the_root_is_refused(
    store: CacheStore, tmp_path: Path,
) -> None:
    ident = make_identity()
    with store.publish(ident, synthetic_tensors()) as e:
        path = e.path
    outside = tmp_path / "outside"
    path.rename(outside)
    path.symlink_to(outside)
    with pytest.raises(EntryCorruptError, match="symlink"):
        store.join(ident.key)
    (report,) = store.verify()
    assert report.status == "corrupt" and "real directories" in report.problems[0].what
    report = store.gc(max_bytes=10**12)  # nothing to evict, but the link is not an entry
    assert store.keys() == [] and (outside / "manifest.json").is_file()  # never followed


def test_the_store_and_cli_import_neither_torch_nor_the_engine() -> None:
    import subprocess
    import sys

    code = ("import sys, ditserve.cachectl.store, ditserve.cachectl.cli, ditserve.cachectl.daemon;"
            "print(sorted(m for m in ('torch', 'ditserve.engine', 'kubernetes', 'diffusers')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
