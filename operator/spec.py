"""The DiffusionDeployment spec as typed, frozen values.

Owns reading a CR's ``spec`` (plain data, defaulted or not) into ``DeploymentSpec`` with the
same defaults the CRD declares (a test keeps the two equal), and the cross-field rules the
operator needs to render at all (the CRD's CEL rules again, for servers that skip them).
The engine's option rules are applied by ``judge``. Called by ``judge``, ``render`` and
``status``; pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ditserve.engine.config import (
    COMPILE_BACKENDS,
    HBM_BUDGET_AUTO,
    MODEL_FAMILIES,
    SCHEDULING_POLICIES,
)
from ditserve.operator.autoscaling import AutoscalingSpec, read_autoscaling
from ditserve.operator.errors import InvalidSpecError
from ditserve.operator.loras import LoraSource, parse_loras
from ditserve.operator.pod_metadata import pod_metadata_problems
from ditserve.operator.spec_reader import SpecReader

# Where the model volume is mounted in engine pods; the engine config's `model` points here.
MODEL_MOUNT_PATH = "/models/model"
# The engine's own list (one rule for the CRD enum, the operator and `ditserve serve`).
FAMILIES = MODEL_FAMILIES
DTYPES = ("bfloat16", "float16", "float32")
CACHE_MODES = ("NodeLocal", "None")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
SPREADS = ("Preferred", "Required", "None")
# Set by the operator on every engine pod; a user value would silently break the rendezvous,
# the cache or the auth, so engine.env may not name them.
OPERATOR_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                "LOCAL_WORLD_SIZE", "NODE_RANK", "DITSERVE_CACHE_ROOT", "DITSERVE_API_KEY",
                "HF_HUB_OFFLINE", "HOME", "DITSERVE_TERMINATION_LOG")
MAX_GPUS_PER_REPLICA = 256
RENDEZVOUS_PORT = 29500  # MASTER_PORT of every engine pod's process group


@dataclass(frozen=True)
class ModelSpec:
    """A local diffusers directory: on the node (host_path) or in a PVC (claim_name + sub_path)."""

    host_path: str | None = None
    claim_name: str | None = None
    sub_path: str = ""
    family: str = "Auto"
    dtype: str = "bfloat16"
    size_gib: float | None = None
    encoder_size_gib: float = 0.0  # text encoders' weights: pinned per rank under offload
    attention_heads: int | None = None  # the DiT's head count, if the user declares it
    checkpoint: str | None = None  # a DiT file in the volume, relative (the volume: its base)


@dataclass(frozen=True)
class ParallelismSpec:
    """One replica's process group: data x sequence ranks, one GPU each.

    A replica that needs more GPUs than one node has runs as several pods of ``gpus_per_node``
    GPUs (a LeaderWorkerSet group); otherwise it is one pod with all its GPUs.
    """

    data: int = 1
    sequence: int = 1
    gpus_per_node: int = 8

    @property
    def gpus_per_replica(self) -> int:
        return self.data * self.sequence

    @property
    def pods_per_replica(self) -> int:
        return max(1, -(-self.gpus_per_replica // self.gpus_per_node))

    @property
    def gpus_per_pod(self) -> int:
        return self.gpus_per_replica // self.pods_per_replica

    @property
    def multi_node(self) -> bool:
        return self.pods_per_replica > 1


@dataclass(frozen=True)
class OffloadSpec:
    enabled: bool = False
    use_all_gather: bool = True
    slots: int | None = None  # None: the engine's default for the mode
    resident_layers: int = 0
    runtime_cache: bool = False
    pin_limit_gib: float = 0.0
    hbm_budget_gib: float | str | None = None  # None: unset; "auto": the GPU's free HBM


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
    image_pull_secrets: tuple[str, ...] = ()
    service_account_name: str | None = None
    pod_labels: Mapping[str, str] = field(default_factory=dict)
    pod_annotations: Mapping[str, str] = field(default_factory=dict)
    cpu: str = "4"
    memory: str = "16Gi"
    guaranteed: bool = False  # CPU limit = request too: the pod gets the Guaranteed QoS class
    shm_size: str = "8Gi"
    port: int = 8000
    args: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()
    api_key_secret: tuple[str, str] | None = None  # (secret name, key)


@dataclass(frozen=True)
class CacheSpec:
    mode: str = "NodeLocal"
    root: str | None = None  # None: the admin's node cache root (``policy``)
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
    prefer_cached_nodes: bool = True
    require_cached_nodes: bool = False
    replica_spread: str = "Preferred"  # engine pods of one deployment on distinct nodes
    # The engine's request scheduling (--scheduling-policy, --priority-aging-s,
    # --max-preemptions): which requests run first, not where pods run.
    policy: str = "fcfs"
    aging_seconds: float = 30.0
    max_preemptions: int = 2


@dataclass(frozen=True)
class RolloutSpec:
    max_unavailable: int | str = 1
    max_surge: int | str = 0  # GPUs are scarce: never schedule an extra pod during a rollout


@dataclass(frozen=True)
class DisruptionSpec:
    """The PodDisruptionBudget of the engine pods; ``enabled`` None means "if replicas > 1"."""

    enabled: bool | None = None
    max_unavailable: int | str = 1


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
    disruption: DisruptionSpec = field(default_factory=DisruptionSpec)
    loras: tuple[LoraSource, ...] = ()  # LoRA adapters mounted read-only (operator.loras)
    autoscaling: AutoscalingSpec = field(default_factory=AutoscalingSpec)

    @property
    def wants_disruption_budget(self) -> bool:
        if self.disruption.enabled is None:
            return self.replicas > 1
        return self.disruption.enabled


def parse_spec(data: Mapping[str, Any] | None) -> DeploymentSpec:
    """Read a CR spec; raise InvalidSpecError listing every problem found."""
    problems: list[str] = []
    root = SpecReader(data, "spec", problems)
    if root.data.get("model") is None:
        problems.append("spec.model is required: set model.hostPath or model.persistentVolumeClaim")
    p, o, b, co = (root.child("parallelism"), root.child("offload"), root.child("batching"),
                   root.child("compile"))
    c, r, pdb = root.child("cache"), root.child("rollout"), root.child("podDisruptionBudget")
    rc = o.child("runtimeCache")
    spec = DeploymentSpec(
        model=_read_model(root.child("model")),
        replicas=root.integer("replicas", 1),
        parallelism=ParallelismSpec(data=p.integer("data", 1, 1),
                                    sequence=p.integer("sequence", 1, 1),
                                    gpus_per_node=p.integer("gpusPerNode", 8, 1)),
        offload=OffloadSpec(
            enabled=o.flag("enabled", False),
            use_all_gather=o.flag("useAllGather", True),
            slots=o.integer("slots", None, 2),
            resident_layers=o.integer("residentLayers", 0),
            hbm_budget_gib=o.number_or_word("hbmBudgetGiB", HBM_BUDGET_AUTO),
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
        engine=_read_engine(root.child("engine")),
        cache=CacheSpec(
            mode=c.text("mode", "NodeLocal", CACHE_MODES),
            root=c.text("root") or None,
            claim_name=c.child("persistentVolumeClaim").text("claimName"),
        ),
        startup_timeout_s=root.child("probes").integer("startupTimeoutSeconds", None, 30),
        scheduling=_read_scheduling(root.child("scheduling")),
        rollout=RolloutSpec(
            max_unavailable=r.int_or_str("maxUnavailable", 1),
            max_surge=r.int_or_str("maxSurge", 0),
        ),
        disruption=DisruptionSpec(enabled=pdb.optional_flag("enabled"),
                                  max_unavailable=pdb.int_or_str("maxUnavailable", 1)),
        loras=parse_loras(root),
        autoscaling=read_autoscaling(root.child("autoscaling")),
    )
    problems.extend(_cross_field_problems(spec))
    problems.extend(pod_metadata_problems(spec.engine.pod_labels, spec.engine.pod_annotations))
    if problems:
        raise InvalidSpecError("invalid DiffusionDeployment spec:\n  - " + "\n  - ".join(problems))
    return spec


def _read_model(m: SpecReader) -> ModelSpec:
    pvc = m.child("persistentVolumeClaim")
    return ModelSpec(
        host_path=m.text("hostPath"),
        claim_name=pvc.text("claimName"),
        sub_path=pvc.text("subPath", "") or "",
        family=m.text("family", "Auto", FAMILIES),
        dtype=m.text("dtype", "bfloat16", DTYPES),
        size_gib=m.number("sizeGiB", None), encoder_size_gib=m.number("encoderSizeGiB", 0.0),
        attention_heads=m.integer("attentionHeads", None, 1),
        checkpoint=m.text("checkpoint") or None,
    )


def _read_engine(e: SpecReader) -> EngineSpec:
    res, key_secret = e.child("resources"), e.child("apiKeySecret")
    return EngineSpec(
        image=e.text("image") or None,
        image_pull_policy=e.text("imagePullPolicy", "IfNotPresent", PULL_POLICIES),
        image_pull_secrets=e.names("imagePullSecrets"),
        service_account_name=e.text("serviceAccountName") or None,
        pod_labels=e.string_map("podLabels"),
        pod_annotations=e.string_map("podAnnotations"),
        cpu=res.int_or_str("cpu", "4"),
        memory=res.int_or_str("memory", "16Gi"),
        guaranteed=res.flag("guaranteedQoS", False),
        shm_size=e.int_or_str("shmSize", "8Gi"),
        port=e.integer("port", 8000, 1024),
        args=tuple(str(a) for a in e.items("args")),
        env=tuple(dict(v) for v in e.items("env") if isinstance(v, Mapping)),
        api_key_secret=(
            (key_secret.text("name"), key_secret.text("key", "api-key"))
            if key_secret.data.get("name")
            else None
        ),
    )


def _read_scheduling(s: SpecReader) -> SchedulingSpec:
    return SchedulingSpec(
        node_selector=s.string_map("nodeSelector"),
        tolerations=tuple(dict(t) for t in s.items("tolerations") if isinstance(t, Mapping)),
        affinity=s.data.get("affinity") or None,
        priority_class_name=s.text("priorityClassName") or None,
        runtime_class_name=s.text("runtimeClassName") or None,
        prefer_cached_nodes=s.flag("preferCachedNodes", True),
        require_cached_nodes=s.flag("requireCachedNodes", False),
        replica_spread=s.text("replicaSpread", "Preferred", SPREADS),
        policy=s.text("policy", "fcfs", SCHEDULING_POLICIES),
        aging_seconds=s.number("agingSeconds", 30.0),
        max_preemptions=s.integer("maxPreemptions", 2),
    )


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
    par = spec.parallelism
    if par.gpus_per_replica > MAX_GPUS_PER_REPLICA:
        out.append(f"parallelism.data x parallelism.sequence (GPUs per replica) must be at most "
                   f"{MAX_GPUS_PER_REPLICA}")
    if par.multi_node and par.gpus_per_replica % par.gpus_per_node:
        out.append(f"parallelism.data x parallelism.sequence = {par.gpus_per_replica} GPUs do not "
                   f"fill whole nodes of parallelism.gpusPerNode = {par.gpus_per_node}; a replica "
                   "spanning nodes needs a multiple of it (or set gpusPerNode to your nodes' count)")
    if par.multi_node and par.gpus_per_node % par.sequence:
        # DP rank d is processes d*sp .. d*sp+sp-1; pod k holds k*gpusPerNode onwards.
        out.append(f"parallelism.sequence = {par.sequence} must divide parallelism.gpusPerNode = "
                   f"{par.gpus_per_node} when a replica spans nodes: each SP group's all-to-alls "
                   "(two per attention) must stay inside one node")
    if spec.engine.port == RENDEZVOUS_PORT:
        out.append(f"engine.port {RENDEZVOUS_PORT} is the ranks' rendezvous port (MASTER_PORT): "
                   "pick another port for the HTTP server")
    if spec.scheduling.require_cached_nodes and not (spec.cache.enabled and spec.model.host_path):
        out.append("scheduling.requireCachedNodes needs cache.mode NodeLocal and model.hostPath "
                   "(nodes are labelled by the hostPath model's cache entries)")
    clashing = sorted({str(e.get("name")) for e in spec.engine.env} & set(OPERATOR_ENV))
    if clashing:
        out.append(f"engine.env must not set {', '.join(clashing)}: the operator sets them "
                   "(use engine.apiKeySecret for the API key)")
    if str(spec.rollout.max_surge) in ("0", "0%") and str(spec.rollout.max_unavailable) in ("0", "0%"):
        out.append("rollout.maxSurge and rollout.maxUnavailable cannot both be 0")
    return out
