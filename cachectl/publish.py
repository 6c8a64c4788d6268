"""Writing one entry: preflight, temp dir, shards, fsync, manifest, atomic rename, fsync parent.

Runs only with the key's build lock held (the store takes it). Each step announces a named
stage to an optional hook so crash tests can kill a real writer at exactly that point:

    tmp_created -> written (shards on disk, not yet fsync'ed) -> synced (files, manifest and
    temp dir fsync'ed) -> before_rename -> renamed (visible; parent not yet fsync'ed) -> published

Until ``renamed`` nothing is visible under ``v1/entries``; after it the entry is complete.
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import shutil
import socket
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ditserve.cachectl.errors import CacheError, InsufficientSpaceError
from ditserve.cachectl.identity import EntryIdentity
from ditserve.cachectl.layout import Layout
from ditserve.cachectl.manifest import (
    MANIFEST_NAME,
    FileRecord,
    Manifest,
    TensorRecord,
    content_digest,
)
from ditserve.cachectl.st_format import (
    RawTensor,
    WrittenFile,
    as_raw,
    order_for_alignment,
    write_shard,
)

StageHook = Callable[[str], None]
ProgressFn = Callable[[int, int], None]
SPACE_MARGIN = 64 * 2**20  # headers, manifest and some slack for the filesystem


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def plan_shards(raws: Mapping[str, RawTensor], shard_bytes: int) -> list[list[str]]:
    """Pack tensors, in alignment order, into shards of at most ``shard_bytes`` (one if larger)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in order_for_alignment(list(raws), raws):
        n = raws[name].nbytes
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def remove_stale_temps(layout: Layout, key: str) -> int:
    """Remove temp dirs a dead writer of ``key`` left. Only call with the build lock held."""
    removed = 0
    if layout.tmp.is_dir():
        for d in layout.tmp.glob(f"{key}.*"):
            shutil.rmtree(d, ignore_errors=True)
            removed += 1
    return removed


def write_entry(
    layout: Layout,
    identity: EntryIdentity,
    tensors: Mapping[str, Any],
    *,
    shard_bytes: int,
    threads: int | None = None,
    metadata: Mapping[str, str] | None = None,
    on_stage: StageHook | None = None,
    on_progress: ProgressFn | None = None,
) -> Manifest:
    """Publish ``tensors`` as the entry of ``identity``. Caller holds the build lock."""
    stage = on_stage or (lambda _name: None)
    key = identity.key
    if not tensors:
        raise CacheError("refusing to publish an entry without tensors")
    raws = {str(name): as_raw(t) for name, t in tensors.items()}
    total = sum(r.nbytes for r in raws.values())
    free = shutil.disk_usage(layout.tmp).free
    if free < total + SPACE_MARGIN:
        raise InsufficientSpaceError(str(layout.root), total + SPACE_MARGIN, free)

    tmp = layout.tmp / f"{key}.{os.getpid()}.{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        stage("tmp_created")
        meta = {"format": "pt", **(metadata or {})}
        done = 0
        progress_lock = threading.Lock()

        def progress(n: int) -> None:
            nonlocal done
            with progress_lock:
                done += n
                current = done
            if on_progress is not None:
                on_progress(current, total)

        shards = plan_shards(raws, shard_bytes)
        names = [f"part-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]

        def write_one(i: int) -> WrittenFile:
            return write_shard(tmp / names[i], [(n, raws[n]) for n in shards[i]],
                               {**meta, "ditserve.entry": key}, on_bytes=progress)

        # Shards are written in parallel: hashing (file and tensor digests) is the bottleneck and
        # hashlib releases the GIL, so threads scale across cores.
        workers = max(1, min(threads or os.cpu_count() or 1, len(shards)))
        with ThreadPoolExecutor(workers, thread_name_prefix="cachectl-write") as pool:
            written_files = list(pool.map(write_one, range(len(shards))))
        files: list[FileRecord] = []
        records: list[TensorRecord] = []
        for fname, written in zip(names, written_files, strict=True):
            files.append(FileRecord(fname, written.size, written.sha256))
            records += [TensorRecord(t.name, t.dtype, t.shape, fname, t.offset, t.nbytes, t.sha256)
                        for t in written.tensors]
        stage("written")
        for f in files:
            fsync_path(tmp / f.name)
        manifest = Manifest(
            key=key, identity=identity.to_json(), files=tuple(files),
            tensors=tuple(sorted(records, key=lambda t: t.name)), metadata=meta,
            total_bytes=total, content_digest=content_digest(records, meta),
            created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            writer={"host": socket.gethostname(), "pid": os.getpid()},
        )
        fd = os.open(tmp / MANIFEST_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
        with os.fdopen(fd, "w") as f:
            json.dump(manifest.to_json(), f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(tmp)
        stage("synced")
    except BaseException:
        # A failed write (disk full, I/O error, Ctrl-C) leaves nothing behind; only a killed
        # writer leaves a temp dir, which the next owner of the key's lock removes.
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    stage("before_rename")
    # rename(2) of a directory onto a missing name is atomic: readers see all of it or nothing.
    os.rename(tmp, layout.entry(key))
    stage("renamed")
    fsync_path(layout.entries)  # make the rename itself durable
    stage("published")
    return manifest
