"""GC: LRU down to a byte budget, never an entry a live process holds."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from cachectl_support import (
    Child,
    cachectl_argv,
    make_identity,
    synthetic_tensors,
    without_file_permissions_bypass,
)

from ditserve.cachectl.errors import EntryNotFoundError, UsageError
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


def test_gc_without_a_budget_is_refused(lru_store: CacheStore, clock: Clock) -> None:
    _three_entries(lru_store, clock)
    with pytest.raises(UsageError, match="--max-bytes"):
        lru_store.gc(None)  # type: ignore[arg-type]
    assert len(lru_store.keys()) == 3


def test_gc_sweeps_the_record_temp_of_a_killed_writer_only(
    lru_store: CacheStore, clock: Clock, children: list[Child],
) -> None:
    keys = _three_entries(lru_store, clock)
    writer = Child("record-stop", str(lru_store.root), keys[0])
    children.append(writer)
    assert writer.read()["stage"] == "record_written"  # parked between write and rename

    def temps() -> list[str]:
        return sorted(p.name for d in (lru_store.layout.recipes, lru_store.layout.stamps)
                      for p in d.iterdir() if p.name.startswith("."))

    dead = lru_store.layout.stamps / f".{keys[1]}.json.4242.cafe"  # a writer long gone
    dead.write_text("{")
    assert len(temps()) == 2
    lru_store.gc(max_bytes=10**12)
    assert temps() == [n for n in temps() if n.startswith(".") and "cafe" not in n]
    assert len(temps()) == 1  # the live writer's temp stays: it holds its flock
    writer.kill9()
    lru_store.gc(max_bytes=10**12)
    assert temps() == []
    assert lru_store.keys() == sorted(keys)  # the budget holds them all


def test_an_unreadable_entry_is_reported_not_a_crash(
    lru_store: CacheStore, clock: Clock,
) -> None:
    keys = _three_entries(lru_store, clock)
    locked_dir, locked_file = lru_store.layout.entry(keys[0]), None
    with lru_store.join(keys[1]) as e:
        locked_file = e.files()[0]
    locked_dir.chmod(0)
    locked_file.chmod(0)
    root = ["--root", str(lru_store.root)]
    try:
        listing = subprocess.run(without_file_permissions_bypass(cachectl_argv(*root, "list")),
                                 capture_output=True, text=True, timeout=60)
        assert listing.returncode == 0, listing.stderr
        assert "unreadable: Permission denied" in listing.stdout
        verify = subprocess.run(without_file_permissions_bypass(
            cachectl_argv(*root, "verify", keys[0], keys[1])), capture_output=True, text=True,
            timeout=60)
        assert verify.returncode == 3, verify.stdout + verify.stderr  # unavailable, not corrupt
        assert f"UNREADABLE {keys[0]}" in verify.stdout
        assert f"UNREADABLE {keys[1]}" in verify.stdout
        assert f"{locked_file.name}: unreadable: Permission denied" in verify.stdout
        assert "bad safetensors header" not in verify.stdout
        gc_run = subprocess.run(without_file_permissions_bypass(
            cachectl_argv(*root, "gc", "--max-bytes", "0")), capture_output=True, text=True,
            timeout=60)
        assert gc_run.returncode == 0, gc_run.stderr
        assert f"kept   {keys[0]} (unreadable" in gc_run.stdout
    finally:
        locked_dir.chmod(0o755)
        if locked_file.exists():
            locked_file.chmod(0o444)
    assert lru_store.keys() == [keys[0]]  # the unreadable shard's entry could be judged: gone


def test_verify_holds_a_lease_so_gc_cannot_remove_an_entry_mid_hash(
    lru_store: CacheStore, clock: Clock,
) -> None:
    import threading

    from ditserve.cachectl.hashing import RateLimiter

    keys = _three_entries(lru_store, clock)
    hashing, go_on = threading.Event(), threading.Event()

    class Parked(RateLimiter):
        """Parks the hash of the entry's bytes until the test lets it go."""

        def acquire(self, nbytes: int) -> None:
            hashing.set()
            assert go_on.wait(30)

    limiter = Parked(1.0)
    done: list[list] = []
    worker = threading.Thread(target=lambda: done.append(lru_store.verify([keys[0]],
                                                                          limiter=limiter)))
    worker.start()
    assert hashing.wait(30)
    gc_run = subprocess.run(cachectl_argv("--root", str(lru_store.root), "gc", "--max-bytes",
                                          "0", "--json"), capture_output=True, text=True,
                            timeout=60)
    go_on.set()
    worker.join(30)
    report = json.loads(gc_run.stdout)
    assert report["kept_in_use"] == [keys[0]] and sorted(report["removed"]) == sorted(keys[1:])
    assert done[0][0].ok


@pytest.mark.parametrize("trial", range(3))
def test_verify_racing_gc_in_real_processes_reports_only_ok_or_skipped(
    tmp_path: Path, trial: int,
) -> None:
    store = CacheStore(tmp_path / "cache")
    keys = {store.publish(make_identity(seed), synthetic_tensors(seed, n=8, size=2**17)).key
            for seed in range(8)}
    root = ["--root", str(store.root)]
    verify = subprocess.Popen(cachectl_argv(*root, "verify", "--json", "--threads", "1"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    gc_run = subprocess.Popen(cachectl_argv(*root, "gc", "--max-bytes", "0", "--json"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    (v_out, v_err), (g_out, g_err) = verify.communicate(timeout=120), gc_run.communicate(timeout=120)
    assert verify.returncode == 0, v_out + v_err
    assert gc_run.returncode == 0, g_err
    reports = {r["key"]: r for r in json.loads(v_out)}
    removed = set(json.loads(g_out)["removed"])
    assert set(reports) <= keys and removed <= keys
    assert {r["status"] for r in reports.values()} <= {"ok", "skipped"}
    assert {k for k, r in reports.items() if r["status"] == "skipped"} <= removed
    assert set(store.keys()) == keys - removed


def test_scrub_racing_gc_in_a_real_process_counts_no_corruption(tmp_path: Path) -> None:
    import logging

    from ditserve.cachectl.metrics import DaemonMetrics
    from ditserve.cachectl.scrub import Scrubber

    store = CacheStore(tmp_path / "cache", threads=1)
    for seed in range(8):
        store.publish(make_identity(seed), synthetic_tensors(seed, n=8, size=2**17)).close()
    metrics = DaemonMetrics(store)
    scrubber = Scrubber(store, metrics, logging.getLogger("test.scrub"), interval_s=0,
                        rate_bytes_per_s=None)
    gc_run = subprocess.Popen(cachectl_argv("--root", str(store.root), "gc", "--max-bytes", "0"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reports = scrubber.scrub_once()
    assert gc_run.wait(timeout=120) == 0
    assert {r.status for r in reports} <= {"ok", "skipped"}
    assert metrics.verify_failures._value.get() == 0
