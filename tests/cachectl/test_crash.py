"""Real writer processes killed with SIGKILL mid-publication, and concurrent builders."""

from __future__ import annotations

from pathlib import Path

import pytest
from cachectl_support import Child, make_identity, synthetic_tensors

from ditserve.cachectl import locks
from ditserve.cachectl.store import CacheStore

PRE_RENAME = ["tmp_created", "written", "synced", "before_rename"]


@pytest.mark.parametrize("stage", [*PRE_RENAME, "renamed"])
def test_kill9_at_each_stage_never_exposes_a_partial_entry(
    tmp_path: Path, stage: str, children: list[Child],
) -> None:
    root = tmp_path / "cache"
    writer = Child("publish-stop", str(root), "0", stage)
    children.append(writer)
    assert writer.read()["stage"] == stage  # the writer is parked exactly at this stage
    writer.kill9()

    store = CacheStore(root, shard_bytes=64 * 1024)
    key = make_identity().key
    # The kernel released the dead writer's flock: nobody has to clean a lock up.
    probe = locks.try_exclusive(store.layout.build_lock(key))
    assert probe is not None
    probe.release()

    if stage in PRE_RENAME:
        assert store.keys() == []  # nothing visible, not even a partial directory
        assert [d.name.split(".")[0] for d in store.layout.tmp.iterdir()] == [key]
    else:
        assert store.keys() == [key]
        assert all(r.ok for r in store.verify())  # complete once renamed

    with store.ensure(make_identity(), synthetic_tensors) as entry:
        assert entry.built == (stage in PRE_RENAME)
    assert list(store.layout.tmp.iterdir()) == []  # the next builder removed the leftovers
    assert store.keys() == [key] and all(r.ok for r in store.verify())


def test_concurrent_builders_publish_exactly_once(tmp_path: Path, children: list[Child]) -> None:
    root, log = tmp_path / "cache", tmp_path / "builds.log"
    builders = [Child("ensure", str(root), "0", str(log)) for _ in range(4)]
    children.extend(builders)
    for b in builders:
        assert b.read() == {"ready": True}
    for b in builders:  # release them together
        b.send("go")
    results = [b.read() for b in builders]
    assert all(b.finish() == 0 for b in builders)

    assert sum(r["built"] for r in results) == 1
    assert len(log.read_text().splitlines()) == 1
    assert len({r["key"] for r in results}) == 1 and len({r["digest"] for r in results}) == 1
    store = CacheStore(root)
    assert store.keys() == [results[0]["key"]] and all(r.ok for r in store.verify())
