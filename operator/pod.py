"""The engine pod template: containers, volumes, probes, env, security and scheduling.

Owns what one engine pod looks like for a ``DeploymentSpec`` and a ``Role``. Called by
``render`` and ``workloads``; pure. Two layouts:

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
from typing import Any

from ditserve.engine.config import SEQUENCE_PARALLEL_IMPL
from ditserve.operator import nodecache, sizing
from ditserve.operator.loras import lora_args, lora_host_paths, lora_mounts, lora_volumes
from ditserve.operator.spec import MODEL_MOUNT_PATH, DeploymentSpec

CONFIG_DIR = "/etc/ditserve"
CONFIG_FILE = "engine.yaml"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_FILE}"
MASTER_PORT = 29500
RUN_AS_UID = 1000  # the image's non-root user
GPU_RESOURCE = "nvidia.com/gpu"
ENGINE_CONTAINER = "engine"
ENSURE_CONTAINER = "cachectl-ensure"

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


_RESTRICTED_CONTAINER = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def uses_host_path(spec: DeploymentSpec) -> bool:
    """hostPath volumes keep a pod out of the baseline and restricted Pod Security levels."""
    return (spec.model.host_path is not None or (spec.cache.enabled and not spec.cache.claim_name)
            or lora_host_paths(spec.loras))


def _volumes(spec: DeploymentSpec, config_map: str) -> list[dict[str, Any]]:
    model: dict[str, Any]
    if spec.model.host_path is not None:
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
        if spec.cache.claim_name:
            # A PVC bound to a local PV on the node's cache directory: allowed in namespaces
            # that enforce the restricted Pod Security level, where hostPath is not.
            volumes.append({"name": "cache",
                            "persistentVolumeClaim": {"claimName": spec.cache.claim_name}})
        else:
            # Directory, not DirectoryOrCreate: the cachectl DaemonSet creates the root with the
            # right owner; until it has, the pod waits rather than getting a root-owned dir.
            volumes.append({"name": "cache",
                            "hostPath": {"path": spec.cache.root, "type": "Directory"}})
    return volumes + lora_volumes(spec.loras)


def _model_mount_for(spec: DeploymentSpec) -> dict[str, Any]:
    mount: dict[str, Any] = {"name": "model", "mountPath": MODEL_MOUNT_PATH, "readOnly": True}
    if spec.model.claim_name and spec.model.sub_path:
        mount["subPath"] = spec.model.sub_path
    return mount


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
    if spec.cache.enabled:
        env.append({"name": "DITSERVE_CACHE_ROOT", "value": spec.cache.root})
    if spec.engine.api_key_secret is not None and role is not Role.WORKER:
        name, key = spec.engine.api_key_secret
        env.append({"name": "DITSERVE_API_KEY",
                    "valueFrom": {"secretKeyRef": {"name": name, "key": key}}})
    # User env last; parse_spec already refused names the operator sets (spec.OPERATOR_ENV).
    env.extend(dict(item) for item in spec.engine.env)
    return env


def _probe(path: str, *, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period,
            "timeoutSeconds": 5, "failureThreshold": failures}


def _command(spec: DeploymentSpec, role: Role) -> dict[str, Any]:
    if role is Role.SINGLE:
        return {"command": ["ditserve", "serve", "--config", CONFIG_PATH],
                "args": [*spec.engine.args, *lora_args(spec.loras)]}
    return {"command": ["sh", "-c", LAUNCHER, "ditserve-launcher"],
            "args": [*spec.engine.args, *lora_args(spec.loras)]}


def engine_container(spec: DeploymentSpec, image: str, role: Role = Role.SINGLE) -> dict[str, Any]:
    gpus = str(sizing.gpus_per_pod(spec))
    memory = sizing.mebibytes(sizing.memory_bytes(spec))
    mounts = [
        _model_mount_for(spec),
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "shm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if spec.cache.enabled:
        # Read-only: engines only map published entries; the daemon's Unix socket
        # ($ROOT/cachectl.sock) lives in the root and connecting to it needs no write access.
        mounts.append({"name": "cache", "mountPath": spec.cache.root, "readOnly": True})
    mounts.extend(lora_mounts(spec.loras))  # every rank: requests name the adapters' paths
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        **_command(spec, role),
        "env": _env(spec, role),
        "resources": {
            # No CPU limit: throttling a data loader or the HTTP loop only adds latency.
            "requests": {"cpu": str(spec.engine.cpu), "memory": memory, GPU_RESOURCE: gpus},
            "limits": {"memory": memory, GPU_RESOURCE: gpus},
        },
        "volumeMounts": mounts,
        "securityContext": copy.deepcopy(_RESTRICTED_CONTAINER),
    }
    if role is not Role.WORKER:  # workers serve no HTTP; rank 0's probes watch the group
        container["ports"] = [{"name": "http", "containerPort": spec.engine.port,
                               "protocol": "TCP"}]
        container["startupProbe"] = _probe("/health", period=sizing.PROBE_PERIOD_S,
                                           failures=sizing.startup_failure_threshold(spec))
        container["readinessProbe"] = _probe("/ready", period=5, failures=3)
        container["livenessProbe"] = _probe("/health", period=10, failures=6)
    return container


def ensure_container(spec: DeploymentSpec, image: str) -> dict[str, Any]:
    """`cachectl ensure`: asks the node daemon for the model's cache entry (or builds it under
    the same lock itself) so the engine starts from a published, verified entry.

    The daemon opens the model by the path it is given, so a hostPath model is mounted here at
    its node path, which the DaemonSet also mounts (values `cachectl.modelHostPaths`). A PVC
    model is invisible to the daemon: that init container builds or joins under the lock itself.
    """
    memory = sizing.mebibytes(
        sizing.quantity_bytes(spec.engine.memory, what="engine.resources.memory")
        + sizing.dlo_host_bytes(spec)
    )
    model_mount = _model_mount_for(spec)
    command = ["cachectl", "ensure", "--model", MODEL_MOUNT_PATH, "--dtype", spec.model.dtype,
               "--root", spec.cache.root, "--timeout", str(sizing.ensure_timeout_s(spec))]
    if spec.parallelism.sequence > 1:
        # The engines' placement is part of the entry's identity: ensure the one they join.
        command += ["--sp-size", str(spec.parallelism.sequence), "--sp-impl",
                    SEQUENCE_PARALLEL_IMPL]
    if spec.model.host_path is not None:
        model_mount["mountPath"] = spec.model.host_path
        command[3] = spec.model.host_path
    else:
        command.append("--no-daemon")
    return {
        "name": ENSURE_CONTAINER,
        "image": image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": command,
        "env": [{"name": "DITSERVE_CACHE_ROOT", "value": spec.cache.root},
                {"name": "HF_HUB_OFFLINE", "value": "1"}],
        # An init container's request never adds to the pod's: the pod reserves the max of the
        # init and the regular containers, so matching the engine costs nothing.
        "resources": {"requests": {"cpu": str(spec.engine.cpu), "memory": memory},
                      "limits": {"memory": memory}},
        "volumeMounts": [model_mount,
                         {"name": "cache", "mountPath": spec.cache.root},
                         {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": copy.deepcopy(_RESTRICTED_CONTAINER),
    }


def _affinity(spec: DeploymentSpec) -> dict[str, Any] | None:
    """The user's affinity plus a preference for nodes that hold the model's Ready entry."""
    affinity = copy.deepcopy(dict(spec.scheduling.affinity or {}))
    if spec.scheduling.prefer_cached_nodes and spec.cache.enabled and spec.model.host_path:
        # A malformed user affinity is passed through untouched: the API server refuses it
        # with its own message, which the status reports.
        node = affinity.setdefault("nodeAffinity", {})
        preferred = node.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []) \
            if isinstance(node, dict) else None
        if isinstance(preferred, list):
            preferred.append(nodecache.preferred_cached_node_term(spec.model.host_path,
                                                                  spec.model.dtype))
    return affinity or None


def pod_spec(spec: DeploymentSpec, *, image: str, config_map: str,
             role: Role = Role.SINGLE) -> dict[str, Any]:
    sched = spec.scheduling
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,  # engines never talk to the API server
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 60,  # lets in-flight generations finish
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_UID,
            "runAsGroup": RUN_AS_UID,
            "fsGroup": RUN_AS_UID,  # makes PVC-backed cache and model volumes readable
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [engine_container(spec, image, role)],
        "volumes": _volumes(spec, config_map),
    }
    if spec.cache.enabled:
        pod["initContainers"] = [ensure_container(spec, image)]
    if spec.engine.service_account_name:
        pod["serviceAccountName"] = spec.engine.service_account_name
    if spec.engine.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": n} for n in spec.engine.image_pull_secrets]
    if sched.node_selector:
        pod["nodeSelector"] = dict(sched.node_selector)
    if sched.tolerations:
        pod["tolerations"] = [dict(t) for t in sched.tolerations]
    affinity = _affinity(spec)
    if affinity:
        pod["affinity"] = affinity
    if sched.priority_class_name:
        pod["priorityClassName"] = sched.priority_class_name
    if sched.runtime_class_name:
        pod["runtimeClassName"] = sched.runtime_class_name
    return pod
