"""The engine pod template: containers, volumes, probes, env, security and scheduling.

Owns what one engine pod looks like for a ``DeploymentSpec``. Called by ``render`` only; pure.
The pod runs the whole dp x sp group (the engine starts one worker per GPU itself), so the
rendezvous is local: MASTER_ADDR=127.0.0.1 and WORLD_SIZE = GPUs of the pod.
"""

from __future__ import annotations

import copy
from typing import Any

from ditserve.operator import sizing
from ditserve.operator.spec import MODEL_MOUNT_PATH, DeploymentSpec

CONFIG_DIR = "/etc/ditserve"
CONFIG_FILE = "engine.yaml"
MASTER_PORT = 29500
RUN_AS_UID = 1000  # the image's non-root user
GPU_RESOURCE = "nvidia.com/gpu"
ENGINE_CONTAINER = "engine"
ENSURE_CONTAINER = "cachectl-ensure"

_RESTRICTED_CONTAINER = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def uses_host_path(spec: DeploymentSpec) -> bool:
    """hostPath volumes keep a pod out of the baseline and restricted Pod Security levels."""
    return spec.model.host_path is not None or (spec.cache.enabled and not spec.cache.claim_name)


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
    return volumes


def _model_mount_for(spec: DeploymentSpec) -> dict[str, Any]:
    mount: dict[str, Any] = {"name": "model", "mountPath": MODEL_MOUNT_PATH, "readOnly": True}
    if spec.model.claim_name and spec.model.sub_path:
        mount["subPath"] = spec.model.sub_path
    return mount


def _env(spec: DeploymentSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "MASTER_ADDR", "value": "127.0.0.1"},
        {"name": "MASTER_PORT", "value": str(MASTER_PORT)},
        {"name": "WORLD_SIZE", "value": str(sizing.gpus_per_pod(spec))},
        # Weights come from the mounted volume only; never let a library reach for a hub.
        {"name": "HF_HUB_OFFLINE", "value": "1"},
    ]
    if spec.cache.enabled:
        env.append({"name": "DITSERVE_CACHE_ROOT", "value": spec.cache.root})
    if spec.engine.api_key_secret is not None:
        name, key = spec.engine.api_key_secret
        env.append({"name": "DITSERVE_API_KEY",
                    "valueFrom": {"secretKeyRef": {"name": name, "key": key}}})
    # User env last; parse_spec already refused names the operator sets (spec.OPERATOR_ENV).
    env.extend(dict(item) for item in spec.engine.env)
    return env


def _probe(path: str, *, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period,
            "timeoutSeconds": 5, "failureThreshold": failures}


def engine_container(spec: DeploymentSpec, image: str) -> dict[str, Any]:
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
    return {
        "name": ENGINE_CONTAINER,
        "image": image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["ditserve", "serve", "--config", f"{CONFIG_DIR}/{CONFIG_FILE}"],
        "args": list(spec.engine.args),
        "ports": [{"name": "http", "containerPort": spec.engine.port, "protocol": "TCP"}],
        "env": _env(spec),
        "resources": {
            # No CPU limit: throttling a data loader or the HTTP loop only adds latency.
            "requests": {"cpu": str(spec.engine.cpu), "memory": memory, GPU_RESOURCE: gpus},
            "limits": {"memory": memory, GPU_RESOURCE: gpus},
        },
        "volumeMounts": mounts,
        "startupProbe": _probe("/health", period=sizing.PROBE_PERIOD_S,
                               failures=sizing.startup_failure_threshold(spec)),
        "readinessProbe": _probe("/ready", period=5, failures=3),
        "livenessProbe": _probe("/health", period=10, failures=6),
        "securityContext": copy.deepcopy(_RESTRICTED_CONTAINER),
    }


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


def pod_spec(spec: DeploymentSpec, *, image: str, config_map: str) -> dict[str, Any]:
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
        "containers": [engine_container(spec, image)],
        "volumes": _volumes(spec, config_map),
    }
    if spec.cache.enabled:
        pod["initContainers"] = [ensure_container(spec, image)]
    if sched.node_selector:
        pod["nodeSelector"] = dict(sched.node_selector)
    if sched.tolerations:
        pod["tolerations"] = [dict(t) for t in sched.tolerations]
    if sched.affinity:
        pod["affinity"] = dict(sched.affinity)
    if sched.priority_class_name:
        pod["priorityClassName"] = sched.priority_class_name
    if sched.runtime_class_name:
        pod["runtimeClassName"] = sched.runtime_class_name
    return pod
