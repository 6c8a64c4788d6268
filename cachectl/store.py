"""The cache store: publish, join, ensure (build-or-join), recipes, verify, list, GC.

``CacheStore(root)`` is the one library API of the cache. The engine joins entries through
it, the CLI and the daemon call it for everything else. No HTTP, no Kubernetes, no engine:
whoever builds an entry passes the function that makes its tensors. torch is touched only
when torch tensors are written or read (see ``st_format``, ``entry``).
Concurrency rules: one writer per key (kernel flock), readers (joins, verify, scrub) hold a
shared lease while they use an entry, GC removes only entries whose lease it can take
exclusively. On a read-only root every reading call works and every writing one raises
ReadOnlyCacheError.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ditserve.cachectl import gc, locks
from ditserve.cachectl.content import check_tensors_match
from ditserve.cachectl.entry import Entry
from ditserve.cachectl.errors import (
    CacheError,
    CacheNotFoundError,
    EntryNotFoundError,
    LockTimeoutError,
    Problem,
    ReadOnlyCacheError,
    UsageError,
    entry_error,
)
from ditserve.cachectl.gc import EntryInfo, GcReport
from ditserve.cachectl.hashing import RateLimiter
from ditserve.cachectl.identity import EntryIdentity, Recipe, is_key
from ditserve.cachectl.layout import Layout
from ditserve.cachectl.manifest import Manifest
from ditserve.cachectl.publish import ProgressFn, StageHook, remove_stale_temps, write_entry
from ditserve.cachectl.records import write_record
from ditserve.cachectl.validation import Validator, lease_entry
from ditserve.cachectl.verify import VerifyReport, check_structure

BuildFn = Callable[[], Mapping[str, Any]]
DEFAULT_SHARD_BYTES = 2**30
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


class CacheStore:
    """A node-local cache rooted at ``root``.

    create: make the root's directories if missing (builders); readers pass False so that a
    mistyped root raises CacheNotFoundError instead of looking like an empty cache.
    lock_timeout_s bounds waiting for another builder; ``threads`` caps hashing parallelism;
    ``clock`` (wall seconds) is injectable for LRU order and stamp trust in tests; ``on_stage``
    is the publication stage hook (crash tests).
    """

    def __init__(self, root: Path | str, *, create: bool = True, lock_timeout_s: float = 600.0,
                 threads: int | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES,
                 clock: Callable[[], float] = time.time,
                 on_stage: StageHook | None = None) -> None:
        if lock_timeout_s <= 0 or shard_bytes <= 0:
            raise CacheError("lock_timeout_s and shard_bytes must be positive")
        self.layout = Layout(Path(root))
        if create:
            try:
                self.layout.create()
            except OSError as e:
                # A read-only mount (engine pods) can still join what is published there.
                if not self.layout.entries.is_dir():
                    raise CacheError(f"cache root {root} is not usable ({e}); create it or fix "
                                     "--root / $DITSERVE_CACHE_ROOT") from e
        elif not self.layout.entries.is_dir():
            raise CacheNotFoundError(str(root))
        self.lock_timeout_s = lock_timeout_s
        self.threads = threads
        self.validator = Validator(self.layout, threads=threads, clock=clock)
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
        """A runtime entry or a pulled model of that key exists."""
        key = checked_key(key)
        return os.path.lexists(self.layout.entry(key)) or os.path.lexists(self.layout.model(key))

    def keys(self) -> list[str]:
        return gc.entry_keys(self.layout)

    # ---- join ---------------------------------------------------------------------------
    def join(self, key: str, *, full: bool = False) -> Entry:
        """Validate and lease a published entry. Raises EntryNotFound / EntryCorrupt /
        EntryUnavailable.

        Validation always checks structure (manifest and its digest chain, file set, sizes,
        headers); it re-hashes every piece unless a stamp shows no file changed since the last
        full hash (``full`` forces the re-hash).
        """
        entry = self._join(key, full=full, rehash=True)
        assert entry is not None
        return entry

    def try_join_stamped(self, key: str) -> Entry | None:
        """Join only if that needs no re-hash (a matching stamp); None otherwise."""
        try:
            return self._join(key, full=False, rehash=False)
        except CacheError:
            return None

    def _join(self, key: str, *, full: bool, rehash: bool) -> Entry | None:
        path = self.layout.entry(checked_key(key))
        lease = lease_entry(self.layout, key)
        try:
            manifest, by = self.validator.validate(key, path, full=full, rehash=rehash)
            if manifest is None:
                lease.release()
                return None
            self._touch(key)
            return Entry(path, manifest, lease, validated_by=by)
        except BaseException:
            lease.release()
            raise

    def _touch(self, key: str) -> None:
        # The entry directory's mtime is its last-used time, for LRU GC. Best effort: engines
        # join on a read-only mount; their init container (read-write) touched it already.
        now = self.clock()
        with contextlib.suppress(OSError):
            os.utime(self.layout.entry(key), (now, now))

    # ---- publish / ensure ---------------------------------------------------------------
    def publish(self, identity: EntryIdentity, tensors: Mapping[str, Any], *,
                metadata: Mapping[str, str] | None = None,
                on_progress: ProgressFn | None = None) -> Entry:
        """Publish ``tensors`` under ``identity``, or join the entry if it already exists and
        holds exactly these tensors (ContentMismatchError otherwise)."""
        return self.ensure(identity, lambda: tensors, metadata=metadata, on_progress=on_progress,
                           expected=tensors)

    def ensure(self, identity: EntryIdentity, build_fn: BuildFn, *,
               metadata: Mapping[str, str] | None = None,
               on_wait: Callable[[float], None] | None = None,
               on_progress: ProgressFn | None = None,
               expected: Mapping[str, Any] | None = None) -> Entry:
        """Join the entry of ``identity``, building it under the key's lock if it is missing.

        Exactly one process builds a key at a time; the others wait (bounded by
        ``lock_timeout_s``) and then join what it published. A corrupt entry raises: it is
        never rebuilt over silently. ``expected``: tensors already in hand (after an ordinary
        load); an existing entry is joined only if its content digest matches them.
        """
        key = identity.key
        try:
            return self._matching(self.join(key), expected)
        except EntryNotFoundError:
            pass
        lock_path = self.layout.build_lock(key)
        try:
            held = locks.acquire(lock_path, shared=False, timeout_s=self.lock_timeout_s,
                                 on_wait=on_wait)
        except OSError as e:
            if e.errno in _READ_ONLY:
                raise ReadOnlyCacheError(str(self.root), f"build entry {key}") from e
            raise
        if held is None:
            raise LockTimeoutError(key, self.lock_timeout_s, locks.read_holder(lock_path))
        with held:
            try:
                return self._matching(self.join(key), expected)  # published while we waited
            except EntryNotFoundError:
                pass
            remove_stale_temps(self.layout, key)
            tensors = build_fn()
            manifest = write_entry(self.layout, identity, tensors, shard_bytes=self.shard_bytes,
                                   threads=self.threads, metadata=metadata,
                                   on_stage=self.on_stage, on_progress=on_progress)
            return self._join_just_published(key, manifest)

    def _matching(self, entry: Entry, expected: Mapping[str, Any] | None) -> Entry:
        if expected is not None:
            try:
                check_tensors_match(entry.manifest, expected, threads=self.threads)
            except BaseException:
                entry.close()
                raise
        return entry

    def _join_just_published(self, key: str, manifest: Manifest) -> Entry:
        # The digests were computed from the very bytes we wrote and fsync'ed, under the build
        # lock: re-hashing them now would double the build time and prove nothing new. The
        # structure check still runs (it reads the files back from disk).
        path = self.layout.entry(key)
        lease = lease_entry(self.layout, key)
        try:
            on_disk, problems = check_structure(path, key)
            if problems or on_disk != manifest:
                raise entry_error(key, problems or [Problem(key, "manifest.json",
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

    def record_recipe(self, recipe: Recipe, key: str) -> bool:
        """Remember recipe -> key; best effort (False on a read-only mount or a full disk)."""
        return write_record(self.layout.recipe(recipe.key),
                            json.dumps({"entry": key, "recipe": recipe.to_json()}, sort_keys=True),
                            on_stage=self.on_stage)

    def ensure_recipe(self, recipe: Recipe, *, model_digest: Callable[[], str],
                      build_fn: BuildFn, expected: Mapping[str, Any] | None = None,
                      **kwargs: Any) -> Entry:
        """Map the recipe's entry without hashing or loading the model when it is known.

        On a miss: compute the model digest, ensure the entry (content-checked against
        ``expected`` when given), record the recipe (best effort).
        """
        key = self.resolve_recipe(recipe)
        if key is not None:
            try:
                entry = self._matching(self.join(key), expected)  # as ensure() checks it
                entry.via_recipe = True
                return entry
            except EntryNotFoundError:
                pass  # GC'ed between resolve and join: fall through to a normal ensure
        identity = recipe.identity(model_digest())
        entry = self.ensure(identity, build_fn, expected=expected, **kwargs)
        entry.recipe_recorded = self.record_recipe(recipe, identity.key)
        return entry

    # ---- verify (see validation.py) -----------------------------------------------------
    def verify(self, keys: Iterable[str] | None = None, *,
               limiter: RateLimiter | None = None) -> list[VerifyReport]:
        """Re-hash entries (all when ``keys`` is None) under a shared lease each; one report
        per entry, nothing fixed. An entry GC removes before we lease it is skipped when we
        were asked for all, missing when it was named."""
        named = keys is not None
        return [self.validator.verify_one(checked_key(k), named=named, limiter=limiter)
                for k in (list(keys) if keys is not None else self.keys())]

    def stamp(self, key: str) -> VerifyReport:
        """Full-hash an entry and record its stamp, so later joins (read-only ones too) skip
        the re-hash; right after a publication this first waits out the racy window."""
        return self.validator.stamp(checked_key(key))

    # ---- list / gc / remove (see gc.py) -------------------------------------------------
    def list(self) -> list[EntryInfo]:
        """Every published runtime entry with its size, last use and whether a process holds
        it (the daemon's NodeCache ``entries``; pulled models are its ``models``)."""
        return gc.list_entries(self.layout)

    def list_all(self) -> builtins.list[EntryInfo]:
        """Runtime entries and pulled models (``cachectl list``); ``kind`` tells them apart."""
        return gc.list_all(self.layout)

    def remove(self, key: str) -> bool:
        """Remove one runtime entry or pulled model now; False if a reader, a builder or a
        pull holds it."""
        return gc.remove_any(self.layout, checked_key(key), dry_run=False)

    def gc(self, max_bytes: int, *, dry_run: bool = False,
           partial_max_age_s: float = gc.pulled_gc.DEFAULT_PARTIAL_MAX_AGE_S) -> GcReport:
        """Remove unleased entries of both kinds, least recently used first, until at most
        ``max_bytes``; then drop partial pulls untouched for ``partial_max_age_s`` whose pull
        is over."""
        return gc.collect(self.layout, max_bytes, dry_run=dry_run,
                          partial_max_age_s=partial_max_age_s, clock=self.clock)


def checked_key(key: str) -> str:
    if not is_key(key):
        raise UsageError(f"{key!r} is not an entry key (64 lowercase hex digits); see `cachectl list`")
    return key
