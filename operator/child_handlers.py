"""Watches on a DiffusionDeployment's children, its pods and their mount failures.

Owns the reactions to everything the operator did not write itself:
- a child (ConfigMap, Service, Deployment or LeaderWorkerSet, PodDisruptionBudget, HPA)
  changed or was deleted: re-sync the owner's children, which puts back whatever someone
  edited or deleted (drift; the status's ``lastRepair`` and a DriftRepaired Event name it),
  then recompute the status;
- one of its pods changed, or a FailedMount event names one: recompute the owner's status.

Watches are narrowed on the server: children and pods by the operator's managed-by label
(``deployments.configure``), events to pods' FailedMount. Registered by importing ``handlers``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import kopf

from ditserve.operator import render
from ditserve.operator.deployments import LWS, MANAGED, kube_client, refresh
from ditserve.operator.errors import KubeApiError
from ditserve.operator.kube import resource_path

if TYPE_CHECKING:
    from ditserve.operator.deployments import Log

def _owner_name(body: Mapping[str, Any]) -> str | None:
    for ref in (body.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == render.KIND and ref.get("apiVersion", "").startswith(render.API_GROUP):
            return str(ref.get("name"))
    return None


async def _child_changed(body: Mapping[str, Any], type: str, namespace: str | None, memo: Any,
                         logger: Log) -> None:
    owner = _owner_name(body)
    if owner is None or namespace is None:
        return
    try:
        await refresh(memo, namespace, owner, resync=True, logger=logger)
    except KubeApiError as e:
        logger.warning(f"could not refresh the status of {namespace}/{owner}: {e}")


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
async def child_deployment_changed(body: kopf.Body, type: str, namespace: str | None, memo: Any,
                                   logger: Log, **_: Any) -> None:
    await _child_changed(body, type, namespace, memo, logger)


@kopf.on.event(*LWS, labels=MANAGED)
async def child_leader_worker_set_changed(body: kopf.Body, type: str, namespace: str | None,
                                          memo: Any, logger: Log, **_: Any) -> None:
    await _child_changed(body, type, namespace, memo, logger)


@kopf.on.event("", "v1", "configmaps", labels=MANAGED)
@kopf.on.event("", "v1", "services", labels=MANAGED)
@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=MANAGED)
@kopf.on.event("autoscaling", "v2", "horizontalpodautoscalers", labels=MANAGED)
async def child_changed(body: kopf.Body, type: str, namespace: str | None, memo: Any,
                        logger: Log, **_: Any) -> None:
    """A ConfigMap, Service, PodDisruptionBudget or HPA of an owner changed or was deleted."""
    await _child_changed(body, type, namespace, memo, logger)


async def _refresh_pod_owner(labels: Mapping[str, Any], namespace: str | None, memo: Any,
                             logger: Log) -> None:
    owner = labels.get("app.kubernetes.io/instance")
    if not owner or namespace is None or labels.get("app.kubernetes.io/managed-by") != render.MANAGER:
        return
    try:
        await refresh(memo, namespace, str(owner), resync=False, logger=logger)
    except KubeApiError as e:
        logger.warning(f"could not refresh the status of {namespace}/{owner}: {e}")


@kopf.on.event("v1", "pods", labels=MANAGED)
async def engine_pod_changed(body: kopf.Body, namespace: str | None, memo: Any, logger: Log,
                             **_: Any) -> None:
    await _refresh_pod_owner((body.get("metadata") or {}).get("labels") or {}, namespace, memo,
                             logger)


@kopf.on.event("v1", "events")
async def pod_mount_failed(body: kopf.Body, type: str, namespace: str | None, memo: Any,
                           logger: Log, **_: Any) -> None:
    """A FailedMount event (the watch's field selector sends no others): if it is about an
    engine pod, its owner turns Degraded now instead of at the rollout's progress deadline."""
    involved = body.get("involvedObject") or {}
    if type == "DELETED" or involved.get("kind") != "Pod" or not namespace:
        return
    try:
        pod = await kube_client(memo).get(resource_path("v1", "pods", namespace, involved.get("name")))
    except KubeApiError as e:
        logger.warning(f"could not read pod {namespace}/{involved.get('name')}: {e}")
        return
    if pod is not None:
        await _refresh_pod_owner((pod.get("metadata") or {}).get("labels") or {}, namespace,
                                 memo, logger)
