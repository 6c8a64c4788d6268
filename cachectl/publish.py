"""Writing one entry: preflight, temp dir, shards, fsync, manifest, atomic rename, fsync parent.

Runs only with the key's build lock held (the store takes it). Each step announces a named
stage to an optional hook so crash tests can kill a real writer at exactly that point:

    tmp_created -> written (shards on disk, not yet fsync'ed) -> synced (files, manifest and
    temp dir fsync'ed) -> before_rename -> renamed (visible; parent not yet fsync'ed) -> published

Until ``renamed`` nothing is visible under ``v1/entries``; after it the entry is complete. A
full disk (or no inodes left) at any point before that is one clean InsufficientSpaceError,
and the temp dir is gone.
"""

from __future__ import annotations

import datetime
import errno
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

from ditserve.cachectl.digests import content_digest, file_digest, over_pieces
from ditserve.cachectl.errors import CacheError, InsufficientSpaceError
from ditserve.cachectl.hashing import PIECE_BYTES, default_threads, hash_buffers
from ditserve.cachectl.identity import EntryIdentity
from ditserve.cachectl.layout import Layout
from ditserve.cachectl.manifest import MANIFEST_NAME, FileRecord, Manifest, TensorRecord
from ditserve.cachectl.st_format import (
    RawTensor,
    as_raw,
    header_bytes,
    order_for_alignment,
    write_shard,
)

StageHook = Callable[[str], None]
ProgressFn = Callable[[int, int], None]
SPACE_MARGIN = 64 * 2**20  # headers, manifest and some slack for the filesystem
_FULL = (errno.ENOSPC, errno.EDQUOT)


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


def preflight(layout: Layout, nbytes: int, files: int) -> None:
    """Refuse before writing when the filesystem lacks the bytes or the inodes."""
    short = space_shortfall(layout, nbytes + SPACE_MARGIN, files + 2)  # + temp dir, manifest
    if short is not None:
        raise short


def space_shortfall(layout: Layout, nbytes: int, inodes: int, *,
                    at: Path | None = None) -> InsufficientSpaceError | None:
    """What the filesystem under ``at`` (the temp dir by default) lacks for writing ``nbytes``
    in ``inodes`` new files and folders - inodes, else bytes - or None. Some filesystems
    (btrfs) report no inode counts at all: nothing to check there."""
    st = os.statvfs(at or layout.tmp)
    if st.f_files and st.f_favail < inodes:
        return InsufficientSpaceError(str(layout.root), inodes, st.f_favail, unit="inodes")
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        return InsufficientSpaceError(str(layout.root), nbytes, free)
    return None


def out_of_space(layout: Layout, nbytes: int, inodes: int, *,
                 at: Path | None = None) -> InsufficientSpaceError:
    """What ran out when a write failed with ENOSPC: the inodes when fewer than ``inodes``
    are left, else the bytes."""
    st = os.statvfs(at or layout.tmp)
    return (space_shortfall(layout, 0, inodes, at=at)
            or InsufficientSpaceError(str(layout.root), nbytes, st.f_bavail * st.f_frsize))


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
    shards = plan_shards(raws, shard_bytes)
    preflight(layout, total, len(shards))
    tmp = layout.tmp / f"{key}.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        tmp.mkdir()
        stage("tmp_created")
        manifest = _write_files(tmp, key, identity, raws, shards, threads=threads,
                                metadata={"format": "pt", **(metadata or {})},
                                on_progress=on_progress)
        stage("written")
        for f in manifest.files:
            fsync_path(tmp / f.name)
        fd = os.open(tmp / MANIFEST_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
        with os.fdopen(fd, "w") as out:
            json.dump(manifest.to_json(), out, indent=1, sort_keys=True)
            out.flush()
            os.fsync(out.fileno())
        fsync_path(tmp)
        stage("synced")
    except BaseException as e:
        # A failed write (disk full, I/O error, Ctrl-C) leaves nothing behind; only a killed
        # writer leaves a temp dir, which the next owner of the key's lock removes.
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in _FULL:
            raise out_of_space(layout, total + SPACE_MARGIN, len(shards) + 2) from e
        raise
    stage("before_rename")
    # rename(2) of a directory onto a missing name is atomic: readers see all of it or nothing.
    os.rename(tmp, layout.entry(key))
    stage("renamed")
    fsync_path(layout.entries)  # make the rename itself durable
    stage("published")
    return manifest


def _write_files(tmp: Path, key: str, identity: EntryIdentity, raws: dict[str, RawTensor],
                 shards: list[list[str]], *, threads: int | None, metadata: dict[str, str],
                 on_progress: ProgressFn | None) -> Manifest:
    """Write the shards while hashing the tensors' pieces from memory, both in parallel."""
    total = sum(r.nbytes for r in raws.values())
    names = [f"part-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    heads = [header_bytes([(n, raws[n]) for n in shard], {**metadata, "ditserve.entry": key})
             for shard in shards]
    done = 0
    progress_lock = threading.Lock()

    def progress(n: int) -> None:
        nonlocal done
        with progress_lock:
            done += n
            current = done
        if on_progress is not None:
            on_progress(current, total)

    def write_one(i: int) -> int:
        return write_shard(tmp / names[i], heads[i], [(n, raws[n]) for n in shards[i]],
                           on_bytes=progress)

    # Writing is I/O (one thread per shard, up to the cores); hashing is CPU on every core.
    workers = max(1, min(threads or default_threads(), len(shards)))
    with ThreadPoolExecutor(workers, thread_name_prefix="cachectl-write") as pool:
        sizes = pool.map(write_one, range(len(shards)))
        buffers = {n: r.data for n, r in raws.items()}
        buffers.update({f"\0header:{i}": memoryview(h) for i, h in enumerate(heads)})
        pieces = hash_buffers(buffers, threads=threads)
        file_sizes = list(sizes)
    files, records = [], []
    for i, (fname, shard) in enumerate(zip(names, shards, strict=True)):
        offset = len(heads[i])
        digests = []
        for n in shard:
            raw = raws[n]
            hexes = tuple(p.hex() for p in pieces[n])
            records.append(TensorRecord(n, raw.dtype, raw.shape, fname, offset, raw.nbytes,
                                        over_pieces(pieces[n]), hexes))
            digests.append(records[-1].sha256)
            offset += raw.nbytes
        header_sha = over_pieces(pieces[f"\0header:{i}"])
        assert offset == file_sizes[i], "a shard's size is its header plus its tensors"
        files.append(FileRecord(fname, file_sizes[i], file_digest(header_sha, digests),
                                header_sha))
    rows = [(t.name, t.dtype, t.shape, t.sha256) for t in records]
    return Manifest(
        key=key, identity=identity.to_json(), piece_bytes=PIECE_BYTES, files=tuple(files),
        tensors=tuple(sorted(records, key=lambda t: t.name)), metadata=metadata,
        total_bytes=total, content_digest=content_digest(rows, metadata, PIECE_BYTES),
        created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        writer={"host": socket.gethostname(), "pid": os.getpid()},
    )
