"""The cache store: publish, join, ensure (build-or-join), recipes, verify, list, GC.

``CacheStore(root)`` is the one library API of the cache. The engine joins entries through
it (issue 6), the CLI and the daemon call it for everything else. No HTTP, no Kubernetes;
torch is touched only when torch tensors are written or read (see ``st_format``, ``entry``).
Concurrency rules: one writer per key (kernel flock), readers hold a shared lease while they
map an entry, GC removes only entries whose lease it can take exclusively.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ditserve.cachectl import gc, locks
from ditserve.cachectl.entry import Entry
from ditserve.cachectl.errors import (
    CacheError,
    EntryCorruptError,
    EntryNotFoundError,
    LockTimeoutError,
    Problem,
)
from ditserve.cachectl.gc import EntryInfo, GcReport
from ditserve.cachectl.hashing import RateLimiter
from ditserve.cachectl.identity import EntryIdentity, Recipe, is_key
from ditserve.cachectl.layout import Layout
from ditserve.cachectl.manifest import Manifest
from ditserve.cachectl.publish import ProgressFn, StageHook, remove_stale_temps, write_entry
from ditserve.cachectl.verify import (
    VerifyReport,
    check_content,
    check_structure,
    forget_stamp,
    load_manifest,
    racy_margin_ns,
    signatures,
    stamp_matches,
    write_stamp,
)

BuildFn = Callable[[], Mapping[str, Any]]
DEFAULT_SHARD_BYTES = 2**30
LEASE_WAIT_S = 30.0  # GC holds a lease exclusively only while renaming an entry away


class CacheStore:
    """A node-local cache rooted at ``root`` (created on first use).

    lock_timeout_s bounds waiting for another builder; ``threads`` caps hashing parallelism;
    ``clock`` (wall seconds) is injectable for LRU order and stamp trust in tests; ``on_stage``
    is the publication stage hook (crash tests).
    """

    def __init__(self, root: Path | str, *, lock_timeout_s: float = 600.0,
                 threads: int | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES,
                 clock: Callable[[], float] = time.time,
                 on_stage: StageHook | None = None) -> None:
        if lock_timeout_s <= 0 or shard_bytes <= 0:
            raise CacheError("lock_timeout_s and shard_bytes must be positive")
        self.layout = Layout(Path(root))
        try:
            self.layout.create()
        except OSError as e:
            # A read-only mount (engine pods) can still join what is published there.
            if not self.layout.entries.is_dir():
                raise CacheError(f"cache root {root} is not usable ({e}); create it or fix "
                                 "--root / $DITSERVE_CACHE_ROOT") from e
        self.lock_timeout_s = lock_timeout_s
        self.threads = threads
        self.shard_bytes = shard_bytes
        self.clock = clock
        self.on_stage = on_stage

    @property
    def root(self) -> Path:
        return self.layout.root

    # ---- keys and existence -------------------------------------------------------------
    @staticmethod
    def key_of(identity: EntryIdentity) -> str:
        return identity.key

    def exists(self, key: str) -> bool:
        return self.layout.entry(_checked(key)).is_dir()

    def keys(self) -> list[str]:
        return sorted(p.name for p in self.layout.entries.iterdir() if is_key(p.name))

    # ---- join ---------------------------------------------------------------------------
    def join(self, key: str, *, full: bool = False) -> Entry:
        """Validate and lease a published entry. Raises EntryNotFound / EntryCorrupt.

        Validation always checks structure (manifest, file set, sizes, headers); it re-hashes
        every file unless a stamp shows no file changed since the last full hash (``full``
        forces the re-hash).
        """
        path = self.layout.entry(_checked(key))
        lease = self._lease(key)
        try:
            manifest, by = self._validate(key, path, full=full)
            self._touch(key)
            return Entry(path, manifest, lease, validated_by=by)
        except BaseException:
            lease.release()
            raise

    def _lease(self, key: str) -> locks.HeldLock:
        """A shared flock on the entry directory: works on a read-only mount of the cache."""
        try:
            lease = locks.acquire(self.layout.entry(key), shared=True, directory=True,
                                  timeout_s=LEASE_WAIT_S)
        except FileNotFoundError as e:  # never published, or GC renamed it away meanwhile
            raise EntryNotFoundError(key) from e
        if lease is None:
            raise LockTimeoutError(key, LEASE_WAIT_S, "garbage collection")
        return lease

    def _touch(self, key: str) -> None:
        # The entry directory's mtime is its last-used time, for LRU GC. Best effort: engines
        # join on a read-only mount; their init container (read-write) touched it already.
        now = self.clock()
        with contextlib.suppress(OSError):
            os.utime(self.layout.entry(key), (now, now))

    def _validate(self, key: str, path: Path, *, full: bool) -> tuple[Manifest, str]:
        manifest, problems = check_structure(path, key)
        if problems or manifest is None:
            raise EntryCorruptError(key, problems)
        stamp = self.layout.stamp(key)
        if not full and stamp_matches(stamp, path, manifest):
            return manifest, "stamp"
        before = signatures(path, manifest)
        started = int(self.clock() * 1e9)
        problems, _ = check_content(path, manifest, threads=self.threads)
        if problems:
            forget_stamp(stamp)
            raise EntryCorruptError(key, problems)
        write_stamp(stamp, before, signatures(path, manifest), started)
        return manifest, "hash"

    # ---- publish / ensure ---------------------------------------------------------------
    def publish(self, identity: EntryIdentity, tensors: Mapping[str, Any], *,
                metadata: Mapping[str, str] | None = None,
                on_progress: ProgressFn | None = None) -> Entry:
        """Publish ``tensors`` under ``identity`` (or join the entry if it already exists)."""
        return self.ensure(identity, lambda: tensors, metadata=metadata, on_progress=on_progress)

    def ensure(self, identity: EntryIdentity, build_fn: BuildFn, *,
               metadata: Mapping[str, str] | None = None,
               on_wait: Callable[[float], None] | None = None,
               on_progress: ProgressFn | None = None) -> Entry:
        """Join the entry of ``identity``, building it under the key's lock if it is missing.

        Exactly one process builds a key at a time; the others wait (bounded by
        ``lock_timeout_s``) and then join what it published. A corrupt entry raises: it is
        never rebuilt over silently.
        """
        key = identity.key
        try:
            return self.join(key)
        except EntryNotFoundError:
            pass
        lock_path = self.layout.build_lock(key)
        held = locks.acquire(lock_path, shared=False, timeout_s=self.lock_timeout_s,
                             on_wait=on_wait)
        if held is None:
            raise LockTimeoutError(key, self.lock_timeout_s, locks.read_holder(lock_path))
        with held:
            try:
                return self.join(key)  # published while we waited
            except EntryNotFoundError:
                pass
            remove_stale_temps(self.layout, key)
            tensors = build_fn()
            manifest = write_entry(self.layout, identity, tensors, shard_bytes=self.shard_bytes,
                                   threads=self.threads, metadata=metadata,
                                   on_stage=self.on_stage, on_progress=on_progress)
            return self._join_just_published(key, manifest)

    def _join_just_published(self, key: str, manifest: Manifest) -> Entry:
        # The digests were computed from the very bytes we wrote and fsync'ed, under the build
        # lock: re-hashing them now would double the build time and prove nothing new. The
        # structure check still runs (it reads the files back from disk).
        path = self.layout.entry(key)
        lease = self._lease(key)
        try:
            on_disk, problems = check_structure(path, key)
            if problems or on_disk != manifest:
                raise EntryCorruptError(key, problems or [Problem(key, "manifest.json",
                                                                  "differs from what was written")])
            self._touch(key)
            return Entry(path, manifest, lease, validated_by="publish", built=True)
        except BaseException:
            lease.release()
            raise

    # ---- recipes: skip-load-on-hit ------------------------------------------------------
    def resolve_recipe(self, recipe: Recipe) -> str | None:
        """The entry key a recipe was last published as, if that entry still exists."""
        try:
            record = json.loads(self.layout.recipe(recipe.key).read_text())
            key = str(record["entry"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return key if is_key(key) and self.layout.entry(key).is_dir() else None

    def record_recipe(self, recipe: Recipe, key: str) -> None:
        path = self.layout.recipe(recipe.key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        tmp.write_text(json.dumps({"entry": key, "recipe": recipe.to_json()}, sort_keys=True))
        os.replace(tmp, path)

    def ensure_recipe(self, recipe: Recipe, *, model_digest: Callable[[], str],
                      build_fn: BuildFn, **kwargs: Any) -> Entry:
        """Map the recipe's entry without hashing or loading the model when it is known.

        On a miss: compute the model digest, ensure the entry, record the recipe.
        """
        key = self.resolve_recipe(recipe)
        if key is not None:
            try:
                entry = self.join(key)
                entry.via_recipe = True
                return entry
            except EntryNotFoundError:
                pass  # GC'ed between resolve and join: fall through to a normal ensure
        identity = recipe.identity(model_digest())
        entry = self.ensure(identity, build_fn, **kwargs)
        self.record_recipe(recipe, identity.key)
        return entry

    # ---- verify -------------------------------------------------------------------------
    def verify(self, keys: Iterable[str] | None = None, *,
               limiter: RateLimiter | None = None) -> list[VerifyReport]:
        """Re-hash entries (all when ``keys`` is None); one report per entry, nothing fixed."""
        reports = []
        for key in (list(keys) if keys is not None else self.keys()):
            report = VerifyReport(key)
            start = time.monotonic()
            path = self.layout.entry(_checked(key))
            if not path.is_dir():
                report.problems.append(Problem(key, None, "no such entry"))
            else:
                manifest, report.problems = check_structure(path, key)
                if manifest is not None and not report.problems:
                    before = signatures(path, manifest)
                    started = int(self.clock() * 1e9)
                    report.problems, report.bytes_hashed = check_content(
                        path, manifest, threads=self.threads, limiter=limiter)
                    if report.ok:
                        write_stamp(self.layout.stamp(key), before, signatures(path, manifest),
                                    started)
                if not report.ok:
                    forget_stamp(self.layout.stamp(key))
            report.seconds = time.monotonic() - start
            reports.append(report)
        return reports

    def stamp(self, key: str) -> VerifyReport:
        """Full-hash an entry and record its stamp, so later joins (read-only ones too) skip
        the re-hash. Right after a publication this first waits out the racy window (at most
        ``racy_margin_ns``; see verify.py)."""
        path = self.layout.entry(_checked(key))
        try:
            sigs = signatures(path, load_manifest(path))
        except (CacheError, OSError):
            return self.verify([key])[0]  # let verify describe what is wrong
        ready_ns = max(sig[4] for sig in sigs.values()) + racy_margin_ns(sigs)
        wait_s = (ready_ns - self.clock() * 1e9) / 1e9
        if wait_s > 0:
            time.sleep(wait_s)  # the kernel's coarse ctime clock must move past the files' ctime
        return self.verify([key])[0]

    # ---- list / gc / remove (see gc.py) -------------------------------------------------
    def list(self) -> list[EntryInfo]:
        """Every published entry with its size, last use and whether a process holds it."""
        return gc.list_entries(self.layout)

    def remove(self, key: str) -> bool:
        """Remove one entry now; False if a reader or a builder holds it."""
        return gc.remove_entry(self.layout, _checked(key), dry_run=False)

    def gc(self, max_bytes: int = 0, *, dry_run: bool = False) -> GcReport:
        """Remove unleased entries, least recently used first, until at most ``max_bytes``."""
        return gc.collect(self.layout, max_bytes, dry_run=dry_run)


def _checked(key: str) -> str:
    if not is_key(key):
        raise CacheError(f"{key!r} is not an entry key (64 lowercase hex digits); see `cachectl list`")
    return key
