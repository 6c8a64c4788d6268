"""The real kopf operator against an in-process Kubernetes API (kmock emulator).

Each test starts ditserve.operator.handlers with kopf, talks to the emulator over HTTP as
kubectl would, and asserts on the stored objects: children and their ownerReferences, the
PATCHes that follow spec edits, and the DiffusionDeployment's status. Every wait is bounded
(kopf can hang on a startup error).
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s.k8s_emulator import (
    CONFIGMAPS,
    DD,
    DEPLOYMENTS,
    SERVICES,
    Emulator,
    eventually,
    http,
    running_operator,
)

pytestmark = [pytest.mark.kmock(cls=Emulator),
              pytest.mark.usefixtures("no_operator_errors", "operator_calls_within_rbac")]
TEST_TIMEOUT_S = 60

SPEC: dict[str, Any] = {
    "replicas": 1,
    "model": {"hostPath": "/mnt/models/tiny", "family": "Flux", "sizeGiB": 2},
    "parallelism": {"data": 2, "sequence": 1},
}



def _obj(kmock: Emulator, resource: Any, name: str, namespace: str = "default") -> Any:
    key = (resource, namespace, name)
    if key in kmock.objects and not kmock.objects[key].deleted:
        return kmock.objects[key].raw
    return None


def _cond(obj: Any, ctype: str) -> dict[str, Any] | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == ctype:
            return cond
    return None


def _dd_url(kmock: Emulator, name: str = "", sub: str = "") -> str:
    url = f"{kmock.url}/apis/ditserve.io/v1alpha1/namespaces/default/diffusiondeployments"
    return url + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")


def _body(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "ditserve.io/v1alpha1", "kind": "DiffusionDeployment",
            "metadata": {"name": name, "namespace": "default"}, "spec": copy.deepcopy(spec)}


async def _create(kmock: Emulator, name: str, spec: dict[str, Any]) -> None:
    status, answer = await http("POST", _dd_url(kmock), _body(name, spec))
    assert status == 201 or status == 200, answer


async def _patch(url: str, body: dict[str, Any]) -> None:
    status, answer = await http("PATCH", url, body, "application/merge-patch+json")
    assert status == 200, answer


def _gpu_limit(deployment: Any) -> str:
    return deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "nvidia.com/gpu"]


async def test_create_update_and_status_follow_children(kmock: Emulator, kubeconfig: Path) -> None:
    async def scenario() -> None:
        async with running_operator():
            await _create(kmock, "tiny", SPEC)
            dep = await eventually(lambda: _obj(kmock, DEPLOYMENTS, "tiny"), what="Deployment")
            cm = await eventually(lambda: _obj(kmock, CONFIGMAPS, "tiny-engine"), what="ConfigMap")
            svc = await eventually(lambda: _obj(kmock, SERVICES, "tiny"), what="Service")
            dd = _obj(kmock, DD, "tiny")
            for child in (dep, cm, svc):
                (ref,) = child["metadata"]["ownerReferences"]
                assert ref["uid"] == dd["metadata"]["uid"]
                assert ref["kind"] == "DiffusionDeployment" and ref["controller"] is True
            assert _gpu_limit(dep) == "2"
            assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == (
                "registry.test/ditserve:e2e")
            assert yaml.safe_load(cm["data"]["engine.yaml"])["parallel"]["data_parallel_size"] == 2

            dd = await eventually(lambda: _cond(_obj(kmock, DD, "tiny"), "Ready")
                                  and _obj(kmock, DD, "tiny"), what="status")
            assert _cond(dd, "Ready")["status"] == "False"
            assert dd["status"]["topology"] == {"gpusPerPod": 2, "podsPerReplica": 1, "totalGPUs": 2}
            assert dd["status"]["observedGeneration"] == 1
            assert dd["status"]["endpoint"]["url"] == "http://tiny.default.svc:8000"

            # Spec edits: more replicas, sequence parallelism and offload -> children patched.
            await _patch(_dd_url(kmock, "tiny"), {"spec": {
                "replicas": 3, "parallelism": {"sequence": 2},
                "offload": {"enabled": True, "runtimeCache": {"enabled": True}}}})
            dep = await eventually(
                lambda: (d := _obj(kmock, DEPLOYMENTS, "tiny")) and d["spec"]["replicas"] == 3
                and d, what="Deployment patched")
            assert _gpu_limit(dep) == "4"
            engine = yaml.safe_load(_obj(kmock, CONFIGMAPS, "tiny-engine")["data"]["engine.yaml"])
            assert engine["offload"]["enabled"] is True and engine["offload"]["runtime_cache"] is True
            assert dep["metadata"]["annotations"]["ditserve.io/generation"] == "2"

            # The child Deployment reports progress -> the owner's counters and conditions follow.
            dep_url = f"{kmock.url}/apis/apps/v1/namespaces/default/deployments/tiny/status"
            await _patch(dep_url, {"status": {"observedGeneration": 2, "replicas": 3,
                                              "updatedReplicas": 3, "readyReplicas": 1}})
            dd = await eventually(
                lambda: (d := _obj(kmock, DD, "tiny"))
                and (d.get("status") or {}).get("readyReplicas") == 1 and d, what="counters")
            assert _cond(dd, "Ready")["reason"] == "ReplicasNotReady"
            assert _cond(dd, "Progressing")["status"] == "True"
            assert dd["status"]["topology"] == {"gpusPerPod": 4, "podsPerReplica": 1, "totalGPUs": 12}
            assert dd["status"]["observedGeneration"] == 2

            await _patch(dep_url, {"status": {"readyReplicas": 3, "availableReplicas": 3}})
            dd = await eventually(
                lambda: (c := _cond(_obj(kmock, DD, "tiny"), "Ready")) and c["status"] == "True"
                and _obj(kmock, DD, "tiny"), what="Ready=True")
            assert _cond(dd, "Ready")["reason"] == "AllReplicasReady"
            assert _cond(dd, "Progressing")["reason"] == "RolloutComplete"
            assert _cond(dd, "Degraded")["status"] == "False"

    await asyncio.wait_for(scenario(), TEST_TIMEOUT_S)


def _status_fields_declared(dd: Any) -> None:
    """Everything the operator (and kopf) wrote into status is declared in the CRD schema,
    so a real API server would prune nothing."""
    from k8s.crd_schema import version_schema

    declared = version_schema()["properties"]["status"]["properties"]
    assert set(dd["status"]) <= set(declared), set(dd["status"]) - set(declared)
    for cond in dd["status"]["conditions"]:
        assert set(cond) <= set(declared["conditions"]["items"]["properties"])


async def test_invalid_spec_lands_in_status_then_recovers(kmock: Emulator, kubeconfig: Path) -> None:
    # Passes the CRD schema, but the engine's rules reject it: resident layers with AllGather
    # sharding over a DP group (every rank would hold a full copy of those layers).
    bad = copy.deepcopy(SPEC)
    bad["offload"] = {"enabled": True, "residentLayers": 4}

    async def scenario() -> None:
        async with running_operator():
            await _create(kmock, "bad", bad)
            dd = await eventually(lambda: _cond(_obj(kmock, DD, "bad"), "Ready")
                                  and _obj(kmock, DD, "bad"), what="InvalidSpec status")
            ready = _cond(dd, "Ready")
            assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
            assert "resident layers are not supported with AllGather" in ready["message"]
            assert ready["observedGeneration"] == 1 and dd["status"]["observedGeneration"] == 1
            assert dd["status"]["lastFailure"]["reason"] == "InvalidSpec"
            assert _cond(dd, "Degraded")["status"] == "True"
            assert _obj(kmock, DEPLOYMENTS, "bad") is None  # nothing rendered from a bad spec
            _status_fields_declared(dd)

            # The user fixes it (no AllGather) -> children appear at generation 2.
            await _patch(_dd_url(kmock, "bad"), {"spec": {"offload": {"useAllGather": False}}})
            dep = await eventually(lambda: _obj(kmock, DEPLOYMENTS, "bad"), what="Deployment")
            assert dep["metadata"]["annotations"]["ditserve.io/generation"] == "2"
            dd = await eventually(
                lambda: (c := _cond(_obj(kmock, DD, "bad"), "Ready")) and c["reason"] != "InvalidSpec"
                and _obj(kmock, DD, "bad"), what="recovered status")
            assert dd["status"]["observedGeneration"] == 2
            assert dd["status"]["lastFailure"]["reason"] == "InvalidSpec"  # kept as history
            assert _cond(dd, "Degraded")["status"] == "False"
            _status_fields_declared(dd)

    await asyncio.wait_for(scenario(), TEST_TIMEOUT_S)


def _pod(name: str, owner: str, *, init_state: dict[str, Any],
         engine_state: dict[str, Any] | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {
        "phase": "Pending",
        "initContainerStatuses": [{"name": "cachectl-ensure", "ready": False, "restartCount": 0,
                                   "state": init_state, "image": "x", "imageID": ""}],
    }
    if engine_state is not None:
        status["containerStatuses"] = [{"name": "engine", "ready": False, "restartCount": 5,
                                        "state": engine_state, "image": "x", "imageID": ""}]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "labels": {
                "app.kubernetes.io/name": "ditserve-engine", "app.kubernetes.io/instance": owner,
                "app.kubernetes.io/managed-by": "ditserve-operator"}},
            "spec": {"containers": [{"name": "engine", "image": "x"}]}, "status": status}


async def test_pod_states_drive_cache_and_degraded_conditions(kmock: Emulator,
                                                               kubeconfig: Path) -> None:
    async def scenario() -> None:
        async with running_operator():
            await _create(kmock, "pods", SPEC)
            await eventually(lambda: _obj(kmock, DEPLOYMENTS, "pods"), what="Deployment")
            pods_url = f"{kmock.url}/api/v1/namespaces/default/pods"
            status, answer = await http("POST", pods_url, _pod(
                "pods-a", "pods", init_state={"running": {"startedAt": "2026-01-01T00:00:00Z"}}))
            assert status in (200, 201), answer
            dd = await eventually(
                lambda: (c := _cond(_obj(kmock, DD, "pods"), "CacheReady"))
                and c["reason"] == "CacheWarming" and _obj(kmock, DD, "pods"), what="CacheWarming")
            assert _cond(dd, "Ready")["reason"] == "WaitingForCache"

            # The cache is built; the engine then crash-loops -> Degraded with the reason.
            await _patch(f"{pods_url}/pods-a/status", {"status": {
                "initContainerStatuses": [{"name": "cachectl-ensure", "ready": True,
                                           "restartCount": 0, "image": "x", "imageID": "",
                                           "state": {"terminated": {"exitCode": 0}}}],
                "containerStatuses": [{"name": "engine", "ready": False, "restartCount": 5,
                                       "image": "x", "imageID": "", "state": {"waiting": {
                                           "reason": "CrashLoopBackOff",
                                           "message": "back-off 5m0s"}}}]}})
            dd = await eventually(
                lambda: (c := _cond(_obj(kmock, DD, "pods"), "Degraded")) and c["status"] == "True"
                and _obj(kmock, DD, "pods"), what="Degraded")
            assert _cond(dd, "Degraded")["reason"] == "CrashLoopBackOff"
            assert _cond(dd, "Ready")["reason"] == "CrashLoopBackOff"
            assert _cond(dd, "CacheReady")["reason"] == "CacheEntryReady"
            assert dd["status"]["lastFailure"]["reason"] == "CrashLoopBackOff"
            _status_fields_declared(dd)

    await asyncio.wait_for(scenario(), TEST_TIMEOUT_S)


async def test_deleted_child_is_recreated_and_delete_stops_cleanly(kmock: Emulator,
                                                                   kubeconfig: Path) -> None:
    async def scenario() -> None:
        async with running_operator() as task:
            await _create(kmock, "gone", SPEC)
            first = await eventually(lambda: _obj(kmock, DEPLOYMENTS, "gone"), what="Deployment")
            dep_url = f"{kmock.url}/apis/apps/v1/namespaces/default/deployments/gone"
            status, _ = await http("DELETE", dep_url)
            assert status == 200
            again = await eventually(lambda: _obj(kmock, DEPLOYMENTS, "gone"), what="re-created")
            assert again["metadata"]["uid"] != first["metadata"]["uid"]

            # No finalizers ever: deleting the owner is immediate, operator or not.
            dd = _obj(kmock, DD, "gone")
            assert not dd["metadata"].get("finalizers")
            assert all(not k.startswith("kopf.zalando.org")
                       for k in dd["metadata"].get("annotations", {}))
            status, _ = await http("DELETE", _dd_url(kmock, "gone"))
            assert status == 200
            assert _obj(kmock, DD, "gone") is None
            assert not task.done()
        assert task.done() and task.exception() is None

    await asyncio.wait_for(scenario(), TEST_TIMEOUT_S)
