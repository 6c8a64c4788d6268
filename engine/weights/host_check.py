"""The host-memory check before a model loads under offload: facts, plan, log, refuse.

``check_host_memory`` reads this host's facts (``host_facts``), plans the load's host bytes
(``host_fit.plan_host_fit``: the DiT's backing in ``auto`` mode included), logs the plan, and
raises ``HostMemoryError`` when it does not fit - naming the bytes needed, the bytes available
and the flags that would fit - instead of letting the kernel OOM-kill the engine halfway
through the load. ``DITSERVE_HOST_MEMORY_CHECK``: ``refuse`` (default), ``warn`` (log the
refusal and load anyway: an estimate can be wrong, e.g. with swap) or ``off``.

Called by ``weights.load.load_weights`` for a model directory under offload;
``require_room`` by ``placement.whole_pipeline`` right before it pins offloaded encoders.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ditserve.engine.config import OffloadConfig
from ditserve.engine.errors import ConfigError, HostMemoryError
from ditserve.engine.weights.host_facts import (
    component_files,
    read_host_memory,
    read_mountinfo,
)
from ditserve.engine.weights.host_fit import (
    GIB,
    ComponentFiles,
    HostFit,
    HostMemory,
    LoadOptions,
    gib,
    headroom_for,
    plan_host_fit,
)

log = logging.getLogger(__name__)
CHECK_ENV = "DITSERVE_HOST_MEMORY_CHECK"
CHECK_MODES = ("refuse", "warn", "off")
# Component folders DLO streams or parks as text encoders (``placement.prompt_cache``'s
# ENCODER_ATTRS are the pipeline attributes of the same names).
ENCODER_PREFIX = "text_encoder"


def check_mode() -> str:
    mode = os.environ.get(CHECK_ENV, "refuse").strip().lower() or "refuse"
    if mode not in CHECK_MODES:
        raise ConfigError(f"{CHECK_ENV} must be one of {', '.join(CHECK_MODES)}, got {mode!r}")
    return mode


def local_processes() -> int:
    """Engine processes on this host loading at once: a launcher's LOCAL_WORLD_SIZE, else
    WORLD_SIZE (the workers an engine spawns itself all run on its host), else 1."""
    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        try:
            return max(1, int(os.environ[name]))
        except (KeyError, ValueError):
            continue
    return 1


def model_files(model_dir: str | Path, *, dtype: str, mountinfo: str | None = None
                ) -> tuple[list[ComponentFiles], list[ComponentFiles], list[ComponentFiles]]:
    """(DiTs, text encoders, other weighted components) of a model directory."""
    from ditserve.engine.weights.loader import dit_components

    root = Path(model_dir)
    if mountinfo is None:
        mountinfo = read_mountinfo()
    dit_names = dit_components(root)
    dits, encoders, others = [], [], []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        files = component_files(folder, dtype=dtype, mountinfo=mountinfo)
        if files is None:
            continue
        if folder.name in dit_names:
            dits.append(files)
        elif folder.name.startswith(ENCODER_PREFIX):
            encoders.append(files)
        else:
            others.append(files)
    return dits, encoders, others


def plan_load(model_dir: str | Path, *, dtype: str, offload: OffloadConfig,
              streams_from_mapping: bool, keep_private: str | None, sharded: bool,
              memory: HostMemory | None = None, mountinfo: str | None = None) -> HostFit:
    """The load's host plan from this host's facts (``memory``, ``mountinfo``: fakes)."""
    dits, encoders, others = model_files(model_dir, dtype=dtype,
                                         mountinfo=read_mountinfo() if mountinfo is None
                                         else mountinfo)
    options = LoadOptions(
        mmap=offload.checkpoint_mmap, pin_limit_bytes=int(offload.pin_limit_gib * GIB),
        registers=streams_from_mapping, keep_private=keep_private,
        runtime_cache=offload.runtime_cache,
        encoders_offloaded=offload.enabled and offload.components == "all",
        processes=local_processes(), sharded=sharded,
        copies=sharded or offload.compress != "none")
    return plan_host_fit(dits, encoders, others, memory or read_host_memory(), options)


def check_host_memory(model_dir: str | Path, *, dtype: str, offload: OffloadConfig,
                      streams_from_mapping: bool, keep_private: str | None, sharded: bool,
                      memory: HostMemory | None = None, mountinfo: str | None = None,
                      ) -> HostFit | None:
    """The load's host plan (module docstring), logged; None with the check off. Raises
    ``HostMemoryError`` when it does not fit (unless the check only warns)."""
    mode = check_mode()
    if mode == "off":
        return None
    fit = plan_load(model_dir, dtype=dtype, offload=offload,
                    streams_from_mapping=streams_from_mapping, keep_private=keep_private,
                    sharded=sharded, memory=memory, mountinfo=mountinfo)
    log.info("%s", fit.table())
    if not fit.fits:
        if mode == "warn":
            log.warning("%s: %s", CHECK_ENV, fit.refusal())
        else:
            raise HostMemoryError(fit.refusal())
    return fit


def require_room(nbytes: int, *, what: str, remedies: tuple[str, ...] = (),
                 memory: HostMemory | None = None) -> None:
    """Refuse (``HostMemoryError``) to commit ``nbytes`` more host memory for ``what`` when
    the host (or its cgroup) has no room for them now: the check again, with fresh facts,
    right before a large pinned copy (text encoders after the DiT is in place)."""
    mode = check_mode()
    if mode == "off" or nbytes <= 0:
        return
    memory = memory or read_host_memory()
    headroom = headroom_for(nbytes)
    if nbytes + headroom <= memory.available:
        return
    fixes = ("; to lower it: " + "; or ".join(remedies)) if remedies else ""
    message = (f"host memory: {what} would commit {gib(nbytes)} + {gib(headroom)} headroom, "
               f"but {gib(memory.available)} is available ({memory.source()}); refusing to "
               f"start instead of being OOM-killed{fixes} ({CHECK_ENV}=warn loads anyway)")
    if mode == "warn":
        log.warning("%s: %s", CHECK_ENV, message)
        return
    raise HostMemoryError(message)
