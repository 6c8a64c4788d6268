"""Choosing the DiT's host backing for offload, with the reason: the loader's side of the plan.

``prepare_dit`` returns the DiT and its ``HostWeightPlan``, trying in order:

1. ``runtime_cache`` (``--dlo-runtime-cache``): the node cache entry (``runtime_cache``);
   if the cache cannot be used, ordinary memory with the error as the reason;
2. ``checkpoint_mmap`` (``--dlo-checkpoint-mmap auto``): preflight the checkpoint's
   safetensors against a meta-device DiT; if it passes, the DiT's tensors become read-only
   views of the checkpoint files and the ordinary load is skipped. On CUDA rank-local
   streaming without ``--dlo-pin-limit-gib``, the load's host plan (``host_fit``) decides:
   a checkpoint on tmpfs is mapped and registered under an automatic pin limit of its
   mapped bytes (a private copy would hold its pages twice), one on a disk is copied when
   the copy fits, else streamed from its mapping through staging;
3. ``ordinary``: the loader's usual private tensors; the plan says why (1) or (2) did not
   apply, and the reason is logged.

Called by ``ModelRunner`` when offload is enabled.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch import nn

from ditserve.engine.config import OffloadConfig
from ditserve.engine.errors import HostMemoryError
from ditserve.engine.offload.host.weight_plan import BackingKind, HostWeightPlan
from ditserve.engine.weights.checkpoint_mmap import MappedSafetensors, map_dit
from ditserve.engine.weights.host_fit import DitBacking, HostFit, gib, pin_limit_for

log = logging.getLogger(__name__)


def checkpoint_dit(
    model_dir: str | Path, *, dtype: str, model_cls: Any, component: str
) -> tuple[nn.Module | None, HostWeightPlan]:
    """The DiT as views of its checkpoint files, or (None, ordinary plan with the reason)."""
    folder = Path(model_dir) / component
    paths = sorted(folder.glob("*.safetensors"))
    if not paths:
        return None, HostWeightPlan.ordinary(
            f"checkpoint mmap refused: no .safetensors files in {component}/")
    files: list[MappedSafetensors] = []
    try:
        for p in paths:
            files.append(MappedSafetensors(p))
        from ditserve.engine.weights.loader import torch_dtype

        config = model_cls.load_config(str(model_dir), subfolder=component)
        model, checked, views = map_dit(model_cls, config, torch_dtype(dtype), files)
        if model is None:
            raise ValueError(checked.reason)
    except Exception as e:  # any failure: ordinary loading, with the reason
        for f in files:
            f.close()
        return None, HostWeightPlan.ordinary(f"checkpoint mmap refused: {e}")
    return model, HostWeightPlan(
        BackingKind.CHECKPOINT_MMAP,
        reason=f"checkpoint {component}/ mapped read-only ({len(files)} file(s))",
        bindings=checked.bindings, sources=views, mappings=files, coverage=checked.coverage,
        skipped_materialization=True,
    )


def prepare_dit(
    model_dir: str | Path,
    *,
    dtype: str,
    offload: OffloadConfig,
    sp_size: int = 1,
    streams_from_mapping: bool = False,
    component: str = "transformer",
    keep_private: str | None = None,
    host_fit: HostFit | None = None,
) -> tuple[nn.Module, HostWeightPlan]:
    """The DiT for offload and its HostWeightPlan (see module doc). Never fails over a
    backing: only the ordinary load's own errors propagate.

    streams_from_mapping: blocks would be copied to a CUDA device straight from the backing
    (rank-local transfer, not AllGather shards, which are always copied into pinned slabs).
    Then ``checkpoint_mmap="auto"`` maps the checkpoint when ``pin_limit_gib`` lets the
    mapping be registered, or when ``host_fit`` (the load's host plan) chose a mapping: on
    tmpfs, registered under an automatic pin limit (``HostWeightPlan.auto_pin_limit_bytes``);
    on a disk whose private copy does not fit, through staging slots (about half the speed of
    private pinned slabs, docs/benchmarks.md). Without a plan: a private copy.

    component: which of the model's DiTs (Wan 2.2 has two: ``transformer``, ``transformer_2``).
    keep_private: why the DiT's tensors will be replaced after loading (``--quantization``);
    then it is loaded ordinarily (the runtime cache is refused by the option rules).
    sp_size: the replica's sequence-parallel size, part of the node cache entry's identity.
    """
    from ditserve.engine.weights import loader

    model_cls = loader.dit_class(model_dir, component)

    loaded: list[nn.Module] = []

    def load() -> nn.Module:  # at most once, also when a backing fails after loading
        if not loaded:
            loaded.append(loader.load_dit(model_dir, dtype=dtype, component=component))
        return loaded[0]

    if offload.runtime_cache:
        from ditserve.cachectl.errors import CacheError

        try:
            model, plan = _runtime_cache(model_dir, dtype, offload, model_cls, load, component,
                                         sp_size)
        except (CacheError, OSError, ValueError) as e:
            plan = HostWeightPlan.ordinary(f"runtime cache unavailable: {e}")
            log.warning("DLO host backing: %s; using ordinary host memory", plan.reason)
            return load(), plan
        log.info("DLO host backing: %s (%s)", plan.kind, plan.reason)
        return model, plan
    if keep_private is not None:
        plan = HostWeightPlan.ordinary(f"checkpoint mmap skipped: {keep_private}")
        log.info("DLO host backing: ordinary (%s)", plan.reason)
        return load(), plan
    if offload.checkpoint_mmap == "off":
        return load(), HostWeightPlan.ordinary("checkpoint mmap off (--dlo-checkpoint-mmap off)")
    chosen = host_fit.dit if host_fit is not None else None
    if streams_from_mapping and offload.pin_limit_gib <= 0 and chosen in (
            None, DitBacking.PRIVATE):
        plan = HostWeightPlan.ordinary(
            f"checkpoint mmap auto: {host_fit.reason}" if host_fit is not None else
            "checkpoint mmap auto: skipped on CUDA without --dlo-pin-limit-gib (an unregistered "
            "mapping streams through staging slots, about 2x slower than private pinned memory)")
        log.info("DLO host backing: ordinary (%s)", plan.reason)
        return load(), plan
    mapped, plan = checkpoint_dit(model_dir, dtype=dtype, model_cls=model_cls,
                                  component=component)
    if mapped is None:
        _require_private_fits(host_fit, component, plan)
        log.info("DLO host backing: ordinary (%s)", plan.reason)
        return load(), plan
    if streams_from_mapping and offload.pin_limit_gib <= 0 and host_fit is not None:
        plan.reason += f" ({host_fit.reason})"
        if host_fit.auto_pin:
            plan.auto_pin_limit_bytes = pin_limit_for(plan.coverage.bound_bytes)
    log.info("DLO host backing: %s (%s)", plan.kind, plan.reason)
    return mapped, plan


def _require_private_fits(host_fit: HostFit | None, component: str,
                          refused: HostWeightPlan) -> None:
    """The plan counted on a mapping that the preflight refused: load privately only if a
    private copy fits too."""
    if host_fit is None or host_fit.private_fits:
        return
    raise HostMemoryError(
        f"host memory: the plan mapped {component}/ ({host_fit.reason}), but the mapping was "
        f"refused ({refused.reason}), and a private copy does not fit the "
        f"{gib(host_fit.memory.available)} available; fix the checkpoint (store it in the "
        "serving dtype, one DiT per folder) or free host memory")


def _runtime_cache(model_dir: str | Path, dtype: str, offload: OffloadConfig, model_cls: Any,
                   load: Any, component: str, sp_size: int
                   ) -> tuple[nn.Module, HostWeightPlan]:
    from ditserve.engine.weights.runtime_cache import runtime_cache_dit

    return runtime_cache_dit(model_dir, dtype=dtype, offload=offload, model_cls=model_cls,
                             load_dit=load, component=component,
                             sp_size=sp_size)
