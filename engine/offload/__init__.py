"""Layerwise offload (DLO): stream a DiT's blocks from host memory through two device slots.

Modules, one concept each: ``plan`` (pure layouts and residency), ``discovery`` (which
modules are blocks), ``host`` (slabs), ``transfer`` (moves bytes; the only CUDA-specific
code), ``hooks`` (per-block state machine), ``backend`` (enable/disable, all or nothing).

Host backings (the loader -> offload contract): ``host_plan`` (HostWeightPlan),
``host_weights`` (which backing, and why), ``mmap_source`` (read-only safetensors mappings,
preflight), ``runtime_cache`` (node cache backing), ``mapped_storage`` (sources as mapping
views), and the two other modules that call CUDA: ``registration`` (cudaHostRegister of
mapped ranges) and ``staging`` (the mapped transfer: registered or staged loads).
"""

from ditserve.engine.offload.backend import (
    DEFAULT_ACTIVATION_RESERVE_BYTES,
    OffloadHandle,
    enable_offload,
)

__all__ = ["DEFAULT_ACTIVATION_RESERVE_BYTES", "OffloadHandle", "enable_offload"]
