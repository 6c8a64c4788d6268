"""Children stored the way a real API server stores them are not drift: it keeps a resource
quantity in its canonical form (57344Mi as 56Gi, 0.5 as 500m, 8000m as 8, as Go's
resource.Quantity prints it) and drops empty lists and false plain booleans (Go's omitempty).
An operator that compared strings reported "DriftRepaired" on every Deployment event."""

from __future__ import annotations

import asyncio
import re
from decimal import Decimal
from pathlib import Path
from typing import Any

import kmock
import pytest
from k8s.e2e_support import create_dd, merge_patch, obj
from k8s.k8s_emulator import DD, DEPLOYMENTS, EVENTS, Emulator, eventually, running_operator

from ditserve.operator.children import matches

_BINARY = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"]
_DECIMAL = {-9: "n", -6: "u", -3: "m", 0: "", 3: "k", 6: "M", 9: "G", 12: "T", 15: "P", 18: "E"}
_SCALE = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def canonical(quantity: str) -> str:
    """What the API server stores for ``quantity`` (binary or decimal SI suffixes)."""
    match = re.fullmatch(r"([0-9.]+)([KMGTPE]i|[numkMGTPE])?", quantity)
    assert match, quantity
    number, suffix = Decimal(match[1]), match[2] or ""
    if suffix.endswith("i"):
        n_bytes = number * 1024 ** _BINARY.index(suffix)
        if n_bytes == n_bytes.to_integral() and n_bytes >= 1024:
            power = 0
            while n_bytes % 1024 ** (power + 1) == 0 and power < 6:
                power += 1
            return f"{int(n_bytes / 1024**power)}{_BINARY[power]}"
        number, suffix = n_bytes, ""
    value = number.scaleb(_SCALE[suffix])
    for exp in sorted(_DECIMAL, reverse=True):  # the largest unit with a whole count
        count = value.scaleb(-exp)
        if count == count.to_integral() and (count != 0 or exp == 0):
            return f"{int(count)}{_DECIMAL[exp]}"
    raise AssertionError(quantity)


def test_canonical_matches_go() -> None:
    # As `kubectl set resources --local -o yaml` prints them (Go's resource.Quantity).
    assert [canonical(q) for q in ("57344Mi", "49152Mi", "0.5", "8000m", "1024Mi", "4", "1000",
                                   "1536Ki", "1Mi")] == [
        "56Gi", "48Gi", "500m", "8", "1Gi", "4", "1k", "1536Ki", "1Mi"]


def store_as_server(o: Any, key: str = "") -> Any:
    """``o`` as the API server stores a Deployment: canonical quantities, no empty lists, no
    false volumeMount readOnly."""
    if isinstance(o, dict):
        if key in ("requests", "limits"):
            return {k: canonical(str(v)) for k, v in o.items()}
        out = {k: store_as_server(v, k) for k, v in o.items() if v != []}
        if key == "emptyDir" and "sizeLimit" in out:
            out["sizeLimit"] = canonical(out["sizeLimit"])
        if "mountPath" in out and out.get("readOnly") is False:
            del out["readOnly"]
        return out
    if isinstance(o, list):
        return [store_as_server(x, key) for x in o]
    return o


class CanonicalEmulator(Emulator):
    """Stores Deployments as a real API server does (see ``store_as_server``)."""

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource == DEPLOYMENTS and isinstance(request.data, dict):
            stored = store_as_server(request.data)
            request.data.clear()
            request.data.update(stored)
        return await super()._handle(request)


pytestmark = [pytest.mark.kmock(cls=CanonicalEmulator)]


def test_quantities_match_by_value() -> None:
    want = {"resources": {"requests": {"cpu": "0.5", "memory": "57344Mi"},
                          "limits": {"cpu": "8000m", "nvidia.com/gpu": "1"}},
            "volumes": [{"emptyDir": {"sizeLimit": "1024Mi"}}]}
    stored = {"resources": {"requests": {"cpu": "500m", "memory": "56Gi"},
                            "limits": {"cpu": "8", "nvidia.com/gpu": "1"}},
              "volumes": [{"emptyDir": {"sizeLimit": "1Gi"}}]}
    assert matches(want, stored)
    edited = {**stored, "resources": {**stored["resources"], "requests": {
        "cpu": "500m", "memory": "55Gi"}}}
    assert not matches(want, edited)
    # Only quantity fields compare by value: elsewhere "1Gi" and "1024Mi" are different text.
    assert not matches({"env": [{"name": "X", "value": "1024Mi"}]},
                       {"env": [{"name": "X", "value": "1Gi"}]})


SPECS: dict[str, dict[str, Any]] = {
    # Memory 48Gi + 8Gi shm is rendered as 57344Mi; CPU as the user wrote it.
    "hostpath": {"replicas": 1, "model": {"hostPath": "/mnt/models/tiny", "sizeGiB": 2},
                 "engine": {"resources": {"memory": "48Gi", "cpu": "0.5"},
                            "shmSize": "1024Mi"}},
    # A PVC model: the init container builds the cache itself (a writable cache mount).
    "pvc": {"replicas": 1, "model": {"persistentVolumeClaim": {"claimName": "models"}},
            "engine": {"resources": {"cpu": "8000m"}}},
}


def _drift_events(kmock: Emulator, name: str) -> list[str]:
    return [o.raw["message"] for (res, _ns, _n), o in list(kmock.objects.items())
            if res == EVENTS and not o.deleted and o.raw.get("reason") == "DriftRepaired"
            and (o.raw.get("involvedObject") or {}).get("name") == name]


def _deployment_writes(kmock: Emulator, name: str) -> int:
    return sum(1 for c in kmock.calls if c.by_operator and c.plural == "deployments"
               and c.name == name and c.method in ("PATCH", "PUT"))


@pytest.mark.parametrize("name", sorted(SPECS))
async def test_a_deployment_nobody_edited_is_not_repaired(
        kmock: Emulator, kubeconfig: Path, no_operator_errors: None, name: str) -> None:
    async def scenario() -> None:
        async with running_operator():
            await create_dd(kmock, name, SPECS[name])
            await eventually(lambda: obj(kmock, DEPLOYMENTS, name), what="Deployment")
            await eventually(lambda: (obj(kmock, DD, name).get("status") or {}).get(
                "observedGeneration") == 1, what="status written")
            # The deployment controller writes status, as it does all through a rollout:
            # each is a Deployment event the operator checks its children on.
            url = f"{kmock.url}/apis/apps/v1/namespaces/default/deployments/{name}/status"
            for replicas in (1, 0, 1):
                await merge_patch(url, {"status": {"observedGeneration": 1,
                                                   "replicas": replicas}})
                await asyncio.sleep(0.5)
            await asyncio.sleep(1.0)
            assert _drift_events(kmock, name) == []
            assert not (obj(kmock, DD, name).get("status") or {}).get("lastRepair")
            assert _deployment_writes(kmock, name) == 0

    await asyncio.wait_for(scenario(), 60)
