"""DiffusionDeployment handlers: thin glue from Kubernetes events to ``children`` and
``compute_status``, and the operator's settings.

Owns the settings (watches, persistence, peering, Event posting, the admin's ``AdminPolicy``
read from the environment once) and the DiffusionDeployment's own reactions: created, updated
or found on start (resume): judge the spec, sync the children (``children.sync_children``),
write the status, post Events (``events``); an invalid spec, a conflict with an object the
owner does not own, or a child the API server refuses become conditions and Warning Events
(the last two are retried every RETRY_DELAY_S). ``refresh`` is what the child watches
(``child_handlers``) call: re-sync the children (repairing drift) and recompute the status.

Leader election: with ``$DITSERVE_OPERATOR_PEERING`` (the chart sets it) the operator joins
kopf's peering object of that name with a random priority; every replica but the one with the
highest priority pauses, so two replicas never reconcile at once. Without it the operator runs
standalone (one replica). Deliberately absent: on.delete handlers, timers and daemons. Any of
them makes kopf put a finalizer on every object, and a finalizer hangs deletion whenever the
operator is not running; ownerReferences already let Kubernetes collect the children.
Registered by importing ``handlers`` (all of the operator's handlers).
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import kopf

from ditserve.operator import events, pod_health, render, workloads
from ditserve.operator.children import SyncResult, sync_children
from ditserve.operator.errors import InvalidSpecError, KubeApiError
from ditserve.operator.kube import KubeClient, resource_path
from ditserve.operator.policy import AdminPolicy
from ditserve.operator.spec import parse_spec
from ditserve.operator.status import Repair, compute_status, status_changed

DD = (render.API_GROUP, "v1alpha1", render.PLURAL)
LWS = ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")
MANAGED = {"app.kubernetes.io/managed-by": render.MANAGER}
MANAGED_SELECTOR = f"app.kubernetes.io/managed-by={render.MANAGER}"
MOUNT_EVENTS = "involvedObject.kind=Pod,reason=FailedMount"
PEERING_ENV = "DITSERVE_OPERATOR_PEERING"  # kopf peering object's name; unset: standalone
# Children watched for drift besides the workload (which ``child_handlers`` also watches).
CHILD_RESOURCES = (("", "v1", "configmaps"), ("", "v1", "services"),
                   ("policy", "v1", "poddisruptionbudgets"),
                   ("autoscaling", "v2", "horizontalpodautoscalers"))
RETRY_DELAY_S = 30
STATUS_ATTEMPTS = 5
if TYPE_CHECKING:  # LoggerAdapter is subscriptable at run time only from Python 3.11
    Log = logging.Logger | logging.LoggerAdapter[Any]


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def kube_client(memo: Any) -> KubeClient:
    if memo.get("kube") is None:
        memo["kube"] = KubeClient()
    client: KubeClient = memo["kube"]
    return client


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    peering = os.environ.get(PEERING_ENV)
    if peering:
        # Leader election: the highest priority among live peers runs, the others pause.
        settings.peering.standalone = False
        settings.peering.mandatory = True
        settings.peering.name = peering
        settings.peering.priority = 1 + secrets.randbelow(2**30)
    else:
        settings.peering.standalone = True  # one replica: nothing to elect
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
    for resource in (("apps", "v1", "deployments"), ("v1", "pods"), LWS,
                     *(r[1:] if not r[0] else r for r in CHILD_RESOURCES)):
        settings.watching.label_selectors[resource] = MANAGED_SELECTOR
    settings.watching.field_selectors["v1", "events"] = MOUNT_EVENTS
    # Events are posted explicitly (``events``), Normal ones included; log lines are not.
    settings.posting.enabled = True
    settings.posting.loggers = False
    settings.posting.level = logging.INFO
    # Annotations only: kopf's default also writes status.kopf, which the CRD does not declare
    # (the API server would prune it and kopf would lose its progress).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=render.API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=render.API_GROUP, key="last-handled-configuration")
    kube_client(memo)
    memo["policy"] = AdminPolicy.from_env(os.environ)
    # The last failure to apply each owner's children, for the status writers that did not
    # apply them (pod and workload handlers), and the last drift repaired; by (namespace, name).
    memo["apply_failures"] = {}
    memo["repairs"] = {}


@kopf.on.login()
def login(memo: Any, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """kopf and the operator's own client share one set of credentials."""
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if info is not None:
        kube_client(memo).login(info)
    return info


