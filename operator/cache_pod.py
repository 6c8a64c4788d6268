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
no engine falls back to private host memory for one of them; with ``model.checkpoint`` the
file's DiT is (``--model FILE --base-model VOLUME``: GGUF and FP8 kept in their stored form).

A ``model.uri`` model (hf:// or s3://) is pulled first by a ``cachectl-pull`` init container:
``cachectl pull URI --daemon-only --link /models/model`` asks the node's daemon to download it
once per node into the node cache (this pod's cache mount stays read-only) and leaves, in the
pod's small ``model`` emptyDir, a symlink to the pulled entry's model folder; the ensure
container and the engine read ``/models/model`` through it (both mount the cache at the same
root). The Secret of ``model.credentialsSecret`` reaches only this container, whose request
carries the credentials to the daemon over the node-local socket. Called by ``pod``; pure.
"""

from __future__ import annotations

import copy
from typing import Any

from ditserve.engine.config import SEQUENCE_PARALLEL_IMPL
from ditserve.operator import sizing
from ditserve.operator.policy import DEFAULT_CACHE_ROOT
from ditserve.operator.spec import MODEL_MOUNT_PATH, DeploymentSpec

ENSURE_CONTAINER = "cachectl-ensure"
PULL_CONTAINER = "cachectl-pull"
MODEL_LINK_DIR = "/models"  # a uri model: the emptyDir holding the symlink MODEL_MOUNT_PATH
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
    if spec.model.uri is not None:  # the symlink into the node cache (see the module doc)
        return {"name": "model", "mountPath": MODEL_LINK_DIR, "readOnly": True}
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
    return spec.model.host_path is None and spec.model.uri is None


def _pull_env(spec: DeploymentSpec) -> list[dict[str, Any]]:
    m = spec.model
    env = [{"name": "DITSERVE_CACHE_ROOT", "value": cache_root(spec)},
           # The one container of the pod that may reach the source (through the daemon).
           {"name": "HF_HUB_OFFLINE", "value": "0"},
           {"name": "HOME", "value": "/tmp"}]
    if m.endpoint:
        name = "HF_ENDPOINT" if (m.uri or "").startswith("hf://") else "AWS_ENDPOINT_URL_S3"
        env.append({"name": name, "value": m.endpoint})
    if m.region:
        env.append({"name": "AWS_REGION", "value": m.region})
    return env


def pull_container(spec: DeploymentSpec, image: str) -> dict[str, Any]:
    """`cachectl pull` of ``model.uri`` through the node daemon (module doc)."""
    assert spec.model.uri is not None
    root = cache_root(spec)
    container: dict[str, Any] = {
        "name": PULL_CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["cachectl", "pull", spec.model.uri, "--daemon-only", "--root", root,
                    "--link", MODEL_MOUNT_PATH, "--timeout", str(sizing.pull_timeout_s(spec))],
        "env": _pull_env(spec),
        # It only waits on the daemon, which downloads: a small request is enough.
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"},
                      "limits": {"memory": "256Mi"}},
        "volumeMounts": [{"name": "model", "mountPath": MODEL_LINK_DIR},
                         {"name": "cache", "mountPath": root, "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": copy.deepcopy(RESTRICTED_CONTAINER),
        # Its last words ("cachectl: cannot pull ...: no repository ... (404)") become the
        # termination message the operator puts into ModelDownloadFailed.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if spec.model.credentials_secret:
        container["envFrom"] = [{"secretRef": {"name": spec.model.credentials_secret}}]
    return container


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
    model_args = ["--model", model_path]
    if spec.model.checkpoint is not None:
        # A DiT checkpoint file in the volume: its own entry, the volume as its base model.
        model_args = ["--model", f"{model_path}/{spec.model.checkpoint}",
                      "--base-model", model_path]
    command = ["cachectl", "ensure", *model_args, "--dtype", spec.model.dtype,
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
        # readOnly only when true: the API server drops a false one (children.matches).
        "volumeMounts": [mount,
                         {"name": "cache", "mountPath": root,
                          **({} if builds_in_pod(spec) else {"readOnly": True})},
                         {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": copy.deepcopy(RESTRICTED_CONTAINER),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
