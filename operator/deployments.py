"""DiffusionDeployment handlers: thin glue from Kubernetes events to ``children`` and
``compute_status``.

Owns the operator's settings and its reactions:
- a DiffusionDeployment is created, updated or found on start (resume): judge the spec, sync
  the children (``children.sync_children``), write the status; an invalid spec, a conflict
  with an object the owner does not own, or a child the API server refuses become conditions
  (the last two are retried every RETRY_DELAY_S);
- its workload (Deployment or LeaderWorkerSet), one of its pods, or a FailedMount event about
  one of its pods changes: recompute the owner's status (and re-sync the children if the
  workload was deleted from under a live owner);
- a node's NodeCache changes: see ``node_handlers``.

Watches are narrowed on the server: workloads and pods by the operator's managed-by label,
events to pods' FailedMount. Deliberately absent: on.delete handlers, timers and daemons. Any
of them makes kopf put a finalizer on every object, and a finalizer hangs deletion whenever
the operator is not running; ownerReferences already let Kubernetes collect the children.
Registered by importing ``handlers`` (all of the operator's handlers).
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import kopf

from ditserve.operator import pod_health, render, workloads
from ditserve.operator.children import sync_children
from ditserve.operator.errors import InvalidSpecError, KubeApiError
from ditserve.operator.kube import KubeClient, resource_path
from ditserve.operator.spec import parse_spec
from ditserve.operator.status import ApplyFailure, compute_status, status_changed

DD = (render.API_GROUP, "v1alpha1", render.PLURAL)
LWS = ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")
MANAGED = {"app.kubernetes.io/managed-by": render.MANAGER}
MANAGED_SELECTOR = f"app.kubernetes.io/managed-by={render.MANAGER}"
MOUNT_EVENTS = "involvedObject.kind=Pod,reason=FailedMount"
IMAGE_ENV = "DITSERVE_ENGINE_IMAGE"  # set by the chart to the image the operator runs
RETRY_DELAY_S = 30
STATUS_ATTEMPTS = 5
if TYPE_CHECKING:  # LoggerAdapter is subscriptable at run time only from Python 3.11
    Log = logging.Logger | logging.LoggerAdapter[Any]


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _client(memo: Any) -> KubeClient:
    if memo.get("kube") is None:
        memo["kube"] = KubeClient()
    client: KubeClient = memo["kube"]
    return client


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    # One replica (the chart uses Recreate): no peering objects to create or to clean up.
    settings.peering.standalone = True
    # Namespaces are given on the command line or the operator is cluster-wide; scanning
    # them would only need another permission (list namespaces).
    settings.scanning.disabled = True
    # Watches that silently stop delivering events are a known kopf failure mode; bounded
    # server and client timeouts make every watch reconnect and re-list regularly.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = 60
    # Server-side selectors: the API server sends only the operator's own workloads and pods
    # (not every pod of the cluster), and only mount failures among the events.
    for resource in (("apps", "v1", "deployments"), ("v1", "pods"), LWS):
        settings.watching.label_selectors[resource] = MANAGED_SELECTOR
    settings.watching.field_selectors["v1", "events"] = MOUNT_EVENTS
    # Only warnings and errors become Kubernetes Events on the object.
    settings.posting.level = logging.WARNING
    # Annotations only: kopf's default also writes status.kopf, which the CRD does not declare
    # (the API server would prune it and kopf would lose its progress).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=render.API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=render.API_GROUP, key="last-handled-configuration")
    _client(memo)
    memo["image"] = os.environ.get(IMAGE_ENV) or render.DEFAULT_IMAGE
    # The last failure to apply each owner's children, for the status writers that did not
    # apply them (pod and workload handlers); keyed by (namespace, name).
    memo["apply_failures"] = {}


@kopf.on.login()
def login(memo: Any, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """kopf and the operator's own client share one set of credentials."""
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if info is not None:
        _client(memo).login(info)
    return info


@kopf.on.cleanup()
async def close_client(memo: Any, **_: Any) -> None:
    await _client(memo).close()


def _workload_path(body: Mapping[str, Any], namespace: str, name: str) -> str:
    try:
        spec = parse_spec(body.get("spec"))
    except InvalidSpecError:
        return resource_path("apps/v1", "deployments", namespace, name)
    if spec.parallelism.multi_node:
        return resource_path(workloads.LWS_API_VERSION, "leaderworkersets", namespace,
                             workloads.workload_name(name, spec))
    return resource_path("apps/v1", "deployments", namespace, name)


