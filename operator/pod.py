"""The engine pod template: containers, volumes, probes, env, security and shutdown.

Owns what one engine pod looks like for a ``DeploymentSpec``, a ``PodContext`` (images, config,
drain) and a ``Role``; the cache's volume and init container are ``cache_pod``'s, the affinity
``placement``'s. Hardened: read-only root filesystem (``/tmp`` and ``/dev/shm`` are emptyDirs),
no token, non-root, no capabilities; the engine's fatal start error is its termination message;
a preStop wait, then the drain, fit in ``terminationGracePeriodSeconds``. Called by ``render``
and ``workloads``; pure. Two layouts:

- ``Role.SINGLE``: the replica's whole dp x sp group fits one node, so one pod runs it and the
  engine starts one worker per GPU itself: MASTER_ADDR=127.0.0.1, WORLD_SIZE = GPUs of the pod.
- ``Role.LEADER`` / ``Role.WORKER``: the group spans the pods of a LeaderWorkerSet group, one
  per node. The LWS controller injects LWS_LEADER_ADDRESS and LWS_WORKER_INDEX (ahead of the
  container's own env, so ``$(VAR)`` references resolve); the pod gets MASTER_ADDR = the
  leader's address, WORLD_SIZE = GPUs of the replica, LOCAL_WORLD_SIZE = GPUs of the pod and
  NODE_RANK = its index, and ``LAUNCHER`` starts one process per GPU with RANK = NODE_RANK x
  LOCAL_WORLD_SIZE + LOCAL_RANK: rank 0 (`ditserve serve`, the HTTP server) on the leader,
  `ditserve worker` for the others.
"""

from __future__ import annotations

import copy
import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ditserve.operator import cache_pod, placement, sizing
from ditserve.operator.cache_pod import ENSURE_CONTAINER, PULL_CONTAINER
from ditserve.operator.jobs import jobs_env, jobs_env_from, jobs_mounts, jobs_volumes
from ditserve.operator.loras import lora_args, lora_host_paths, lora_mounts, lora_volumes
from ditserve.operator.spec import RENDEZVOUS_PORT, DeploymentSpec

CONFIG_DIR = "/etc/ditserve"
CONFIG_FILE = "engine.yaml"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_FILE}"
MASTER_PORT = RENDEZVOUS_PORT
TERMINATION_LOG = "/dev/termination-log"
PRESTOP_S = 5
EXIT_MARGIN_S = 15
RUN_AS_UID = 1000  # the image's non-root user
GPU_RESOURCE = "nvidia.com/gpu"
ENGINE_CONTAINER = "engine"
__all__ = ["ENGINE_CONTAINER", "ENSURE_CONTAINER", "PULL_CONTAINER", "PodContext", "Role",
           "pod_spec"]

# One process per GPU of a multi-node pod; "$@" are engine.args (for rank 0's server only:
# every rank reads the engine options from the config file). The first rank to exit ends the
# pod with its status, and the LeaderWorkerSet restarts the whole group (its
# RecreateGroupOnPodRestart). Polled with kill -0 and `wait PID` (the shell keeps a reaped
# child's status for `wait PID`; bash's `wait -n` answers 127 once it has reaped them all).
LAUNCHER = f"""set -eu
base=$((NODE_RANK * LOCAL_WORLD_SIZE))
first=0
if [ "$NODE_RANK" -eq 0 ]; then first=1; fi
local_rank=$first
pids=""
while [ "$local_rank" -lt "$LOCAL_WORLD_SIZE" ]; do
  RANK=$((base + local_rank)) LOCAL_RANK=$local_rank ditserve worker --config {CONFIG_PATH} &
  pids="$pids $!"
  local_rank=$((local_rank + 1))
done
if [ "$NODE_RANK" -eq 0 ]; then
  RANK=0 LOCAL_RANK=0 exec ditserve serve --config {CONFIG_PATH} "$@"
fi
while :; do
  for pid in $pids; do
    if ! kill -0 "$pid" 2>/dev/null; then
      set +e; wait "$pid"; status=$?; set -e
      exit "$status"
    fi
  done
  sleep 1
done
"""


class Role(enum.Enum):
    SINGLE = "single"  # one pod holds the replica's whole group (a Deployment's pod)
    LEADER = "leader"  # rank 0's pod of a LeaderWorkerSet group: serves HTTP
    WORKER = "worker"  # the other pods of the group: ranks only


