"""``cachectl pull URI``: a model from hf:// or s3:// into the node cache, once per node.

    resolve (metadata: the hub commit, the S3 listing) -> entry key
    -> published already? join it (structure checked)
    -> take the key's build lock (a concurrent pull of the same source waits here, then joins)
    -> disk-space preflight -> download into .partial/<key>/model/ (resumes what a killed pull
       left there) -> every file against its source's digest, then SHA-256 for the manifest
    -> publish (manifest, read-only files, fsync, rename into v1/models/<key>)

A file whose digest differs from its source's is deleted and downloaded once more; if it
differs again the pull fails with ModelDigestError and publishes nothing. Progress (phase,
bytes on disk under the partial folder against the snapshot's total) goes to ``on_phase`` /
``on_progress`` while the download runs, sampled from the disk, so it is the same whichever
library downloads. Called by the CLI (``cachectl pull``) and the daemon's pull jobs.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ditserve.cachectl import locks
from ditserve.cachectl.errors import (
    LockTimeoutError,
    ModelDigestError,
    ReadOnlyCacheError,
)
from ditserve.cachectl.layout import Layout
from ditserve.cachectl.model_uri import ModelUri, parse_model_uri
from ditserve.cachectl.publish import out_of_space, space_shortfall
from ditserve.cachectl.pulled import (
    MODEL_DIR,
    PulledFile,
    PulledModel,
    find_published,
    hash_files,
    local_files,
    model_key,
    publish_partial,
)
from ditserve.cachectl.sources import (
    Credentials,
    Snapshot,
    Source,
    check_listing,
    source_digest_matches,
)

PROGRESS_INTERVAL_S = 1.0
_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True)
class PullRequest:
    uri: str
    credentials: Credentials = field(default_factory=Credentials)
    workers: int = 8
    lock_timeout_s: float = 3600.0


def source_for(uri: ModelUri, credentials: Credentials) -> Source:
    """The source of ``uri``; its library (huggingface_hub, boto3) is imported only here."""
    if uri.scheme == "hf":
        from ditserve.cachectl.hub_source import HubSource

        return HubSource(uri, credentials)
    from ditserve.cachectl.s3_source import S3Source

    return S3Source(uri, credentials)


def _bytes_under(path: Path) -> int:
    total = 0
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            with contextlib.suppress(FileNotFoundError):  # renamed into place meanwhile
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


class _DiskProgress:
    """Samples the bytes under the partial folder every second while the download runs."""

    def __init__(self, path: Path, total: int, report: Callable[[int, int], None] | None) -> None:
        self.path, self.total, self.report = path, total, report
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cachectl-pull-progress",
                                        daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(PROGRESS_INTERVAL_S):
            self._sample()

    def _sample(self) -> None:
        if self.report is not None:
            # Blocks on disk, capped: sparse or preallocated files must not read as > 100 %.
            self.report(min(_bytes_under(self.path), self.total), self.total)

    def __enter__(self) -> _DiskProgress:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def _read_only_as(layout: Layout, uri: str) -> Iterator[None]:
    try:
        yield
    except OSError as e:
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise ReadOnlyCacheError(str(layout.root), f"pull {uri}") from e
        raise


def _preflight(layout: Layout, snapshot: Snapshot, partial: Path) -> None:
    """Enough free space for what is still to download (bytes already there count), and
    inodes for its files and folders."""
    still = max(0, snapshot.total_bytes - (_bytes_under(partial) if partial.exists() else 0))
    short = space_shortfall(layout, still, _inodes_needed(snapshot), at=layout.root)
    if short is not None:
        raise short


def _inodes_needed(snapshot: Snapshot) -> int:
    """Each file, its unfinished part, each folder (twice: beside .incomplete/), and the
    entry's own folders and manifest."""
    folders = {str(Path(f.name).parent) for f in snapshot.files} - {"."}
    return 2 * len(snapshot.files) + 2 * len(folders) + 5


