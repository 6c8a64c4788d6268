"""Layerwise offload (DLO): stream a DiT's blocks from host memory through two device slots.

Modules, one concept each: ``plan`` (pure layouts and residency), ``discovery`` (which
modules are blocks), ``host`` (slabs), ``transfer`` (moves bytes; the only CUDA-specific
code), ``hooks`` (per-block state machine), ``backend`` (enable/disable, all or nothing).
"""

from ditserve.engine.offload.backend import (
    DEFAULT_ACTIVATION_RESERVE_BYTES,
    OffloadHandle,
    enable_offload,
)

__all__ = ["DEFAULT_ACTIVATION_RESERVE_BYTES", "OffloadHandle", "enable_offload"]
