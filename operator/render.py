"""Desired children of a DiffusionDeployment: ConfigMap, Service, the workload (Deployment or
LeaderWorkerSet, see ``workloads``) and, with several replicas, a PodDisruptionBudget.

Owns ``render(spec, owner) -> [manifest]`` (pure: no API calls, no clock), ``adopt``, which
sets the ownerReferences that let Kubernetes garbage-collect the children with their owner,
and ``owned_by``, the test of whether an existing object is this owner's to change.
Called by ``children`` and by tests; the operator only applies what this returns.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from ditserve.operator import autoscaling, pod, scale_to_zero, workloads
from ditserve.operator.errors import InvalidSpecError
from ditserve.operator.judge import judge_engine, server_section
from ditserve.operator.policy import DEFAULT_IMAGE, AdminPolicy
from ditserve.operator.spec import DeploymentSpec

API_GROUP = "ditserve.io"
API_VERSION = f"{API_GROUP}/v1alpha1"
KIND = "DiffusionDeployment"
PLURAL = "diffusiondeployments"
ENGINE_APP = "ditserve-engine"
MANAGER = "ditserve-operator"
GENERATION_ANNOTATION = f"{API_GROUP}/generation"
CONFIG_HASH_ANNOTATION = f"{API_GROUP}/config-hash"
PDB_KIND = "PodDisruptionBudget"
__all__ = ["DEFAULT_IMAGE", "Owner", "adopt", "owned_by", "render"]


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


def child_names(owner_name: str, spec: DeploymentSpec) -> dict[str, str]:
    return {workloads.workload_kind(spec): workloads.workload_name(owner_name, spec),
            "Service": owner_name, "ConfigMap": f"{owner_name}-engine",
            PDB_KIND: owner_name, autoscaling.HPA_KIND: owner_name,
            scale_to_zero.SCALED_OBJECT_KIND: owner_name}


def endpoint_url(owner: Owner, spec: DeploymentSpec) -> str:
    return f"http://{owner.name}.{owner.namespace}.svc:{spec.engine.port}"


def engine_yaml(spec: DeploymentSpec) -> str:
    """The file every rank reads with `--config`: the engine config the spec judges to (its
    CRD fields and the engine options in engine.args) plus the ``server`` section."""
    config, _ = judge_engine(spec)
    data = config.to_mapping()
    data["server"] = server_section(spec)
    return yaml.safe_dump(data, sort_keys=True)


def disruption_budget(spec: DeploymentSpec, meta: dict[str, Any],
                      selector: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "policy/v1", "kind": PDB_KIND, "metadata": meta,
            "spec": {"maxUnavailable": spec.disruption.max_unavailable,
                     "selector": {"matchLabels": selector}}}


def render(spec: DeploymentSpec, owner: Owner, *,
           policy: AdminPolicy | None = None) -> list[dict[str, Any]]:
    """The children this spec wants, in apply order (the ConfigMap before the pods that mount
    it). Raises InvalidSpecError when the admin's policy or the engine refuses the spec: then
    nothing at all is rendered."""
    policy = policy or AdminPolicy()
    problems = policy.problems(spec)
    if problems:
        raise InvalidSpecError("invalid DiffusionDeployment spec:\n  - " + "\n  - ".join(problems))
    spec = policy.resolve(spec)
    names = child_names(owner.name, spec)
    config_text = engine_yaml(spec)
    _, server = judge_engine(spec)
    common = labels(owner.name, spec)
    selector = selector_labels(owner.name)
    kind = workloads.workload_kind(spec)

    def meta(kind: str) -> dict[str, Any]:
        return {"name": names[kind], "namespace": owner.namespace, "labels": dict(common),
                "annotations": {GENERATION_ANNOTATION: str(owner.generation)}}

    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta("ConfigMap"),
                  "data": {pod.CONFIG_FILE: config_text}}
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": meta("Service"),
        "spec": {
            "type": "ClusterIP",
            "selector": {**selector, **workloads.leader_selector(spec)},
            "ports": [{"name": "http", "port": spec.engine.port, "targetPort": "http",
                       "protocol": "TCP"}],
        },
    }
    template_meta = {
        # User labels first: parse_spec refused every key the operator sets.
        "labels": {**spec.engine.pod_labels, **common},
        # A changed engine config must roll the pods: a ConfigMap edit alone doesn't.
        "annotations": {**spec.engine.pod_annotations,
                        CONFIG_HASH_ANNOTATION: hashlib.sha256(config_text.encode()).hexdigest()[:16]},
    }
    ctx = pod.PodContext(image=spec.engine.image or policy.engine_image,
                         helper_image=policy.helper_image, config_map=names["ConfigMap"],
                         selector=selector, drain_s=server.shutdown_grace_s,
                         pull_secrets=policy.engine_pull_secrets(spec))
    if kind == workloads.LWS_KIND:
        workload = workloads.leader_worker_set(spec, meta=meta(kind), template_meta=template_meta,
                                               ctx=ctx)
    else:
        workload = workloads.deployment(spec, meta=meta(kind), template_meta=template_meta,
                                        selector=selector, ctx=ctx)
    out = [config_map, service, workload]
    if spec.wants_disruption_budget:
        out.append(disruption_budget(spec, meta(PDB_KIND), selector))
    target = {"apiVersion": API_VERSION, "kind": KIND, "name": owner.name}
    auto = spec.autoscaling
    if auto.uses_hpa:
        out.append(autoscaling.horizontal_pod_autoscaler(
            auto, meta=meta(autoscaling.HPA_KIND), target=target, service=names["Service"],
            shared_jobs=spec.jobs.shared))
    elif auto.uses_keda:
        out.append(scale_to_zero.scaled_object(
            auto.scale_to_zero, min_replicas=auto.min_replicas, max_replicas=auto.max_replicas,
            target_waiting_per_replica=auto.target_waiting_per_replica,
            scale_down_window_s=auto.scale_down_window_s,
            meta=meta(scale_to_zero.SCALED_OBJECT_KIND), target=target,
            namespace=owner.namespace, service=names["Service"], shared_jobs=spec.jobs.shared))
    return out


def adopt(manifests: list[dict[str, Any]], owner: Owner) -> list[dict[str, Any]]:
    """Copies of the manifests owned by ``owner`` (controller reference, blocks deletion)."""
    out = []
    for manifest in manifests:
        adopted = copy.deepcopy(manifest)
        adopted["metadata"]["namespace"] = owner.namespace
        adopted["metadata"]["ownerReferences"] = [owner_reference(owner)]
        out.append(adopted)
    return out


def owner_reference(owner: Owner) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": owner.name, "uid": owner.uid,
            "controller": True, "blockOwnerDeletion": True}


def owned_by(obj: Mapping[str, Any], owner: Owner) -> bool:
    """Whether ``obj`` is controlled by this very DiffusionDeployment (same uid): a same-named
    object of a deleted predecessor, or anybody else's, is not."""
    return any(ref.get("controller") and ref.get("uid") == owner.uid and ref.get("kind") == KIND
               for ref in (obj.get("metadata") or {}).get("ownerReferences") or [])
