"""The runtime-cache backing: the DiT's host bytes are the node cache entry's shared pages.

``runtime_cache_dit`` returns the DiT and a ``runtime_cache`` HostWeightPlan:

- hit (the recipe of this model directory, dtype and loader names a published entry): join
  it, create the DiT on the meta device and bind its tensors to the entry's read-only
  mappings. The model files are neither read nor hashed (skip-load-on-hit), so the plan is
  marked ``skipped_materialization`` and must be consumed.
- miss: load the DiT ordinarily, build (or join) the entry from its final tensors under the
  key's lock, then repoint every Parameter's / buffer's storage to the entry's views
  (``param.data = view``: the objects stay, no post-load step runs again) and release the
  private copies (gc + ``malloc_trim``). An entry that already exists is joined only if its
  content digest matches the loaded tensors; otherwise the DiT keeps its own tensors and the
  plan's reason (``/ready``'s offload report) says why.

The recipe does not depend on the model directory's absolute path (an engine pod sees the
model at its mount path, the node daemon at the node path), so an entry that ``cachectl
ensure`` or the daemon built is a hit here, also on a read-only mount of the cache.

The entry's lease is held by the plan, so GC cannot remove the entry while it is mapped.
Entries are built by this process under the same lock and layout as ``cachectl`` (the
daemon is not asked; an init container or ``cachectl ensure`` may have built it already).

In AllGather mode the backend copies the rank's 1/group shards out of the mapping and then
closes the plan (mapping and lease): the shards are private and pinned, nothing reads the
mapping afterwards.

Called by ``backing_choice.prepare_dit``.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ditserve.engine.config import OffloadConfig
from ditserve.engine.offload.host.weight_plan import BackingKind, HostWeightPlan
from ditserve.engine.weights.checkpoint_mmap import (
    MappedSafetensors,
    expected_tensors,
    map_dit,
    preflight,
    source_views,
)

log = logging.getLogger(__name__)


def release_private_memory() -> None:
    """Collect dropped tensors and hand freed heap pages back to the OS (glibc only)."""
    gc.collect()
    # Not glibc (OSError/AttributeError): freed memory is returned lazily by the allocator.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def repoint(model: nn.Module, views: Mapping[str, torch.Tensor]) -> None:
    """Point every named parameter/buffer's storage at its view; the objects stay the same."""
    for name, view in views.items():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        tensor: torch.Tensor | None = module._parameters.get(leaf)
        if tensor is None:
            tensor = module._buffers[leaf]
        if tensor is None:
            raise KeyError(f"{name} is neither a parameter nor a buffer of the DiT")
        tensor.data = view


def map_entry(entry: Any) -> list[MappedSafetensors]:
    return [MappedSafetensors(p) for p in entry.files() if p.suffix == ".safetensors"]


def close_all(files: list[MappedSafetensors]) -> None:
    for f in files:
        f.close()


def _ensure_from_loaded(store: Any, model_plan: Any, model: nn.Module,
                        metadata: Mapping[str, str] | None) -> Any:
    """Build the entry from the loaded DiT's tensors, or join an existing one whose content
    digest matches them (ContentMismatchError otherwise). The tensor dict lives only in this
    frame: after the repoint nothing but the DiT may hold the private copies."""
    tensors = {n: t.detach().contiguous() for n, t in model.state_dict().items()}
    return store.ensure_recipe(model_plan.recipe, model_digest=model_plan.model_digest,
                               build_fn=lambda: tensors, expected=tensors, metadata=metadata)


