"""A small async Kubernetes API client for the operator's own requests (children, status).

Owns URL building, authentication from kopf's ``ConnectionInfo`` (the login handler hands it
over, so kopf and this client use the same credentials, TLS settings and headers) and the few
verbs the operator needs: get, list, create, server-side apply under a resourceVersion
precondition, delete under a uid precondition, and merge-patches (``/status``, node labels).

Why not the ``kubernetes`` package: it is synchronous (kopf would run every handler in a
thread), reads $KUBECONFIG at import time, and validates bodies against its own models.
Called by ``handlers`` and ``children``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import aiohttp
import kopf

from ditserve.operator.errors import KubeApiError, NotLoggedInError

FIELD_MANAGER = "ditserve-operator"
USER_AGENT = "ditserve-operator"  # names the operator's own requests in audit logs
# In-cluster tokens are short-lived and rotated on disk: read the file per request.
SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
SERVICE_ACCOUNT_CA = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"

_PLURALS = {"ConfigMap": "configmaps", "Service": "services", "Deployment": "deployments",
            "Pod": "pods", "DiffusionDeployment": "diffusiondeployments",
            "LeaderWorkerSet": "leaderworkersets", "PodDisruptionBudget": "poddisruptionbudgets",
            "Node": "nodes", "NodeCache": "nodecaches", "Event": "events",
            "HorizontalPodAutoscaler": "horizontalpodautoscalers",
            "ScaledObject": "scaledobjects"}


def resource_path(api_version: str, plural: str, namespace: str | None, name: str | None = None,
                  subresource: str | None = None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    parts = [base]
    if namespace:
        parts.append(f"namespaces/{namespace}")
    parts.append(plural)
    if name:
        parts.append(name)
    if subresource:
        parts.append(subresource)
    return "/".join(parts)


def manifest_path(manifest: Mapping[str, Any], *, named: bool = True) -> str:
    meta = manifest["metadata"]
    return resource_path(manifest["apiVersion"], _PLURALS[manifest["kind"]], meta.get("namespace"),
                         meta["name"] if named else None)


class KubeClient:
    """One aiohttp session bound to one API server; ``login`` may be called again on rotation."""

    def __init__(self, *, request_timeout_s: float = 30.0) -> None:
        self._info: kopf.ConnectionInfo | None = None
        self._session: aiohttp.ClientSession | None = None
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._retired: list[aiohttp.ClientSession] = []

    def login(self, info: kopf.ConnectionInfo) -> None:
        """Use new credentials from now on (kopf logs in again when its own requests get 401)."""
        if self._session is not None and info != self._info:
            # The session's connector holds the old TLS context; close it on the next request.
            self._retired.append(self._session)
            self._session = None
        self._info = info

    @staticmethod
    def _headers(info: kopf.ConnectionInfo) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": USER_AGENT,
                   **info.as_http_headers()}
        if info.ca_path == SERVICE_ACCOUNT_CA and os.path.exists(SERVICE_ACCOUNT_TOKEN):
            # In-cluster: the kubelet rotates the projected token on disk; read it each time.
            with open(SERVICE_ACCOUNT_TOKEN) as f:
                token = f.read().strip()
            if token:
                headers["Authorization"] = f"Bearer {token}"
        return headers

    async def _request(self, method: str, path: str, *, params: Mapping[str, str] | None = None,
                       body: Any = None, content_type: str = "application/json",
                       missing_ok: bool = False) -> dict[str, Any] | None:
        if self._info is None:
            raise NotLoggedInError("the operator has no API credentials yet (no login happened)")
        info = self._info
        while self._retired:
            await self._retired.pop().close()
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, connector=aiohttp.TCPConnector(ssl=info.as_ssl_context()))
        headers = self._headers(info)
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        url = info.server.rstrip("/") + path
        async with self._session.request(method, url, params=params, data=data,
                                         headers=headers) as resp:
            text = await resp.text()
            try:
                payload = json.loads(text) if text else None
            except ValueError:
                payload = {"message": text[:500]}
            if resp.status == 404 and missing_ok:
                return None
            if resp.status >= 400:
                payload = payload if isinstance(payload, dict) else {}
                raise KubeApiError(resp.status, str(payload.get("reason", resp.reason)),
                                   str(payload.get("message", "")))
            return payload if isinstance(payload, dict) else {}

    async def get(self, path: str) -> dict[str, Any] | None:
        """The object at ``path``, or None if it does not exist."""
        return await self._request("GET", path, missing_ok=True)

    async def list(self, path: str, *, label_selector: str | None = None,
                   field_selector: str | None = None) -> list[dict[str, Any]]:
        params = {}
        if label_selector:
            params["labelSelector"] = label_selector
        if field_selector:
            params["fieldSelector"] = field_selector
        result = await self._request("GET", path, params=params or None) or {}
        return list(result.get("items") or [])

    async def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """POST a new object: 409 AlreadyExists if someone created it first (never a takeover)."""
        created = await self._request("POST", manifest_path(manifest, named=False),
                                      params={"fieldManager": FIELD_MANAGER}, body=manifest)
        return created or {}

    async def apply(self, manifest: Mapping[str, Any], *,
                    resource_version: str) -> dict[str, Any] | None:
        """Server-side apply with ``force`` to an object the caller checked it owns.

        ``force``: the operator owns every field it renders, and a field it stops rendering is
        removed. The resourceVersion the ownership was checked at is a precondition (409 if the
        object changed since), so an object replaced in between is never overwritten.
        None if the object is gone.
        """
        body = {**manifest, "metadata": {**manifest["metadata"],
                                         "resourceVersion": resource_version}}
        params = {"fieldManager": FIELD_MANAGER, "force": "true"}
        return await self._request("PATCH", manifest_path(manifest), params=params, body=body,
                                   content_type="application/apply-patch+yaml", missing_ok=True)

    async def delete(self, path: str, *, uid: str) -> None:
        """Delete the object at ``path`` only if it is still the one with ``uid`` (409 if not);
        its dependents go in the background."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": uid},
                "propagationPolicy": "Background"}
        await self._request("DELETE", path, body=body, missing_ok=True)

    async def patch(self, path: str, patch: Mapping[str, Any]) -> dict[str, Any] | None:
        """A JSON merge patch; None if the object is gone."""
        return await self._request("PATCH", path, body=patch,
                                   content_type="application/merge-patch+json", missing_ok=True)

    async def patch_status(self, path: str, status: Mapping[str, Any], *,
                           resource_version: str | None = None) -> dict[str, Any] | None:
        """Merge-patch ``status`` through the status subresource; None if the object is gone.

        With ``resource_version`` the write is conditional: 409 if the object changed since.
        """
        body: dict[str, Any] = {"status": status}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        return await self._request("PATCH", f"{path}/status", body=body,
                                   content_type="application/merge-patch+json", missing_ok=True)

    async def close(self) -> None:
        while self._retired:
            await self._retired.pop().close()
        if self._session is not None:
            await self._session.close()
            self._session = None
