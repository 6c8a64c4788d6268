"""A light writer/reader process for the crash, concurrency and lease tests (numpy only).

    cache_child.py publish-stop ROOT SEED STAGE   publish; at STAGE print it and block on stdin
    cache_child.py ensure ROOT SEED LOG            print ready, wait for a stdin line, ensure
    cache_child.py lease ROOT KEY                  join KEY, print leased, hold until stdin closes
    cache_child.py record-stop ROOT KEY            record a recipe for KEY; park between the
                                                   temp's write and its rename
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

from cachectl_support import make_identity, synthetic_tensors  # noqa: E402

from ditserve.cachectl.store import CacheStore  # noqa: E402


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def main(argv: list[str]) -> None:
    mode, root = argv[0], Path(argv[1])
    if mode == "publish-stop":
        seed, target = int(argv[2]), argv[3]

        def on_stage(name: str) -> None:
            if name == target:
                say(stage=name, pid=os.getpid())
                sys.stdin.readline()  # parked here until the test kills us

        store = CacheStore(root, shard_bytes=64 * 1024, on_stage=on_stage)
        with store.publish(make_identity(seed), synthetic_tensors(seed)) as entry:
            say(stage="done", key=entry.key)
    elif mode == "ensure":
        seed, log = int(argv[2]), Path(argv[3])
        store = CacheStore(root, shard_bytes=64 * 1024, lock_timeout_s=60)

        def build() -> dict[str, object]:
            with open(log, "a") as f:  # O_APPEND: one line per build, whoever runs it
                f.write(f"{os.getpid()}\n")
            return synthetic_tensors(seed)

        say(ready=True)
        sys.stdin.readline()
        with store.ensure(make_identity(seed), build) as entry:
            say(key=entry.key, built=entry.built, digest=entry.manifest.content_digest)
    elif mode == "lease":
        store = CacheStore(root)
        with store.join(argv[2]) as entry:
            say(leased=entry.key, validated_by=entry.validated_by)
            sys.stdin.read()
    elif mode == "record-stop":
        from ditserve.cachectl.identity import recipe_for

        def park(name: str) -> None:
            if name == "record_written":
                say(stage=name, pid=os.getpid())
                sys.stdin.readline()

        store = CacheStore(root, on_stage=park)
        recipe = recipe_for(source_fingerprint="b" * 64, dtype="float32",
                            loader="tests.synthetic", loader_version="1")
        say(recorded=store.record_recipe(recipe, argv[2]))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(sys.argv[1:])