def runtime_cache_dit(
    model_dir: str | Path,
    *,
    dtype: str,
    offload: OffloadConfig,
    model_cls: Any,
    load_dit: Callable[[], nn.Module],
    component: str = "transformer",
    sp_size: int = 1,
) -> tuple[nn.Module, HostWeightPlan]:
    """The DiT backed by its node cache entry (see module doc). Raises ``CacheError`` /
    ``OSError`` when the cache cannot be used; the caller falls back to ordinary memory.

    sp_size: the replica's sequence-parallel size; with the implementation (Ulysses) it is
    part of the entry's identity, so `cachectl build --sp-size N --sp-impl ulysses` builds
    the entry such an engine joins (SP ranks share it: the SP rank is not in the identity)."""
    from ditserve.cachectl.identity import Placement
    from ditserve.cachectl.layout import default_root
    from ditserve.cachectl.model_build import ModelRequest, describe_loader, plan_model
    from ditserve.cachectl.store import CacheStore
    from ditserve.engine.config import SEQUENCE_PARALLEL_IMPL
    from ditserve.engine.weights import loader

    store = CacheStore(offload.cache_root or default_root(),
                       lock_timeout_s=offload.cache_lock_timeout_s)
    placement = Placement(sp_size=sp_size,
                          sp_impl=SEQUENCE_PARALLEL_IMPL if sp_size > 1 else None)
    model_plan = plan_model(ModelRequest(Path(model_dir), dtype=dtype, component=component,
                                         placement=placement),
                            describe_loader(loader))
    key = store.resolve_recipe(model_plan.recipe)
    note = ""
    if key is not None:
        hit, note = _join_recipe_hit(store, key, model_dir, model_cls, dtype, component)
        if hit is not None:
            return hit
    return load_then_join(store, model_plan, load_dit(), note=note)


def _join_recipe_hit(
    store: Any, key: str, model_dir: str | Path, model_cls: Any, dtype: str, component: str,
) -> tuple[tuple[nn.Module, HostWeightPlan] | None, str]:
    """The DiT as views of the entry the recipe names, with no load at all; else None and a
    note on why the entry was not used (empty when it vanished before the join)."""
    from ditserve.cachectl.errors import EntryNotFoundError
    from ditserve.engine.weights.loader import torch_dtype

    try:
        entry = store.join(key)
    except EntryNotFoundError:
        return None, ""  # removed between resolve and join: build or join after a load
    files = map_entry(entry)
    config = model_cls.load_config(str(model_dir), subfolder=component)
    mapped, checked, views = map_dit(model_cls, config, torch_dtype(dtype), files)
    if mapped is not None:
        return (mapped, HostWeightPlan(
            BackingKind.RUNTIME_CACHE,
            reason=f"cache hit: entry {key[:12]} mapped, DiT load skipped (recipe)",
            bindings=checked.bindings, sources=views,
            mappings=files, coverage=checked.coverage, skipped_materialization=True,
            lease=entry,
        )), ""
    close_all(files)
    entry.close()
    log.warning("runtime cache: entry %s refused: %s", key[:12], checked.reason)
    return None, f" (the recipe's entry {key[:12]} did not fit: {checked.reason})"


def load_then_join(
    store: Any, model_plan: Any, model: nn.Module, *, note: str,
    metadata: Mapping[str, str] | None = None,
) -> tuple[nn.Module, HostWeightPlan]:
    """Build or join the entry from a loaded DiT, repoint the DiT at the entry's mapping and
    release the private copy; the ordinary plan (and the private copy) when that fails.
    metadata: recorded in an entry this call builds (a checkpoint file's layer forms)."""
    from ditserve.cachectl.errors import ContentMismatchError

    try:
        entry = _ensure_from_loaded(store, model_plan, model, metadata)
    except ContentMismatchError as e:
        log.warning("runtime cache: %s", e)
        return model, HostWeightPlan.ordinary(f"runtime cache entry not joined: {e}")
    if entry.built:
        store.stamp(entry.key)  # later (read-only) joins skip the full re-hash
    files = map_entry(entry)
    checked = preflight(expected_tensors(model), files)
    if not checked.ok:
        close_all(files)
        entry.close()
        return model, HostWeightPlan.ordinary(
            f"runtime cache entry {entry.key[:12]} does not match the loaded DiT: "
            f"{checked.reason}")
    views = source_views(checked.bindings, files)
    repoint(model, views)
    release_private_memory()
    how = "built" if entry.built else "joined (content digest matched)"
    if entry.recipe_recorded is False:
        note += "; recipe not recorded (read-only cache root), the next start loads again"
    return model, HostWeightPlan(
        BackingKind.RUNTIME_CACHE,
        reason=f"entry {entry.key[:12]} {how} after an ordinary load{note}; private copy released",
        bindings=checked.bindings, sources=views, mappings=files, coverage=checked.coverage,
        lease=entry,
    )
