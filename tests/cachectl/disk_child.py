"""Scenarios on a tiny filesystem, run by test_disk_full.py inside a mount namespace where ROOT
is a fresh tmpfs (numpy only). Prints one JSON line with what it saw.

    disk_child.py preflight ROOT     publish more than the filesystem holds
    disk_child.py preflight-inodes ROOT   publish more shards than there are inodes
    disk_child.py fill-bytes ROOT    the disk fills up while the shards are written
    disk_child.py fill-inodes ROOT   the inodes run out while the shards are written
    disk_child.py record-full ROOT   publish, then record a recipe and a stamp on a full disk
"""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent))

from cachectl_support import make_identity, synthetic_tensors  # noqa: E402

from ditserve.cachectl.errors import InsufficientSpaceError  # noqa: E402
from ditserve.cachectl.identity import recipe_for  # noqa: E402
from ditserve.cachectl.store import CacheStore  # noqa: E402


def fill_bytes(root: Path) -> None:
    with open(root / "filler", "wb") as f:
        chunk = b"\0" * 2**20
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    # Also the last partial blocks: write small pieces until nothing fits.
    with open(root / "filler2", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 512)
        except OSError:
            pass


def fill_inodes(root: Path) -> None:
    (root / "many").mkdir()
    i = 0
    try:
        while True:
            (root / "many" / str(i)).touch()
            i += 1
    except OSError as e:
        assert e.errno == errno.ENOSPC, e


def leftovers(store: CacheStore) -> list[str]:
    return sorted(str(p.relative_to(store.root)) for d in (store.layout.tmp, store.layout.recipes,
                                                            store.layout.stamps)
                  for p in d.iterdir())


def main(mode: str, root: Path) -> None:
    out: dict[str, object] = {"mode": mode}
    if mode in ("preflight", "preflight-inodes", "fill-bytes", "fill-inodes"):
        def on_stage(stage: str) -> None:
            if stage == "tmp_created" and mode == "fill-bytes":
                fill_bytes(root)
            if stage == "tmp_created" and mode == "fill-inodes":
                fill_inodes(root)

        store = CacheStore(root, shard_bytes=64 * 1024, on_stage=on_stage)
        tensors = synthetic_tensors(n=128, size=2**14)  # 8 MiB in 129 shards
        if mode == "preflight":
            tensors["huge"] = np.zeros(2**20, dtype=np.float32)
        try:
            store.publish(make_identity(), tensors).close()
            out["error"] = None
        except InsufficientSpaceError as e:
            out["error"], out["unit"] = str(e), e.unit
        out["keys"], out["left"] = store.keys(), leftovers(store)
        for name in ("filler", "filler2", "many"):
            p = root / name
            if p.is_dir():
                for f in p.iterdir():
                    f.unlink()
                p.rmdir()
            elif p.exists():
                p.unlink()
        out["built_after"] = None
        if mode.startswith("fill"):
            store.on_stage = None
            with store.publish(make_identity(), tensors) as entry:  # room again: it works
                out["built_after"] = entry.built
    elif mode == "record-full":
        store = CacheStore(root, clock=lambda: 1e12)  # far ahead: fresh files may be stamped
        ident = make_identity()
        store.publish(ident, synthetic_tensors()).close()
        fill_bytes(root)
        recipe = recipe_for(source_fingerprint="a" * 64, dtype="float32",
                            loader="tests.synthetic", loader_version="1")
        out["recorded"] = store.record_recipe(recipe, ident.key)
        report = store.verify([ident.key])[0]
        out["verify_ok"], out["stamped"] = report.ok, store.layout.stamp(ident.key).exists()
        out["left"] = leftovers(store)
    print(json.dumps(out), flush=True)
    os.sync()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
