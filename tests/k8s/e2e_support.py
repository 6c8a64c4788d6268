"""Helpers of the operator end-to-end tests: reading the emulator, writing like kubectl, and
checking that every call the operator made is allowed by the chart's RBAC."""

from __future__ import annotations

import copy
from typing import Any

from k8s.k8s_emulator import Emulator, http
from k8s.rbac_check import Authorizer

CLUSTER_SCOPED = {"nodecaches", "nodes"}
OPERATOR_SA = "rel-ditserve"  # the default chart's operator ServiceAccount (release "rel")
CHART_NAMESPACE = "ditserve-system"


def obj(kmock: Emulator, resource: Any, name: str, namespace: str | None = "default") -> Any:
    key = (resource, namespace, name)
    if key in kmock.objects and not kmock.objects[key].deleted:
        return kmock.objects[key].raw
    return None


def cond(body: Any, ctype: str) -> dict[str, Any] | None:
    for c in ((body or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == ctype:
            return dict(c)
    return None


def dd_url(kmock: Emulator, name: str = "", sub: str = "", namespace: str = "default") -> str:
    url = f"{kmock.url}/apis/ditserve.io/v1alpha1/namespaces/{namespace}/diffusiondeployments"
    return url + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")


def dd_body(name: str, spec: dict[str, Any], namespace: str = "default") -> dict[str, Any]:
    return {"apiVersion": "ditserve.io/v1alpha1", "kind": "DiffusionDeployment",
            "metadata": {"name": name, "namespace": namespace}, "spec": copy.deepcopy(spec)}


async def create(kmock: Emulator, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, answer = await http("POST", f"{kmock.url}{path}", body)
    assert status in (200, 201), answer
    return dict(answer)


async def create_dd(kmock: Emulator, name: str, spec: dict[str, Any],
                    namespace: str = "default") -> None:
    status, answer = await http("POST", dd_url(kmock, namespace=namespace),
                                dd_body(name, spec, namespace))
    assert status in (200, 201), answer


async def merge_patch(url: str, body: dict[str, Any]) -> dict[str, Any]:
    status, answer = await http("PATCH", url, body, "application/merge-patch+json")
    assert status == 200, answer
    return dict(answer)


def refused_operator_calls(kmock: Emulator, chart: list[dict[str, Any]]) -> list[str]:
    """The operator's recorded calls that the chart's RBAC would refuse."""
    rbac = Authorizer(chart, service_account=OPERATOR_SA, namespace=CHART_NAMESPACE)
    calls = [c for c in kmock.calls if c.by_operator]
    assert calls, "the operator made no call at all"
    return rbac.refused(calls, cluster_scoped=CLUSTER_SCOPED)
