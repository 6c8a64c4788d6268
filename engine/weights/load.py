"""One call from a model directory to loaded weights: ``load_weights``.

Under layerwise offload each DiT first gets its host backing (node cache entry, checkpoint
mmap or private memory: ``dit_backing``); then every component is built through the family's
diffusers classes (``loader.load_components``) with those DiTs passed in. What comes back is
the components and, under offload, the ``HostWeightPlan`` the offload layer takes exactly
once. Called by the model runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ditserve.engine.weights.loader import LoadedComponents, load_components

if TYPE_CHECKING:
    from ditserve.engine.config import OffloadConfig
    from ditserve.engine.offload.host.weight_plan import HostWeightPlan


@dataclass
class LoadedWeights:
    """A model's components and, under offload, its DiTs' host backing (None: resident)."""

    components: LoadedComponents
    host_plan: HostWeightPlan | None


def load_weights(
    model_dir: str | Path,
    *,
    dtype: str,
    offload: OffloadConfig,
    sp_size: int = 1,
    streams_from_mapping: bool = False,
    keep_private: str | None = None,
    sharded: bool = False,
    checkpoint: str | Path | None = None,
) -> LoadedWeights:
    """Load ``model_dir`` (see the module docstring; the options are ``prepare_dits``'s).

    keep_private: why the DiTs' tensors will be replaced after loading (quantization, a fused
    adapter): then they load into private memory whatever the backing options say.
    checkpoint: a DiT checkpoint file (``weights.dit_file``) served instead of the directory's
    DiT, in its stored form (GGUF blocks, FP8 bytes), resident or streamed: in private memory,
    or under offload with the runtime cache its node cache entry's mapping
    (``weights.checkpoint_cache``)."""
    if checkpoint is not None:
        return _load_with_checkpoint(model_dir, checkpoint, dtype=dtype, offload=offload,
                                     sp_size=sp_size)
    if not offload.enabled:
        return LoadedWeights(load_components(model_dir, dtype=dtype), None)
    from ditserve.engine.weights.dit_backing import prepare_dits
    from ditserve.engine.weights.host_check import check_host_memory

    # Before anything is read: refuse a load that would not fit this host's memory (instead
    # of an OOM kill halfway through), and let ``auto`` pick the DiT backing that fits.
    fit = check_host_memory(model_dir, dtype=dtype, offload=offload,
                            streams_from_mapping=streams_from_mapping,
                            keep_private=keep_private, sharded=sharded)
    dits, host_plan = prepare_dits(model_dir, dtype=dtype, offload=offload, sp_size=sp_size,
                                   streams_from_mapping=streams_from_mapping,
                                   keep_private=keep_private, sharded=sharded, host_fit=fit)
    try:
        return LoadedWeights(load_components(model_dir, dtype=dtype, dits=dits), host_plan)
    except BaseException:
        host_plan.close()  # the mappings and any cache lease it holds
        raise


def _load_with_checkpoint(model_dir: str | Path, checkpoint: str | Path, *, dtype: str,
                          offload: OffloadConfig, sp_size: int) -> LoadedWeights:
    from ditserve.engine.errors import ModelLoadError
    from ditserve.engine.weights.loader import DIT_COMPONENT, dit_components

    if dit_components(model_dir) != (DIT_COMPONENT,):
        raise ModelLoadError(
            f"{str(model_dir)!r} has several DiTs ({', '.join(dit_components(model_dir))}); "
            "a checkpoint file replaces one: serve a model with one DiT")
    dit, plan = _checkpoint_dit(model_dir, checkpoint, dtype=dtype, offload=offload,
                                sp_size=sp_size)
    try:
        components = load_components(model_dir, dtype=dtype, dits={DIT_COMPONENT: dit})
    except BaseException:
        if plan is not None:
            plan.close()
        raise
    return LoadedWeights(components, plan)


def _checkpoint_dit(model_dir: str | Path, checkpoint: str | Path, *, dtype: str,
                    offload: OffloadConfig, sp_size: int) -> tuple[Any, HostWeightPlan | None]:
    """The checkpoint's DiT and, under offload, its host plan: the node cache entry's mapping
    with ``--dlo-runtime-cache`` (private memory, with the reason, when the cache cannot be
    used), else private memory."""
    import logging

    from ditserve.engine.weights.dit_file import load_dit_file

    if not offload.enabled:
        return load_dit_file(checkpoint, model_dir, dtype=dtype), None
    from ditserve.engine.offload.host.weight_plan import HostWeightPlan

    log = logging.getLogger(__name__)
    if offload.runtime_cache:
        from ditserve.cachectl.errors import CacheError
        from ditserve.engine.weights.checkpoint_cache import checkpoint_cache_dit

        try:
            dit, plan = checkpoint_cache_dit(checkpoint, model_dir, dtype=dtype,
                                             offload=offload, sp_size=sp_size)
        except (CacheError, OSError, ValueError) as e:
            plan = HostWeightPlan.ordinary(f"runtime cache unavailable: {e}")
            log.warning("DLO host backing: %s; using ordinary host memory", plan.reason)
        else:
            log.info("DLO host backing: %s (%s)", plan.kind, plan.reason)
            return dit, plan
    else:
        plan = HostWeightPlan.ordinary(
            f"checkpoint file {Path(checkpoint).name}: its tensors in private memory as stored")
    return load_dit_file(checkpoint, model_dir, dtype=dtype), plan