@kopf.on.cleanup()
async def close_client(memo: Any, **_: Any) -> None:
    await kube_client(memo).close()


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
    """Recompute the owner's status from a fresh view, write it if it changed, and post the
    Events the change calls for (a new failure, all replicas ready).

    Several handlers write the status concurrently (the owner's and its children's). Each
    reads the owner first and patches with that resourceVersion as a precondition, so a
    write computed from an older view than another writer's fails with 409 and is redone.
    """
    path = resource_path(render.API_VERSION, render.PLURAL, namespace, name)
    for _attempt in range(STATUS_ATTEMPTS):
        body = await client.get(path)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return  # the owner is gone or going; its children follow it
        workload, pods, seen = await _observe(client, body, namespace, name)
        new = compute_status(body, workload, pods, now=_now(), events=seen,
                             apply_failure=memo["apply_failures"].get((namespace, name)),
                             nodecaches=nodecaches_of(memo), policy=memo["policy"],
                             repair=memo["repairs"].get((namespace, name)))
        if not status_changed(body.get("status"), new):
            return
        try:
            await client.patch_status(path, new,
                                      resource_version=body["metadata"].get("resourceVersion"))
        except KubeApiError as e:
            if e.status != 409:
                raise
            continue
        events.post(body, events.status_events(body.get("status"), new))
        return
    raise KubeApiError(409, "Conflict", f"status of {namespace}/{name} kept changing; retrying")


async def _sync_children(memo: Any, body: Mapping[str, Any], namespace: str,
                         name: str) -> SyncResult:
    """Sync the children, remember the outcome for every status writer, post its Events."""
    result = await sync_children(kube_client(memo), body, memo["policy"])
    key = (namespace, name)
    failure = result.failure
    if failure is None:
        memo["apply_failures"].pop(key, None)
    else:
        memo["apply_failures"][key] = failure
    if result.repaired:
        memo["repairs"][key] = Repair(children=tuple(result.repaired), time=_now())
    previous = memo.setdefault("posted_failures", {}).get(key)
    said = None if failure is None else (failure.reason, failure.message)
    # A failure retried every RETRY_DELAY_S is posted once, not at every retry.
    events.post(body, events.sync_events(
        generation=render.Owner.from_body(body).generation, written=result.written,
        repaired=result.repaired, failure=said if said != previous else None))
    memo["posted_failures"][key] = said
    return result


@kopf.on.resume(*DD)
@kopf.on.create(*DD)
@kopf.on.update(*DD)
async def reconcile(body: kopf.Body, name: str, namespace: str | None, memo: Any, logger: Log,
                    **_: Any) -> None:
    namespace = namespace or "default"
    client = kube_client(memo)
    failure = None
    try:
        failure = (await _sync_children(memo, body, namespace, name)).failure
    except InvalidSpecError as e:
        # Not retried: the same spec fails the same way until the user edits it. The status
        # (written below) says InvalidSpec with this message.
        logger.warning(f"invalid spec, children left as they were: {e}")
        events.post(body, [events.Event("Warning", "InvalidSpec", str(e))])
    try:
        await _sync_status(client, memo, namespace, name)
    except KubeApiError as e:
        raise kopf.TemporaryError(f"writing the status failed: {e}", delay=RETRY_DELAY_S) from e
    if failure is not None:
        # Retried: the conflicting object may be removed, the quota raised, the API installed.
        raise kopf.TemporaryError(f"{failure.reason}: {failure.message}", delay=RETRY_DELAY_S)


async def refresh(memo: Any, namespace: str, name: str, *, resync: bool, logger: Log) -> None:
    """Recompute one owner's status; with ``resync`` (a child changed or went away) first
    bring the children back to the rendered state, which repairs any drift."""
    client = kube_client(memo)
    if resync:
        body = await client.get(resource_path(render.API_VERSION, render.PLURAL, namespace, name))
        if body is not None and not (body.get("metadata") or {}).get("deletionTimestamp"):
            try:
                result = await _sync_children(memo, body, namespace, name)
                if result.repaired:
                    logger.warning(f"repaired drift of {namespace}/{name}: "
                                   f"{', '.join(result.repaired)}")
            except InvalidSpecError:
                pass  # the status says InvalidSpec already
    await _sync_status(client, memo, namespace, name)
