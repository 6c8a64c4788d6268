"""Compiled artifacts in the node cache: ``<root>/v1/compile/<key>.bin``.

An engine started with ``--compile`` serializes what its warm-up compiled (torch's
mega-cache) under a key of model, shapes, backend, torch version and device
(``ditserve.engine.runner.compile_cache``); the next engine on the node with the same key
loads it and skips compiling. This module owns where the file lives and publishing it
atomically (temp file, fsync, rename: whole or absent, read-only). Called by the daemon
(``PUT /v1/compile/<key>``, for engine pods that mount the cache read-only) and by engines
that may write the root themselves.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from ditserve.cachectl.errors import UsageError
from ditserve.cachectl.identity import is_key


def compiled_path(root: Path, key: str) -> Path:
    if not is_key(key):
        raise UsageError(f"{key!r} is not a compile key (64 lowercase hex digits)")
    return Path(root) / "v1" / "compile" / f"{key}.bin"


def publish_compiled(root: Path, key: str, data: bytes) -> Path:
    target = compiled_path(root, key)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{key}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o444)
        os.replace(tmp, target)  # readers see the whole file or none
    finally:
        tmp.unlink(missing_ok=True)
    return target
