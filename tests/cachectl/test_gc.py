"""GC: LRU down to a byte budget, never an entry a live process holds."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
from cachectl_support import Child, make_identity, synthetic_tensors

from ditserve.cachectl.errors import EntryNotFoundError
from ditserve.cachectl.identity import recipe_for
from ditserve.cachectl.store import CacheStore


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _three_entries(store: CacheStore, clock: Clock) -> list[str]:
    keys = []
    for seed in range(3):
        clock.now += 100
        with store.publish(make_identity(seed), synthetic_tensors(seed)) as e:
            keys.append(e.key)
    return keys  # last used in this order: keys[0] oldest


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def lru_store(tmp_path: Path, clock: Clock) -> CacheStore:
    return CacheStore(tmp_path / "cache", clock=clock)


def test_gc_removes_least_recently_used_first_down_to_the_budget(
    lru_store: CacheStore, clock: Clock,
) -> None:
    keys = _three_entries(lru_store, clock)
    clock.now += 100
    lru_store.join(keys[0]).close()  # keys[0] is now the most recent; keys[1] the oldest
    one = lru_store.list()[0].bytes
    report = lru_store.gc(max_bytes=one + one // 2)
    assert report.removed == [keys[1], keys[2]]
    assert lru_store.keys() == [keys[0]] and report.bytes_after <= one + one // 2
    with pytest.raises(EntryNotFoundError):
        lru_store.join(keys[1])


def test_gc_never_removes_an_entry_a_live_process_maps(
    lru_store: CacheStore, clock: Clock, children: list[Child],
) -> None:
    keys = _three_entries(lru_store, clock)
    reader = Child("lease", str(lru_store.root), keys[0])  # the oldest entry, held
    children.append(reader)
    assert reader.read()["leased"] == keys[0]
    assert next(i for i in lru_store.list() if i.key == keys[0]).in_use

    report = lru_store.gc(max_bytes=0)
    assert report.kept_in_use == [keys[0]]
    assert sorted(report.removed) == sorted(keys[1:])
    assert lru_store.keys() == [keys[0]]

    assert reader.finish() == 0  # the reader lets go; now it can go
    assert lru_store.gc(max_bytes=0).removed == [keys[0]]
    assert lru_store.keys() == []


def test_an_in_process_reader_is_protected_too(lru_store: CacheStore, clock: Clock) -> None:
    keys = _three_entries(lru_store, clock)
    with lru_store.join(keys[1]) as held:
        tensors = held.tensors()
        assert lru_store.remove(keys[1]) is False
        lru_store.gc(max_bytes=0)
        assert lru_store.keys() == [keys[1]]
        assert float(tensors["blocks.0.weight"].sum()) == pytest.approx(
            float(synthetic_tensors(1)["blocks.0.weight"].sum()), rel=1e-4)


def test_dry_run_removes_nothing(lru_store: CacheStore, clock: Clock) -> None:
    keys = _three_entries(lru_store, clock)
    report = lru_store.gc(max_bytes=0, dry_run=True)
    assert report.removed == keys and lru_store.keys() == sorted(keys)


def test_gc_sweeps_dead_writers_temps_and_orphan_recipes(
    lru_store: CacheStore, clock: Clock,
) -> None:
    key = make_identity().key
    stale = lru_store.layout.tmp / f"{key}.4242.deadbeef"
    stale.mkdir()
    (stale / "part-00000-of-00001.safetensors").write_bytes(b"partial")
    recipe = recipe_for(source_fingerprint="d" * 64, dtype="float32", loader="tests.synthetic",
                        loader_version="1")
    lru_store.record_recipe(recipe, key)  # points to an entry that does not exist
    lru_store.gc(max_bytes=0)
    assert list(lru_store.layout.tmp.iterdir()) == []
    assert list(lru_store.layout.recipes.iterdir()) == []


def _can_mount_read_only() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_mount_read_only(), reason="needs unshare -rm (user+mount namespace)")
def test_readers_on_a_read_only_mount_join_and_are_protected(
    lru_store: CacheStore, clock: Clock, children: list[Child],
) -> None:
    # As in an engine pod: the cache root is mounted read-only; the reader creates nothing.
    keys = _three_entries(lru_store, clock)
    root = lru_store.root
    clock.now = time.time() + 10  # old enough to stamp
    assert lru_store.stamp(keys[0]).ok
    wrap = ["unshare", "-rm", "sh", "-c", f"mount --bind -o ro {root} {root} && exec"]
    readers = [Child("lease", str(root), key, wrap=wrap) for key in keys[:2]]
    children.extend(readers)
    first, second = (r.read() for r in readers)
    assert first == {"leased": keys[0], "validated_by": "stamp"}
    assert second == {"leased": keys[1], "validated_by": "hash"}  # no stamp: re-hashed, fine
    report = lru_store.gc(max_bytes=0)
    assert sorted(report.kept_in_use) == sorted(keys[:2]) and report.removed == [keys[2]]
    assert all(r.finish() == 0 for r in readers)


def test_a_reader_that_loses_the_race_to_gc_sees_the_entry_gone(
    lru_store: CacheStore, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import fcntl

    with lru_store.publish(make_identity(), synthetic_tensors()) as e:
        key = e.key
    real_flock = fcntl.flock

    def gc_runs_between_open_and_flock(fd: int, op: int) -> None:
        # The reader has opened the entry directory; GC removes the entry before its flock.
        monkeypatch.setattr(fcntl, "flock", real_flock)
        assert lru_store.remove(key)
        real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", gc_runs_between_open_and_flock)
    with pytest.raises(EntryNotFoundError):
        lru_store.join(key)
    assert lru_store.keys() == []
