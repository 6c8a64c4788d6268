"""Resource sizing of engine pods: GPUs, memory for the offload mode, probe and timeout budgets.

Owns the arithmetic that turns a ``DeploymentSpec`` into numbers (and Kubernetes quantities).
Called by ``render``; pure. The rules, in one place so the docs can quote them:

- GPUs per pod = data x sequence: one engine process per GPU, the whole group in one pod.
- Host memory for DLO (the transformer's blocks live in host memory):
    offload off                          -> 0 (weights go to the GPU; loading maps the files)
    AllGather active (group g = dp or sp) -> size x gpus / g  (each rank pins a 1/g shard)
    runtime cache, no AllGather           -> size x 1  (one read-only mapping per node, shared
                                             by every rank through the page cache)
    otherwise                             -> size x gpus (each rank pins a full copy)
    plus, under offload, model.encoderSizeGiB x gpus: each rank keeps the text encoders in
    pinned host memory (parked, or streamed layer by layer; the engine's HBM budget plan)
- memory request = limit = engine memory + DLO host memory + shmSize (a memory-backed
  emptyDir counts against the container's memory limit).
- startup budget = 300 s + 20 s/GiB; cache-ensure budget = 600 s + 30 s/GiB (a cold build
  reads the checkpoint, converts, writes and fsyncs it).
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

from ditserve.operator.errors import InvalidSpecError
from ditserve.operator.spec import DeploymentSpec

GIB = 1024**3
_SUFFIX = {
    "": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}
_QUANTITY = re.compile(r"^\+?(?P<num>[0-9]+(\.[0-9]*)?|\.[0-9]+)(?P<suffix>[KMGTPE]i|[kMGTPE])?$")
# Kubernetes' full quantity grammar (resource.Quantity): a signed number, then a binary suffix,
# a decimal exponent or a decimal SI suffix (n, u and m too: 500m CPU).
_ANY_QUANTITY = re.compile(r"^(?P<num>[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+))"
                           r"((?P<exp>[eE][+-]?[0-9]+)|(?P<suffix>[KMGTPE]i|[numkMGTPE]))?$")
_SMALL_SUFFIX = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3")}

STARTUP_BASE_S = 300
STARTUP_PER_GIB_S = 20
PULL_BASE_S = 1800  # a pipeline's VAE, encoders and configs besides the DiT, and slack
PULL_PER_GIB_S = 52  # 20 MiB/s
ENSURE_BASE_S = 600
ENSURE_PER_GIB_S = 30
PROBE_PERIOD_S = 10


def quantity_bytes(value: int | str, *, what: str) -> int:
    """Parse a Kubernetes memory quantity (``16Gi``, ``512M``, ``1073741824``) into bytes."""
    match = _QUANTITY.match(str(value).strip())
    if match is None:
        raise InvalidSpecError(f"{what} must be a memory quantity like 16Gi or 512Mi, got {value!r}")
    return math.ceil(Decimal(match["num"]) * _SUFFIX[match["suffix"] or ""])


def quantity_value(value: object) -> Decimal | None:
    """The value of any Kubernetes quantity (``56Gi`` and ``57344Mi`` alike, ``500m``, ``0.5``,
    ``1e3``), or None when ``value`` is not one. The API server stores a quantity in its own
    canonical form, not as written, so the operator compares quantities by this value."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    match = _ANY_QUANTITY.match(str(value).strip())
    if match is None:
        return None
    number = Decimal(match["num"])
    if match["exp"] is not None:
        return number.scaleb(int(match["exp"][1:]))
    suffix = match["suffix"] or ""
    return number * (_SMALL_SUFFIX[suffix] if suffix in _SMALL_SUFFIX else _SUFFIX[suffix])


def mebibytes(n_bytes: int | float) -> str:
    """A quantity in whole Mi, rounded up. The API server stores its canonical form instead
    (57344Mi as 56Gi): ``children.matches`` compares quantities by value."""
    return f"{math.ceil(n_bytes / 2**20)}Mi"


def gpus_per_pod(spec: DeploymentSpec) -> int:
    return spec.parallelism.gpus_per_pod


def dlo_host_bytes(spec: DeploymentSpec) -> int:
    """Host memory the chosen offload mode holds for the transformer's weights (see module doc)."""
    off = spec.offload
    if not off.enabled:
        return 0
    size = (spec.model.size_gib or 0.0) * GIB
    gpus = gpus_per_pod(spec)
    par = spec.parallelism
    group = par.data if par.data > 1 else par.sequence  # DLO shards over DP first, else SP
    # Text encoders: each rank parks or streams its own copy from pinned memory (never
    # sharded, never from the node cache; engine.placement.whole_pipeline).
    encoders = math.ceil(spec.model.encoder_size_gib * GIB * gpus)
    if off.use_all_gather and group > 1:
        return math.ceil(size * gpus / group) + encoders
    if off.runtime_cache:
        return math.ceil(size) + encoders
    return math.ceil(size * gpus) + encoders


def memory_bytes(spec: DeploymentSpec) -> int:
    """The pod's memory request and limit (they are equal)."""
    base = quantity_bytes(spec.engine.memory, what="engine.resources.memory")
    shm = quantity_bytes(spec.engine.shm_size, what="engine.shmSize")
    return base + dlo_host_bytes(spec) + shm


def startup_timeout_s(spec: DeploymentSpec) -> int:
    """How long the engine may take from start to a passing /health before it is restarted."""
    if spec.startup_timeout_s is not None:
        return spec.startup_timeout_s
    return STARTUP_BASE_S + math.ceil(STARTUP_PER_GIB_S * (spec.model.size_gib or 0.0))


def startup_failure_threshold(spec: DeploymentSpec) -> int:
    return max(1, math.ceil(startup_timeout_s(spec) / PROBE_PERIOD_S))


def ensure_timeout_s(spec: DeploymentSpec) -> int:
    """Budget of the init container's `cachectl ensure` (waiting for or doing a cold build)."""
    return ENSURE_BASE_S + math.ceil(ENSURE_PER_GIB_S * (spec.model.size_gib or 0.0))


def pull_timeout_s(spec: DeploymentSpec) -> int:
    """Budget of the init container's `cachectl pull` (the node's first download of a uri
    model; a resumed or joined pull takes less). Sized at a slow 20 MiB/s over the DiT and
    encoders, plus the rest of a pipeline's files."""
    gib = (spec.model.size_gib or 0.0) + spec.model.encoder_size_gib
    return PULL_BASE_S + math.ceil(PULL_PER_GIB_S * gib)


def progress_deadline_s(spec: DeploymentSpec) -> int:
    """The Deployment's progressDeadlineSeconds: a pod that is still pulling its model,
    building its cache or loading a large model is not a stalled rollout."""
    cache = ensure_timeout_s(spec) if spec.cache.enabled else 0
    cache += pull_timeout_s(spec) if spec.model.uri is not None else 0
    return cache + startup_timeout_s(spec) + 300
