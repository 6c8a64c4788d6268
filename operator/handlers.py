"""kopf handlers: thin glue from Kubernetes events to ``render`` and ``compute_status``.

Owns the operator's settings and its reactions:
- a DiffusionDeployment is created, updated or found on start (resume): validate, render,
  adopt, apply the children, write the status (``InvalidSpec`` instead of children when the
  engine's rules reject the spec);
- a child Deployment or an engine pod changes: recompute the owner's status (and re-apply
  the children if the Deployment was deleted from under a live owner).

Deliberately absent: on.delete handlers, timers and daemons. Any of them makes kopf put a
finalizer on every object, and a finalizer hangs deletion whenever the operator is not
running; ownerReferences already let Kubernetes collect the children.
Loaded by ``main`` (``ditserve-operator``) or directly: ``kopf run -m ditserve.operator.handlers``.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import kopf

from ditserve.operator import render
from ditserve.operator.errors import InvalidSpecError, KubeApiError
from ditserve.operator.kube import KubeClient, resource_path
from ditserve.operator.spec import validate
from ditserve.operator.status import compute_status, status_changed

DD = (render.API_GROUP, "v1alpha1", render.PLURAL)
MANAGED = {"app.kubernetes.io/managed-by": render.MANAGER}
IMAGE_ENV = "DITSERVE_ENGINE_IMAGE"  # set by the chart to the image the operator runs
RETRY_DELAY_S = 15
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
    # Only warnings and errors become Kubernetes Events on the object.
    settings.posting.level = logging.WARNING
    # Annotations only: kopf's default also writes status.kopf, which the CRD does not declare
    # (the API server would prune it and kopf would lose its progress).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=render.API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=render.API_GROUP, key="last-handled-configuration")
    _client(memo)
    memo["image"] = os.environ.get(IMAGE_ENV) or render.DEFAULT_IMAGE


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


async def _observe(client: KubeClient, namespace: str,
                   name: str) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    deployment = await client.get(resource_path("apps/v1", "deployments", namespace, name))
    pods = await client.list(resource_path("v1", "pods", namespace),
                             label_selector=render.selector_string(name))
    return deployment, pods


async def _apply_children(client: KubeClient, body: Mapping[str, Any], image: str) -> None:
    """Apply the rendered children; InvalidSpecError (nothing applied) if the spec is invalid."""
    owner = render.Owner.from_body(body)
    spec, _ = validate(body.get("spec"))
    for manifest in render.adopt(render.render(spec, owner, image=image), owner):
        await client.apply(manifest)


@kopf.on.resume(*DD)
@kopf.on.create(*DD)
@kopf.on.update(*DD)
async def reconcile(body: kopf.Body, name: str, namespace: str | None, memo: Any, logger: Log,
                    **_: Any) -> None:
    client = _client(memo)
    try:
        await _apply_children(client, body, memo.get("image", render.DEFAULT_IMAGE))
    except InvalidSpecError as e:
        # Not retried: the same spec fails the same way until the user edits it. The status
        # (written below) says InvalidSpec with this message.
        logger.warning(f"invalid spec, children left as they were: {e}")
    except KubeApiError as e:
        raise kopf.TemporaryError(f"applying children failed: {e}", delay=RETRY_DELAY_S) from e
    try:
        await _sync_status(client, namespace or "default", name)
    except KubeApiError as e:
        raise kopf.TemporaryError(f"writing the status failed: {e}", delay=RETRY_DELAY_S) from e


async def _sync_status(client: KubeClient, namespace: str, name: str) -> None:
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
        deployment, pods = await _observe(client, namespace, name)
        new = compute_status(body, deployment, pods, now=_now())
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


async def _refresh(memo: Any, namespace: str, name: str, *, child_deleted: bool,
                   logger: Log) -> None:
    client = _client(memo)
    if child_deleted:
        body = await client.get(resource_path(render.API_VERSION, render.PLURAL, namespace, name))
        if body is not None and not (body.get("metadata") or {}).get("deletionTimestamp"):
            try:
                await _apply_children(client, body, memo.get("image", render.DEFAULT_IMAGE))
                logger.info(f"re-created the children of {namespace}/{name}")
            except InvalidSpecError:
                pass  # the status says InvalidSpec already
    await _sync_status(client, namespace, name)


def _owner_name(body: Mapping[str, Any]) -> str | None:
    for ref in (body.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == render.KIND and ref.get("apiVersion", "").startswith(render.API_GROUP):
            return str(ref.get("name"))
    return None


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
async def child_deployment_changed(body: kopf.Body, type: str, namespace: str | None, memo: Any,
                                   logger: Log, **_: Any) -> None:
    owner = _owner_name(body)
    if owner is None or namespace is None:
        return
    try:
        await _refresh(memo, namespace, owner, child_deleted=type == "DELETED", logger=logger)
    except KubeApiError as e:
        logger.warning(f"could not refresh the status of {namespace}/{owner}: {e}")


@kopf.on.event("v1", "pods", labels=MANAGED)
async def engine_pod_changed(body: kopf.Body, namespace: str | None, memo: Any, logger: Log,
                             **_: Any) -> None:
    owner = (body.get("metadata") or {}).get("labels", {}).get("app.kubernetes.io/instance")
    if not owner or namespace is None:
        return
    try:
        await _refresh(memo, namespace, owner, child_deleted=False, logger=logger)
    except KubeApiError as e:
        logger.warning(f"could not refresh the status of {namespace}/{owner}: {e}")
