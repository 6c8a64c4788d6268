"""Desired children of a DiffusionDeployment: ConfigMap, Service and Deployment manifests.

Owns ``render(spec, owner) -> [manifest]`` (pure: no API calls, no clock) and ``adopt``, which
sets the ownerReferences that let Kubernetes garbage-collect the children with their owner.
Called by the kopf handlers and by tests; the handlers only apply what this returns.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from ditserve.operator import pod, sizing
from ditserve.operator.spec import DeploymentSpec, engine_config

API_GROUP = "ditserve.io"
API_VERSION = f"{API_GROUP}/v1alpha1"
KIND = "DiffusionDeployment"
PLURAL = "diffusiondeployments"
ENGINE_APP = "ditserve-engine"
MANAGER = "ditserve-operator"
GENERATION_ANNOTATION = f"{API_GROUP}/generation"
CONFIG_HASH_ANNOTATION = f"{API_GROUP}/config-hash"
DEFAULT_IMAGE = "ghcr.io/ditserve/ditserve:0.1.0"


@dataclass(frozen=True)
class Owner:
    """The DiffusionDeployment the children belong to."""

    name: str
    namespace: str
    uid: str
    generation: int = 1

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Owner:
        meta = body.get("metadata", {})
        return cls(name=meta["name"], namespace=meta.get("namespace") or "default",
                   uid=meta.get("uid", ""), generation=int(meta.get("generation") or 1))


def selector_labels(owner_name: str) -> dict[str, str]:
    """Labels that select one deployment's engine pods (immutable in a Deployment)."""
    return {"app.kubernetes.io/name": ENGINE_APP, "app.kubernetes.io/instance": owner_name}


def labels(owner_name: str, spec: DeploymentSpec) -> dict[str, str]:
    return {
        **selector_labels(owner_name),
        "app.kubernetes.io/component": "engine",
        "app.kubernetes.io/part-of": "ditserve",
        "app.kubernetes.io/managed-by": MANAGER,
        f"{API_GROUP}/model-family": spec.model.family,
    }


def selector_string(owner_name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(owner_name).items())


def child_names(owner_name: str) -> dict[str, str]:
    return {"Deployment": owner_name, "Service": owner_name, "ConfigMap": f"{owner_name}-engine"}


def endpoint_url(owner: Owner, spec: DeploymentSpec) -> str:
    return f"http://{owner.name}.{owner.namespace}.svc:{spec.engine.port}"


def engine_yaml(spec: DeploymentSpec) -> str:
    """The file `ditserve serve --config` reads: EngineConfig.to_mapping() plus `server`."""
    data = engine_config(spec).to_mapping()
    data["server"] = {"host": "0.0.0.0", "port": spec.engine.port}
    return yaml.safe_dump(data, sort_keys=True)


def render(spec: DeploymentSpec, owner: Owner, *, image: str = DEFAULT_IMAGE) -> list[dict[str, Any]]:
    """The children this spec wants, in apply order (the ConfigMap before the pods that mount
    it). Raises InvalidSpecError when the engine would reject the configuration."""
    names = child_names(owner.name)
    config_text = engine_yaml(spec)
    config_hash = hashlib.sha256(config_text.encode()).hexdigest()[:16]
    common = labels(owner.name, spec)

    def meta(kind: str) -> dict[str, Any]:
        return {"name": names[kind], "namespace": owner.namespace, "labels": dict(common),
                "annotations": {GENERATION_ANNOTATION: str(owner.generation)}}

    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta("ConfigMap"),
                  "data": {pod.CONFIG_FILE: config_text}}
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": meta("Service"),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(owner.name),
            "ports": [{"name": "http", "port": spec.engine.port, "targetPort": "http",
                       "protocol": "TCP"}],
        },
    }
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta("Deployment"),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector_labels(owner.name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {
                "maxSurge": spec.rollout.max_surge,
                "maxUnavailable": spec.rollout.max_unavailable}},
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": sizing.progress_deadline_s(spec),
            "template": {
                "metadata": {
                    "labels": dict(common),
                    # A changed engine config must roll the pods: a ConfigMap edit alone doesn't.
                    "annotations": {CONFIG_HASH_ANNOTATION: config_hash},
                },
                "spec": pod.pod_spec(spec, image=spec.engine.image or image,
                                     config_map=names["ConfigMap"]),
            },
        },
    }
    return [config_map, service, deployment]


def adopt(manifests: list[dict[str, Any]], owner: Owner) -> list[dict[str, Any]]:
    """Copies of the manifests owned by ``owner`` (controller reference, blocks deletion)."""
    ref = {"apiVersion": API_VERSION, "kind": KIND, "name": owner.name, "uid": owner.uid,
           "controller": True, "blockOwnerDeletion": True}
    out = []
    for manifest in manifests:
        adopted = copy.deepcopy(manifest)
        adopted["metadata"]["namespace"] = owner.namespace
        adopted["metadata"]["ownerReferences"] = [ref]
        out.append(adopted)
    return out
