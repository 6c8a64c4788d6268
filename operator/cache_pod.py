"""The node cache's part of an engine pod: its volume and the `cachectl ensure` init container.

Owns who may write the node cache from a tenant's pod: nobody, where the node's cachectl
daemon can do the work. The engine container mounts the cache read-only (``pod``); the init
container runs the admin's image (``AdminPolicy.helper_image``), never the tenant's
``engine.image``, and

- for a ``model.hostPath`` model (a directory the admin allows, which the DaemonSet mounts at
  the same path) it mounts the cache read-only too and asks the daemon over its Unix socket
  (``--daemon-only``: connecting to a socket needs no write access to the mount), so the
  entry is built by the daemon's own image and service account;
- for a PVC model, which the daemon cannot see, it builds or joins under the cache's lock
  itself (``--no-daemon``), read-write, still with the admin's image and never as root.

Every DiT of the model is ensured (``--component all``: Wan 2.2's ``transformer_2`` too), so
no engine falls back to private host memory for one of them. Called by ``pod``; pure.
"""

from __future__ import annotations

import copy
from typing import Any

from ditserve.engine.config import SEQUENCE_PARALLEL_IMPL
from ditserve.operator import sizing
from ditserve.operator.policy import DEFAULT_CACHE_ROOT
from ditserve.operator.spec import MODEL_MOUNT_PATH, DeploymentSpec

ENSURE_CONTAINER = "cachectl-ensure"
RESTRICTED_CONTAINER = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "readOnlyRootFilesystem": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def cache_root(spec: DeploymentSpec) -> str:
    """The node cache root the pods use (the policy fills the admin's root in)."""
    return spec.cache.root or DEFAULT_CACHE_ROOT


def model_mount(spec: DeploymentSpec) -> dict[str, Any]:
    mount: dict[str, Any] = {"name": "model", "mountPath": MODEL_MOUNT_PATH, "readOnly": True}
    if spec.model.claim_name and spec.model.sub_path:
        mount["subPath"] = spec.model.sub_path
    return mount


def cache_volume(spec: DeploymentSpec) -> dict[str, Any]:
    if spec.cache.claim_name:
        # A PVC bound to a local PV on the node's cache directory: allowed in namespaces
        # that enforce the restricted Pod Security level, where hostPath is not.
        return {"name": "cache", "persistentVolumeClaim": {"claimName": spec.cache.claim_name}}
    # Directory, not DirectoryOrCreate: the cachectl DaemonSet creates the root with the
    # right owner; until it has, the pod waits rather than getting a root-owned dir.
    return {"name": "cache", "hostPath": {"path": cache_root(spec), "type": "Directory"}}


def builds_in_pod(spec: DeploymentSpec) -> bool:
    """Whether the init container writes the cache itself (a model the daemon cannot see)."""
    return spec.model.host_path is None


def ensure_container(spec: DeploymentSpec, image: str) -> dict[str, Any]:
    """`cachectl ensure` of every DiT of the model, with the admin's ``image`` (module doc)."""
    memory = sizing.mebibytes(
        sizing.quantity_bytes(spec.engine.memory, what="engine.resources.memory")
        + sizing.dlo_host_bytes(spec)
    )
    root = cache_root(spec)
    mount = model_mount(spec)
    model_path = MODEL_MOUNT_PATH
    if spec.model.host_path is not None:
        # The daemon opens the model by the path it is given: mount it at its node path.
        model_path = mount["mountPath"] = spec.model.host_path
    command = ["cachectl", "ensure", "--model", model_path, "--dtype", spec.model.dtype,
               "--component", "all", "--root", root,
               "--timeout", str(sizing.ensure_timeout_s(spec))]
    if spec.parallelism.sequence > 1:
        # The engines' placement is part of the entry's identity: ensure the one they join.
        command += ["--sp-size", str(spec.parallelism.sequence), "--sp-impl",
                    SEQUENCE_PARALLEL_IMPL]
    command.append("--no-daemon" if builds_in_pod(spec) else "--daemon-only")
    cpu = str(spec.engine.cpu)
    # An init container's request never adds to the pod's: the pod reserves the max of the
    # init and the regular containers, so matching the engine costs nothing.
    resources: dict[str, Any] = {"requests": {"cpu": cpu, "memory": memory},
                                 "limits": {"memory": memory}}
    if spec.engine.guaranteed:
        resources["limits"]["cpu"] = cpu
    return {
        "name": ENSURE_CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": command,
        "env": [{"name": "DITSERVE_CACHE_ROOT", "value": root},
                {"name": "HF_HUB_OFFLINE", "value": "1"},
                {"name": "HOME", "value": "/tmp"}],
        "resources": resources,
        "volumeMounts": [mount,
                         {"name": "cache", "mountPath": root,
                          "readOnly": not builds_in_pod(spec)},
                         {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": copy.deepcopy(RESTRICTED_CONTAINER),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