def uses_host_path(spec: DeploymentSpec) -> bool:
    """hostPath volumes keep a pod out of the baseline and restricted Pod Security levels."""
    return (spec.model.host_path is not None or (spec.cache.enabled and not spec.cache.claim_name)
            or lora_host_paths(spec.loras))


def _volumes(spec: DeploymentSpec, config_map: str, role: Role) -> list[dict[str, Any]]:
    model: dict[str, Any]
    if spec.model.uri is not None:
        # Holds only the symlink into the node cache that cachectl-pull leaves.
        model = {"name": "model", "emptyDir": {"sizeLimit": "1Mi"}}
    elif spec.model.host_path is not None:
        model = {"name": "model", "hostPath": {"path": spec.model.host_path, "type": "Directory"}}
    else:
        model = {"name": "model",
                 "persistentVolumeClaim": {"claimName": spec.model.claim_name, "readOnly": True}}
    volumes = [
        model,
        {"name": "config", "configMap": {"name": config_map}},
        # NCCL and the worker processes exchange tensors through /dev/shm; the runtime's
        # default 64 MiB is far too small. Memory-backed, so it counts against the limit.
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": str(spec.engine.shm_size)}},
        {"name": "tmp", "emptyDir": {}},
    ]
    if spec.cache.enabled:
        volumes.append(cache_pod.cache_volume(spec))
    jobs = jobs_volumes(spec.jobs) if role is not Role.WORKER else []  # rank 0 serves videos
    return volumes + lora_volumes(spec.loras) + jobs


def _rendezvous_env(spec: DeploymentSpec, role: Role) -> list[dict[str, Any]]:
    par = spec.parallelism
    if role is Role.SINGLE:
        return [{"name": "MASTER_ADDR", "value": "127.0.0.1"},
                {"name": "MASTER_PORT", "value": str(MASTER_PORT)},
                {"name": "WORLD_SIZE", "value": str(par.gpus_per_pod)}]
    return [{"name": "MASTER_ADDR", "value": "$(LWS_LEADER_ADDRESS)"},
            {"name": "MASTER_PORT", "value": str(MASTER_PORT)},
            {"name": "WORLD_SIZE", "value": str(par.gpus_per_replica)},
            {"name": "LOCAL_WORLD_SIZE", "value": str(par.gpus_per_pod)},
            {"name": "NODE_RANK", "value": "$(LWS_WORKER_INDEX)"}]


def _env(spec: DeploymentSpec, role: Role) -> list[dict[str, Any]]:
    env = _rendezvous_env(spec, role)
    # Weights come from the mounted volume only; never let a library reach for a hub.
    env.append({"name": "HF_HUB_OFFLINE", "value": "1"})
    # The root filesystem is read-only: caches under $HOME (torch, triton) go to /tmp, and a
    # fatal start error goes to the termination log, which the operator puts into status.
    env.append({"name": "HOME", "value": "/tmp"})
    env.append({"name": "DITSERVE_TERMINATION_LOG", "value": TERMINATION_LOG})
    if spec.cache.enabled:
        env.append({"name": "DITSERVE_CACHE_ROOT", "value": cache_pod.cache_root(spec)})
    if spec.engine.api_key_secret is not None and role is not Role.WORKER:
        name, key = spec.engine.api_key_secret
        env.append({"name": "DITSERVE_API_KEY",
                    "valueFrom": {"secretKeyRef": {"name": name, "key": key}}})
    if role is not Role.WORKER:  # rank 0 serves HTTP and runs the job layer
        env.extend(jobs_env(spec.jobs))
    # User env last; parse_spec already refused names the operator sets (spec.OPERATOR_ENV).
    env.extend(dict(item) for item in spec.engine.env)
    return env


def _probe(path: str, *, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period,
            "timeoutSeconds": 5, "failureThreshold": failures}


def _command(spec: DeploymentSpec, role: Role) -> dict[str, Any]:
    # No empty "args": the API server drops an empty list, and the live object would then
    # never match the rendered one (children.matches).
    args = [*spec.engine.args, *lora_args(spec.loras)]
    command = (["ditserve", "serve", "--config", CONFIG_PATH] if role is Role.SINGLE
               else ["sh", "-c", LAUNCHER, "ditserve-launcher"])
    return {"command": command, **({"args": args} if args else {})}