async def _observe(client: KubeClient, body: Mapping[str, Any], namespace: str, name: str,
                   ) -> tuple[dict[str, Any] | None, list[dict[str, Any]], list[dict[str, Any]]]:
    workload = await client.get(_workload_path(body, namespace, name))
    pods = await client.list(resource_path("v1", "pods", namespace),
                             label_selector=render.selector_string(name))
    events: list[dict[str, Any]] = []
    if any(pod_health.not_started(p) for p in pods):  # mounts fail only before a start
        events = await client.list(resource_path("v1", "events", namespace),
                                   field_selector=MOUNT_EVENTS)
    return workload, pods, events


def nodecaches_of(memo: Any) -> list[Mapping[str, Any]] | None:
    """The NodeCache objects ``node_handlers`` keeps, or None before it has seen any list."""
    cached = memo.get("nodecaches")
    return None if cached is None else list(cached.values())


async def _sync_status(client: KubeClient, memo: Any, namespace: str, name: str) -> None:
    """Recompute the owner's status from a fresh view and write it if it changed.

    Several handlers write the status concurrently (the owner's and its children's). Each
    reads the owner first and patches with that resourceVersion as a precondition, so a
    write computed from an older view than another writer's fails with 409 and is redone.
    """
    path = resource_path(render.API_VERSION, render.PLURAL, namespace, name)
    for _attempt in range(STATUS_ATTEMPTS):
        body = await client.get(path)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return  # the owner is gone or going; its children follow it
        workload, pods, events = await _observe(client, body, namespace, name)
        new = compute_status(body, workload, pods, now=_now(), events=events,
                             apply_failure=memo["apply_failures"].get((namespace, name)),
                             nodecaches=nodecaches_of(memo))
        if not status_changed(body.get("status"), new):
            return
        try:
            await client.patch_status(path, new,
                                      resource_version=body["metadata"].get("resourceVersion"))
            return
        except KubeApiError as e:
            if e.status != 409:
                raise
    raise KubeApiError(409, "Conflict", f"status of {namespace}/{name} kept changing; retrying")


async def _sync_children(memo: Any, body: Mapping[str, Any], namespace: str,
                         name: str) -> ApplyFailure | None:
    """Sync the children and remember the outcome for every status writer."""
    failure = await sync_children(_client(memo), body, memo.get("image", render.DEFAULT_IMAGE))
    if failure is None:
        memo["apply_failures"].pop((namespace, name), None)
    else:
        memo["apply_failures"][(namespace, name)] = failure
    return failure


@kopf.on.resume(*DD)
@kopf.on.create(*DD)
@kopf.on.update(*DD)
async def reconcile(body: kopf.Body, name: str, namespace: str | None, memo: Any, logger: Log,
                    **_: Any) -> None:
    namespace = namespace or "default"
    client = _client(memo)
    failure = None
    try:
        failure = await _sync_children(memo, body, namespace, name)
    except InvalidSpecError as e:
        # Not retried: the same spec fails the same way until the user edits it. The status
        # (written below) says InvalidSpec with this message.
        logger.warning(f"invalid spec, children left as they were: {e}")
    try:
        await _sync_status(client, memo, namespace, name)
    except KubeApiError as e:
        raise kopf.TemporaryError(f"writing the status failed: {e}", delay=RETRY_DELAY_S) from e
    if failure is not None:
        # Retried: the conflicting object may be removed, the quota raised, the API installed.
        raise kopf.TemporaryError(f"{failure.reason}: {failure.message}", delay=RETRY_DELAY_S)


async def refresh(memo: Any, namespace: str, name: str, *, child_deleted: bool,
                  logger: Log) -> None:
    """Recompute one owner's status (re-syncing its children if its workload was deleted)."""
    client = _client(memo)
    if child_deleted:
        body = await client.get(resource_path(render.API_VERSION, render.PLURAL, namespace, name))
        if body is not None and not (body.get("metadata") or {}).get("deletionTimestamp"):
            try:
                if await _sync_children(memo, body, namespace, name) is None:
                    logger.info(f"re-created the children of {namespace}/{name}")
            except InvalidSpecError:
                pass  # the status says InvalidSpec already
    await _sync_status(client, memo, namespace, name)


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
        await refresh(memo, namespace, owner, child_deleted=type == "DELETED", logger=logger)
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


async def _refresh_pod_owner(labels: Mapping[str, Any], namespace: str | None, memo: Any,
                             logger: Log) -> None:
    owner = labels.get("app.kubernetes.io/instance")
    if not owner or namespace is None or labels.get("app.kubernetes.io/managed-by") != render.MANAGER:
        return
    try:
        await refresh(memo, namespace, str(owner), child_deleted=False, logger=logger)
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
        pod = await _client(memo).get(resource_path("v1", "pods", namespace, involved.get("name")))
    except KubeApiError as e:
        logger.warning(f"could not read pod {namespace}/{involved.get('name')}: {e}")
        return
    if pod is not None:
        await _refresh_pod_owner((pod.get("metadata") or {}).get("labels") or {}, namespace,
                                 memo, logger)
