"""The DiffusionDeployment spec as typed, frozen values, and its mapping onto the engine config.

Owns reading a CR's ``spec`` (plain data, defaulted or not) into ``DeploymentSpec`` with the
same defaults the CRD declares (a test keeps the two equal), the few cross-field rules the
operator needs to render at all, and ``engine_config``: the CRD -> ``EngineConfig`` mapping,
judged by the engine's own validation rules. Called by ``render`` and ``status``; pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ditserve.engine.config import COMPILE_BACKENDS, EngineConfig
from ditserve.engine.errors import ConfigError
from ditserve.operator.errors import InvalidSpecError

# Where the model volume is mounted in engine pods; the engine config's `model` points here.
MODEL_MOUNT_PATH = "/models/model"
FAMILIES = ("Auto", "Flux", "SD3", "QwenImage", "Wan")
DTYPES = ("bfloat16", "float16", "float32")
CACHE_MODES = ("NodeLocal", "None")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
# Set by the operator on every engine pod; a user value would silently break the rendezvous,
# the cache or the auth, so engine.env may not name them.
OPERATOR_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "DITSERVE_CACHE_ROOT",
                "DITSERVE_API_KEY", "HF_HUB_OFFLINE")


@dataclass(frozen=True)
class ModelSpec:
    """A local diffusers directory: on the node (host_path) or in a PVC (claim_name + sub_path)."""

    host_path: str | None = None
    claim_name: str | None = None
    sub_path: str = ""
    family: str = "Auto"
    dtype: str = "bfloat16"
    size_gib: float | None = None


@dataclass(frozen=True)
class ParallelismSpec:
    data: int = 1
    sequence: int = 1

    @property
    def gpus_per_pod(self) -> int:
        """One engine process per GPU; the pod runs the whole dp x sp group."""
        return self.data * self.sequence


@dataclass(frozen=True)
class OffloadSpec:
    enabled: bool = False
    use_all_gather: bool = True
    slots: int | None = None  # None: the engine's default for the mode
    resident_layers: int = 0
    runtime_cache: bool = False
    pin_limit_gib: float = 0.0


@dataclass(frozen=True)
class CompileSpec:
    enabled: bool = False
    backend: str = "inductor"


@dataclass(frozen=True)
class BatchingSpec:
    max_num_seqs: int = 4
    max_queue: int = 64


@dataclass(frozen=True)
class EngineSpec:
    image: str | None = None
    image_pull_policy: str = "IfNotPresent"
    cpu: str = "4"
    memory: str = "16Gi"
    shm_size: str = "8Gi"
    port: int = 8000
    args: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()
    api_key_secret: tuple[str, str] | None = None  # (secret name, key)


@dataclass(frozen=True)
class CacheSpec:
    mode: str = "NodeLocal"
    root: str = "/var/cache/ditserve"
    claim_name: str | None = None

    @property
    def enabled(self) -> bool:
        return self.mode == "NodeLocal"


@dataclass(frozen=True)
class SchedulingSpec:
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] | None = None
    priority_class_name: str | None = None
    runtime_class_name: str | None = None


@dataclass(frozen=True)
class RolloutSpec:
    max_unavailable: int | str = 1
    max_surge: int | str = 0  # GPUs are scarce: never schedule an extra pod during a rollout


@dataclass(frozen=True)
class DeploymentSpec:
    """A whole DiffusionDeployment spec with every default filled in."""

    model: ModelSpec
    replicas: int = 1
    parallelism: ParallelismSpec = field(default_factory=ParallelismSpec)
    offload: OffloadSpec = field(default_factory=OffloadSpec)
    batching: BatchingSpec = field(default_factory=BatchingSpec)
    compile: CompileSpec = field(default_factory=CompileSpec)
    engine: EngineSpec = field(default_factory=EngineSpec)
    cache: CacheSpec = field(default_factory=CacheSpec)
    startup_timeout_s: int | None = None
    scheduling: SchedulingSpec = field(default_factory=SchedulingSpec)
    rollout: RolloutSpec = field(default_factory=RolloutSpec)


class _Reader:
    """Typed access to one mapping of the spec; collects problems instead of raising early."""

    def __init__(self, data: Any, path: str, problems: list[str]) -> None:
        self.path, self.problems = path, problems
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            problems.append(f"{path} must be an object, got {type(data).__name__}")
            data = {}
        self.data: Mapping[str, Any] = data

    def _get(self, key: str, types: tuple[type, ...], default: Any, what: str) -> Any:
        value = self.data.get(key)
        if value is None:
            return default
        # bool is an int subclass; never accept it where a number is expected.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            self.problems.append(f"{self.path}.{key} must be {what}, got {value!r}")
            return default
        return value

    def text(self, key: str, default: str | None = None, choices: tuple[str, ...] = ()) -> Any:
        value = self._get(key, (str,), default, "a string")
        if choices and value is not None and value not in choices:
            self.problems.append(f"{self.path}.{key} must be one of {', '.join(choices)}, got {value!r}")
            return default
        return value

    def integer(self, key: str, default: int | None, minimum: int = 0) -> Any:
        value = self._get(key, (int,), default, f"an integer >= {minimum}")
        if value is not None and value < minimum:
            self.problems.append(f"{self.path}.{key} must be an integer >= {minimum}, got {value}")
            return default
        return value

    def number(self, key: str, default: float | None) -> Any:
        value = self._get(key, (int, float), default, "a number >= 0")
        if value is not None and value < 0:
            self.problems.append(f"{self.path}.{key} must be a number >= 0, got {value}")
            return default
        return None if value is None else float(value)

    def flag(self, key: str, default: bool) -> bool:
        return bool(self._get(key, (bool,), default, "true or false"))

    def int_or_str(self, key: str, default: int | str) -> Any:
        value = self._get(key, (int, str), default, "an integer or a string")
        return str(value) if isinstance(value, int) and isinstance(default, str) else value

    def items(self, key: str) -> tuple[Any, ...]:
        return tuple(self._get(key, (list, tuple), (), "a list") or ())

    def child(self, key: str) -> _Reader:
        return _Reader(self.data.get(key), f"{self.path}.{key}", self.problems)


def parse_spec(data: Mapping[str, Any] | None) -> DeploymentSpec:
    """Read a CR spec; raise InvalidSpecError listing every problem found."""
    problems: list[str] = []
    root = _Reader(data, "spec", problems)
    if root.data.get("model") is None:
        problems.append("spec.model is required: set model.hostPath or model.persistentVolumeClaim")
    m = root.child("model")
    pvc = m.child("persistentVolumeClaim")
    model = ModelSpec(
        host_path=m.text("hostPath"),
        claim_name=pvc.text("claimName"),
        sub_path=pvc.text("subPath", "") or "",
        family=m.text("family", "Auto", FAMILIES),
        dtype=m.text("dtype", "bfloat16", DTYPES),
        size_gib=m.number("sizeGiB", None),
    )
    p = root.child("parallelism")
    o = root.child("offload")
    rc = o.child("runtimeCache")
    b = root.child("batching")
    co = root.child("compile")
    e = root.child("engine")
    res = e.child("resources")
    key_secret = e.child("apiKeySecret")
    c = root.child("cache")
    s = root.child("scheduling")
    r = root.child("rollout")
    spec = DeploymentSpec(
        model=model,
        replicas=root.integer("replicas", 1),
        parallelism=ParallelismSpec(data=p.integer("data", 1, 1), sequence=p.integer("sequence", 1, 1)),
        offload=OffloadSpec(
            enabled=o.flag("enabled", False),
            use_all_gather=o.flag("useAllGather", True),
            slots=o.integer("slots", None, 2),
            resident_layers=o.integer("residentLayers", 0),
            runtime_cache=rc.flag("enabled", False),
            pin_limit_gib=rc.number("pinLimitGiB", 0.0),
        ),
        batching=BatchingSpec(
            max_num_seqs=b.integer("maxNumSeqs", 4, 1), max_queue=b.integer("maxQueue", 64)
        ),
        compile=CompileSpec(
            enabled=co.flag("enabled", False),
            backend=co.text("backend", "inductor", COMPILE_BACKENDS),
        ),
        engine=EngineSpec(
            image=e.text("image") or None,
            image_pull_policy=e.text("imagePullPolicy", "IfNotPresent", PULL_POLICIES),
            cpu=res.int_or_str("cpu", "4"),
            memory=res.int_or_str("memory", "16Gi"),
            shm_size=e.int_or_str("shmSize", "8Gi"),
            port=e.integer("port", 8000, 1024),
            args=tuple(str(a) for a in e.items("args")),
            env=tuple(dict(v) for v in e.items("env") if isinstance(v, Mapping)),
            api_key_secret=(
                (key_secret.text("name"), key_secret.text("key", "api-key"))
                if key_secret.data.get("name")
                else None
            ),
        ),
        cache=CacheSpec(
            mode=c.text("mode", "NodeLocal", CACHE_MODES),
            root=c.text("root", "/var/cache/ditserve"),
            claim_name=c.child("persistentVolumeClaim").text("claimName"),
        ),
        startup_timeout_s=root.child("probes").integer("startupTimeoutSeconds", None, 30),
        scheduling=SchedulingSpec(
            node_selector=dict(s.data.get("nodeSelector") or {}),
            tolerations=tuple(dict(t) for t in s.items("tolerations") if isinstance(t, Mapping)),
            affinity=s.data.get("affinity") or None,
            priority_class_name=s.text("priorityClassName") or None,
            runtime_class_name=s.text("runtimeClassName") or None,
        ),
        rollout=RolloutSpec(
            max_unavailable=r.int_or_str("maxUnavailable", 1),
            max_surge=r.int_or_str("maxSurge", 0),
        ),
    )
    problems.extend(_cross_field_problems(spec))
    if problems:
        raise InvalidSpecError("invalid DiffusionDeployment spec:\n  - " + "\n  - ".join(problems))
    return spec


def _cross_field_problems(spec: DeploymentSpec) -> list[str]:
    """The CRD's CEL rules again: the operator cannot render without them (and an old CRD
    or a server without CEL may let such a spec through)."""
    out = []
    if (spec.model.host_path is None) == (spec.model.claim_name is None):
        out.append("set exactly one of model.hostPath or model.persistentVolumeClaim")
    elif spec.model.host_path is not None and not spec.model.host_path.startswith("/"):
        out.append(f"model.hostPath must be an absolute path, got {spec.model.host_path!r}")
    if ".." in spec.model.sub_path.split("/") or spec.model.sub_path.startswith("/"):
        out.append("model.persistentVolumeClaim.subPath must be relative and must not contain '..'")
    if spec.offload.enabled and spec.model.size_gib is None:
        out.append("offload.enabled needs model.sizeGiB (the operator sizes host memory from it)")
    if spec.offload.runtime_cache and not spec.cache.enabled:
        out.append("offload.runtimeCache.enabled needs cache.mode NodeLocal")
    if spec.cache.claim_name and not spec.cache.enabled:
        out.append("cache.persistentVolumeClaim only applies with cache.mode NodeLocal")
    if spec.parallelism.gpus_per_pod > 16:
        out.append("parallelism.data x parallelism.sequence (GPUs per pod) must be at most 16")
    clashing = sorted({str(e.get("name")) for e in spec.engine.env} & set(OPERATOR_ENV))
    if clashing:
        out.append(f"engine.env must not set {', '.join(clashing)}: the operator sets them "
                   "(use engine.apiKeySecret for the API key)")
    if str(spec.rollout.max_surge) in ("0", "0%") and str(spec.rollout.max_unavailable) in ("0", "0%"):
        out.append("rollout.maxSurge and rollout.maxUnavailable cannot both be 0")
    return out


def engine_config(spec: DeploymentSpec) -> EngineConfig:
    """The engine config a pod of this deployment runs, judged by the engine's own rules.

    The cache root is not part of it: pods get it from $DITSERVE_CACHE_ROOT.
    """
    mapping = {
        "model": MODEL_MOUNT_PATH,
        "dtype": spec.model.dtype,
        "device": "auto",
        "offload": {
            "enabled": spec.offload.enabled,
            "use_allgather": spec.offload.use_all_gather,
            "resident_layers": spec.offload.resident_layers,
            "runtime_cache": spec.offload.runtime_cache,
            "pin_limit_gib": spec.offload.pin_limit_gib,
        },
        "parallel": {
            "data_parallel_size": spec.parallelism.data,
            "sequence_parallel_size": spec.parallelism.sequence,
        },
        "scheduler": {
            "max_num_seqs": spec.batching.max_num_seqs,
            "max_queue": spec.batching.max_queue,
        },
        "compile": spec.compile.backend if spec.compile.enabled else None,
    }
    if spec.offload.slots is not None:  # unset: the engine picks per mode
        mapping["offload"]["slots"] = spec.offload.slots  # type: ignore[index]
    try:
        return EngineConfig.from_mapping(mapping)
    except ConfigError as e:
        raise InvalidSpecError(str(e)) from e


def validate(data: Mapping[str, Any] | None) -> tuple[DeploymentSpec, EngineConfig]:
    """Both checks at once: the spec's own shape, then the engine's option rules."""
    spec = parse_spec(data)
    return spec, engine_config(spec)