def engine_container(spec: DeploymentSpec, image: str, role: Role = Role.SINGLE) -> dict[str, Any]:
    gpus = str(sizing.gpus_per_pod(spec))
    memory = sizing.mebibytes(sizing.memory_bytes(spec))
    mounts = [
        cache_pod.model_mount(spec),
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "shm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if spec.cache.enabled:
        # Read-only: engines only map published entries; the daemon's Unix socket
        # ($ROOT/cachectl.sock) lives in the root and connecting to it needs no write access.
        mounts.append({"name": "cache", "mountPath": cache_pod.cache_root(spec),
                       "readOnly": True})
    mounts.extend(lora_mounts(spec.loras))  # every rank: requests name the adapters' paths
    if role is not Role.WORKER:
        mounts.extend(jobs_mounts(spec.jobs))  # the server writes and serves the MP4s
    limits = {"memory": memory, GPU_RESOURCE: gpus}
    if spec.engine.guaranteed:
        # Guaranteed QoS asks for it; otherwise no CPU limit: throttling a data loader or the
        # HTTP loop only adds latency.
        limits["cpu"] = str(spec.engine.cpu)
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        **_command(spec, role),
        "env": _env(spec, role),
        **({"envFrom": jobs_env_from(spec.jobs)}
           if role is not Role.WORKER and jobs_env_from(spec.jobs) else {}),
        "resources": {
            "requests": {"cpu": str(spec.engine.cpu), "memory": memory, GPU_RESOURCE: gpus},
            "limits": limits,
        },
        "volumeMounts": mounts,
        "securityContext": copy.deepcopy(cache_pod.RESTRICTED_CONTAINER),
        # The engine writes its fatal start error to the termination log; a crash that never
        # got that far leaves its last log lines there instead.
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # Endpoints and load balancers learn of a terminating pod a little late; keep serving
        # for that long before the drain (SIGTERM) starts.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_S)]}}},
    }
    if role is not Role.WORKER:  # workers serve no HTTP; rank 0's probes watch the group
        container["ports"] = [{"name": "http", "containerPort": spec.engine.port,
                               "protocol": "TCP"}]
        container["startupProbe"] = _probe("/health", period=sizing.PROBE_PERIOD_S,
                                           failures=sizing.startup_failure_threshold(spec))
        container["readinessProbe"] = _probe("/ready", period=5, failures=3)
        container["livenessProbe"] = _probe("/health", period=10, failures=6)
    return container


@dataclass(frozen=True)
class PodContext:
    """What an engine pod needs beyond the spec: images, the config, the drain and selector."""

    image: str  # the engine's (spec.engine.image, else the admin's engine image)
    helper_image: str  # the admin's image: runs the cache init container
    config_map: str
    selector: Mapping[str, str]  # the deployment's pods (replica spread)
    drain_s: float = 30.0  # the engine's --shutdown-grace
    pull_secrets: tuple[str, ...] = ()


def termination_grace_s(drain_s: float) -> int:
    """The pod's grace period: the preStop wait, the engine's drain, and time to exit."""
    return PRESTOP_S + math.ceil(drain_s) + EXIT_MARGIN_S


def pod_spec(spec: DeploymentSpec, ctx: PodContext, role: Role = Role.SINGLE) -> dict[str, Any]:
    sched = spec.scheduling
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,  # engines never talk to the API server
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": termination_grace_s(ctx.drain_s),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_UID,
            "runAsGroup": RUN_AS_UID,
            "fsGroup": RUN_AS_UID,  # makes PVC-backed cache and model volumes readable
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [engine_container(spec, ctx.image, role)],
        "volumes": _volumes(spec, ctx.config_map, role),
    }
    if spec.cache.enabled:
        pod["initContainers"] = [cache_pod.ensure_container(spec, ctx.helper_image)]
        if spec.model.uri is not None:
            pod["initContainers"].insert(0, cache_pod.pull_container(spec, ctx.helper_image))
    if spec.engine.service_account_name:
        pod["serviceAccountName"] = spec.engine.service_account_name
    if ctx.pull_secrets:
        pod["imagePullSecrets"] = [{"name": n} for n in ctx.pull_secrets]
    if sched.node_selector:
        pod["nodeSelector"] = dict(sched.node_selector)
    if sched.tolerations:
        pod["tolerations"] = [dict(t) for t in sched.tolerations]
    affinity = placement.affinity(spec, dict(ctx.selector))
    if affinity:
        pod["affinity"] = affinity
    if sched.priority_class_name:
        pod["priorityClassName"] = sched.priority_class_name
    if sched.runtime_class_name:
        pod["runtimeClassName"] = sched.runtime_class_name
    return pod
