"""Layerwise offload (DLO): stream a DiT's blocks from host memory through device slots.

Layers, each importing only the ones below it (import-linter checks it, ``make lint``):

- ``backend`` (``enable_offload``) composed of ``builders``; ``handle`` (a live offload:
  report, probe, disable) and ``report`` (the typed report and the read-only probe);
- ``hooks``: the per-block state machine around each forward;
- ``movement``: how bytes reach a device slot (copy stream, staged and registered mapped
  loads, AllGather, copy-engine gather, copy clock) behind one ``Transfer`` protocol;
- ``host``: how weights sit in host memory (pinned slabs, pinned shards, mapping views,
  registration, the loader's ``HostWeightPlan`` and backing choice) behind one
  ``HostBacking`` protocol;
- ``plan``, ``shards`` (pure: no torch) and ``discovery``: which modules stream, and how
  each block lies in flat memory.
"""

from ditserve.engine.offload.backend import DEFAULT_ACTIVATION_RESERVE_BYTES, enable_offload
from ditserve.engine.offload.handle import OffloadHandle
from ditserve.engine.offload.report import OffloadProbe, OffloadReport

__all__ = [
    "DEFAULT_ACTIVATION_RESERVE_BYTES",
    "OffloadHandle",
    "OffloadProbe",
    "OffloadReport",
    "enable_offload",
]