def _check(snapshot: Snapshot, model_dir: Path) -> tuple[list[PulledFile], list[str]]:
    """The files as the manifest records them, and the names that differ from the source
    (size or digest). Files the source does not list are removed (a stale half-download)."""
    expected = {f.name: f for f in snapshot.files}
    present = {n: p for n, p in local_files(model_dir).items()
               if not n.startswith((".cache/", ".incomplete/"))}
    for name in set(present) - set(expected):
        present.pop(name).unlink()
    bad = sorted(n for n in expected if n not in present
                 or present[n].stat().st_size != expected[n].size)
    digests = hash_files({n: p for n, p in present.items() if n not in bad})
    for name, sha in digests.items():
        if not source_digest_matches(present[name], expected[name].digest, sha):
            bad.append(name)
    files = [PulledFile(n, expected[n].size, digests[n], expected[n].digest)
             for n in sorted(digests) if n not in bad]
    return files, sorted(bad)


def _download_checked(source: Source, snapshot: Snapshot, model_dir: Path, *, workers: int,
                      on_phase: Callable[[str], None],
                      cancel: threading.Event) -> list[PulledFile]:
    for attempt in (1, 2):
        on_phase("downloading" if attempt == 1 else "downloading again (digest mismatch)")
        source.download(snapshot, model_dir, workers=workers, cancel=cancel)
        on_phase("checking digests")
        files, bad = _check(snapshot, model_dir)
        if not bad:
            return files
        for name in bad:  # the next attempt (or the next pull) fetches these again
            (model_dir / name).unlink(missing_ok=True)
    raise ModelDigestError(snapshot.uri, "these files differ from the digests the source "
                                         f"published, twice: {', '.join(bad[:5])}"
                                         + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else ""))


def pull(root: Path, request: PullRequest, *,
         on_phase: Callable[[str], None] | None = None,
         on_progress: Callable[[int, int], None] | None = None,
         on_wait: Callable[[float], None] | None = None,
         cancel: threading.Event | None = None) -> PulledModel:
    """Pull ``request.uri`` into the cache at ``root`` (see the module doc). Setting ``cancel``
    stops the download within a chunk (``PullCancelledError``; the partial folder stays)."""
    phase = on_phase or (lambda _p: None)
    layout = Layout(Path(root))
    uri = parse_model_uri(request.uri)
    source = source_for(uri, request.credentials)
    phase("resolving")
    snapshot = source.resolve()
    check_listing(snapshot)
    key = model_key(snapshot.identity)
    found = find_published(layout, key, snapshot)
    if found is not None:
        return found
    phase("waiting for the lock")
    # Like `build`, a pull creates the cache it writes to; on a read-only mount of an existing
    # cache that succeeds, and the lock file is the first write.
    with _read_only_as(layout, snapshot.uri):
        layout.create()
        held = locks.acquire(layout.build_lock(key), shared=False,
                             timeout_s=request.lock_timeout_s, on_wait=on_wait)
    if held is None:
        raise LockTimeoutError(key, request.lock_timeout_s,
                               locks.read_holder(layout.build_lock(key)))
    with held:
        found = find_published(layout, key, snapshot)  # pulled while we waited
        if found is not None:
            return found
        partial = layout.partial(key)
        model_dir = partial / MODEL_DIR
        try:
            _preflight(layout, snapshot, partial)
            model_dir.mkdir(parents=True, exist_ok=True)
            with _DiskProgress(partial, snapshot.total_bytes, on_progress):
                files = _download_checked(source, snapshot, model_dir, workers=request.workers,
                                          on_phase=phase, cancel=cancel or threading.Event())
            # The downloaders' own bookkeeping (huggingface_hub's .cache, unfinished parts).
            for aside in (".cache", ".incomplete"):
                shutil.rmtree(model_dir / aside, ignore_errors=True)
            phase("publishing")
            path = publish_partial(layout, key, snapshot.identity, files, snapshot.uri)
        except OSError as e:
            if e.errno in _SPACE_ERRNOS:
                raise out_of_space(layout, snapshot.total_bytes, 1, at=layout.root) from e
            raise
    phase("published")
    return PulledModel(key, path, snapshot.uri, snapshot.revision, snapshot.total_bytes,
                       downloaded=True)
