"""The operator as a platform team must be able to trust it, driven through the emulator: no
tenant reaches a node path outside the admin's roots, every failure and rollout is an Event,
drift on any owned child is put back while the operator runs (and named in status), pods
refused at admission are Degraded at once, and a second operator replica never reconciles
while another holds the peering."""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from k8s.e2e_support import cond, create, create_dd, merge_patch, obj
from k8s.k8s_emulator import (
    CONFIGMAPS,
    DD,
    DEPLOYMENTS,
    EVENTS,
    PDBS,
    PEERINGS,
    SERVICES,
    Emulator,
    eventually,
    http,
    running_operator,
)

import ditserve.operator.deployments as handlers

pytestmark = [pytest.mark.kmock(cls=Emulator),
              pytest.mark.usefixtures("quick_retries", "operator_calls_within_rbac")]
TEST_TIMEOUT_S = 60
SPEC: dict[str, Any] = {"replicas": 2, "model": {"hostPath": "/mnt/models/tiny", "sizeGiB": 2}}
API = "/apis/apps/v1/namespaces/default/deployments"




def _events(kmock: Emulator, name: str) -> list[dict[str, Any]]:
    return [o.raw for (res, _ns, _n), o in list(kmock.objects.items())
            if res == EVENTS and not o.deleted
            and (o.raw.get("involvedObject") or {}).get("name") == name
            and (o.raw.get("involvedObject") or {}).get("kind") == "DiffusionDeployment"]


def _event(kmock: Emulator, name: str, reason: str) -> dict[str, Any] | None:
    return next((e for e in _events(kmock, name) if e.get("reason") == reason), None)


def _reason(kmock: Emulator, name: str, ctype: str = "Ready") -> str | None:
    c = cond(obj(kmock, DD, name), ctype)
    return None if c is None else c["reason"]


def _run(scenario: Callable[[], Any]) -> Any:
    return asyncio.wait_for(scenario(), TEST_TIMEOUT_S)


@pytest.mark.parametrize(("spec", "complaint"), [
    ({"model": {"hostPath": "/var/lib/kubelet"}}, "model.hostPath '/var/lib/kubelet' is outside"),
    ({"model": {"hostPath": "/mnt/models/../../etc"}}, "is outside"),
    ({"model": {"hostPath": "/mnt/models/tiny"}, "cache": {"root": "/etc"}},
     "cache.root '/etc' is not the node cache root '/var/cache/ditserve'"),
])
async def test_a_node_path_outside_the_admin_roots_is_invalid_and_renders_nothing(
        kmock: Emulator, kubeconfig: Path, no_operator_errors: None,
        spec: dict[str, Any], complaint: str) -> None:
    async def scenario() -> None:
        async with running_operator():
            await create_dd(kmock, "hostile", spec)
            await eventually(lambda: _reason(kmock, "hostile") == "InvalidSpec", what="InvalidSpec")
            dd = obj(kmock, DD, "hostile")
            assert complaint in cond(dd, "Degraded")["message"]  # type: ignore[index]
            warning = await eventually(lambda: _event(kmock, "hostile", "InvalidSpec"),
                                       what="InvalidSpec Event")
            assert warning["type"] == "Warning" and complaint in warning["message"]
            assert [key for key in kmock.objects if key[0] in (CONFIGMAPS, SERVICES, DEPLOYMENTS)
                    and key[2].startswith("hostile")] == []

    await _run(scenario)


async def test_rollouts_and_readiness_are_normal_events(
        kmock: Emulator, kubeconfig: Path, no_operator_errors: None) -> None:
    async def scenario() -> None:
        async with running_operator():
            await create_dd(kmock, "flux", SPEC)
            applied = await eventually(lambda: _event(kmock, "flux", "ChildrenApplied"),
                                       what="ChildrenApplied Event")
            assert applied["type"] == "Normal" and "generation 1" in applied["message"]
            assert "Deployment default/flux (created)" in applied["message"]
            await merge_patch(f"{kmock.url}{API}/flux/status",
                              {"status": {"observedGeneration": 1, "replicas": 2,
                                          "updatedReplicas": 2, "readyReplicas": 2}})
            ready = await eventually(lambda: _event(kmock, "flux", "Ready"), what="Ready Event")
            assert ready["type"] == "Normal" and "2/2 replicas ready" in ready["message"]

    await _run(scenario)


async def test_drift_of_any_owned_child_is_repaired_and_named_in_status(
        kmock: Emulator, kubeconfig: Path, no_operator_errors: None) -> None:
    async def scenario() -> None:
        async with running_operator():
            await create_dd(kmock, "flux", SPEC)
            dep = await eventually(lambda: obj(kmock, DEPLOYMENTS, "flux"), what="Deployment")
            image = dep["spec"]["template"]["spec"]["containers"][0]["image"]
            await eventually(lambda: obj(kmock, PDBS, "flux"), what="PodDisruptionBudget")
            # Someone scales the Deployment by hand and swaps the engine's image.
            template = dep["spec"]["template"]
            template["spec"]["containers"][0]["image"] = "evil.example/miner:1"
            await merge_patch(f"{kmock.url}{API}/flux", {"spec": {"replicas": 7,
                                                                  "template": template}})
            await eventually(lambda: obj(kmock, DEPLOYMENTS, "flux")["spec"]["replicas"] == 2
                             and obj(kmock, DEPLOYMENTS, "flux")["spec"]["template"]["spec"][
                                 "containers"][0]["image"] == image, what="Deployment repaired")
            # The ConfigMap is edited, the Service's selector changed, the PDB deleted.
            await merge_patch(f"{kmock.url}/api/v1/namespaces/default/configmaps/flux-engine",
                              {"data": {"engine.yaml": "model: /elsewhere\n"}})
            await merge_patch(f"{kmock.url}/api/v1/namespaces/default/services/flux",
                              {"spec": {"selector": {"app.kubernetes.io/instance": "other"}}})
            status, _ = await http(
                "DELETE", f"{kmock.url}/apis/policy/v1/namespaces/default/poddisruptionbudgets/flux")
            assert status == 200
            await eventually(lambda: "model: /elsewhere" not in obj(
                kmock, CONFIGMAPS, "flux-engine")["data"]["engine.yaml"], what="ConfigMap back")
            await eventually(lambda: obj(kmock, SERVICES, "flux")["spec"]["selector"][
                "app.kubernetes.io/instance"] == "flux", what="Service selector back")
            await eventually(lambda: obj(kmock, PDBS, "flux"), what="PDB re-created")
            repaired = await eventually(
                lambda: "PodDisruptionBudget default/flux (deleted)" in (
                    (obj(kmock, DD, "flux").get("status") or {}).get("lastRepair") or {}).get(
                    "children", []) and obj(kmock, DD, "flux")["status"]["lastRepair"],
                what="lastRepair names the PDB")
            assert "re-applied after a change outside the operator" in repaired["message"]
            drift = [e for e in _events(kmock, "flux") if e["reason"] == "DriftRepaired"]
            said = " ".join(e["message"] for e in drift)
            assert all(e["type"] == "Warning" for e in drift)
            for child in ("Deployment default/flux (changed)",
                          "ConfigMap default/flux-engine (changed)",
                          "Service default/flux (changed)"):
                assert child in said, said

    await _run(scenario)


async def test_pods_refused_at_admission_are_degraded_with_the_controllers_message(
        kmock: Emulator, kubeconfig: Path, no_operator_errors: None) -> None:
    refused = ('pods "flux-7d9c-x" is forbidden: violates PodSecurity "restricted:latest": '
               'hostPath volumes (volumes "model", "cache")')

    async def scenario() -> None:
        async with running_operator():
            await create_dd(kmock, "flux", SPEC)
            await eventually(lambda: obj(kmock, DEPLOYMENTS, "flux"), what="Deployment")
            await merge_patch(f"{kmock.url}{API}/flux/status", {"status": {
                "observedGeneration": 1, "replicas": 0,
                "conditions": [{"type": "ReplicaFailure", "status": "True",
                                "reason": "FailedCreate", "message": refused}]}})
            await eventually(lambda: _reason(kmock, "flux", "Degraded") == "PodCreateFailed",
                             what="Degraded=PodCreateFailed")
            degraded = cond(obj(kmock, DD, "flux"), "Degraded")
            assert degraded["status"] == "True" and refused in degraded["message"]  # type: ignore[index]
            assert _reason(kmock, "flux") == "PodCreateFailed"
            warning = await eventually(lambda: _event(kmock, "flux", "PodCreateFailed"),
                                       what="PodCreateFailed Event")
            assert warning["type"] == "Warning" and "violates PodSecurity" in warning["message"]

    await _run(scenario)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


async def test_a_replica_pauses_while_a_higher_priority_peer_holds_the_peering(
        kmock: Emulator, kubeconfig: Path, monkeypatch: pytest.MonkeyPatch,
        no_operator_errors: None) -> None:
    monkeypatch.setenv(handlers.PEERING_ENV, "ditserve-operator")
    peering_url = "/apis/kopf.dev/v1/namespaces/default/kopfpeerings"
    # Another operator replica, alive, with a priority above any this one draws (<= 2**30).
    await create(kmock, peering_url, {
        "apiVersion": "kopf.dev/v1", "kind": "KopfPeering",
        "metadata": {"name": "ditserve-operator"},
        "status": {"other-replica": {"priority": 2**31, "lifetime": 60, "lastseen": _now()}}})

    async def scenario() -> None:
        async with running_operator():
            # This replica has joined the peering (its keepalive, at a lower priority): it
            # starts paused and stays paused while the other replica is alive.
            await eventually(lambda: len(obj(kmock, PEERINGS, "ditserve-operator")["status"]) == 2,
                             what="joined the peering")
            mine = [p for key, p in obj(kmock, PEERINGS, "ditserve-operator")["status"].items()
                    if key != "other-replica"]
            assert mine[0]["priority"] < 2**31
            await create_dd(kmock, "flux", SPEC)
            await asyncio.sleep(1.0)  # time in which an unpaused operator would have rendered
            assert obj(kmock, DEPLOYMENTS, "flux") is None
            assert obj(kmock, CONFIGMAPS, "flux-engine") is None
            # The other replica leaves: this one takes over and reconciles.
            await merge_patch(f"{kmock.url}{peering_url}/ditserve-operator",
                              {"status": {"other-replica": None}})
            await eventually(lambda: obj(kmock, DEPLOYMENTS, "flux"), what="Deployment")

    await _run(scenario)


async def test_the_engines_start_error_reaches_status_and_events(
        kmock: Emulator, kubeconfig: Path, no_operator_errors: None) -> None:
    said = ("error: sequence-parallel size 8 does not divide the 12 attention heads of "
            "transformer: use 1, 2, 3, 4, 6 or 12")

    async def scenario() -> None:
        async with running_operator():
            await create_dd(kmock, "wan", {**SPEC, "cache": {"mode": "None"}})
            await eventually(lambda: obj(kmock, DEPLOYMENTS, "wan"), what="Deployment")
            await create(kmock, "/api/v1/namespaces/default/pods", {
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "wan-abc", "labels": {
                    "app.kubernetes.io/name": "ditserve-engine",
                    "app.kubernetes.io/instance": "wan",
                    "app.kubernetes.io/managed-by": "ditserve-operator"}},
                "spec": {"containers": [{"name": "engine", "image": "x"}]},
                "status": {"phase": "Running", "containerStatuses": [{
                    "name": "engine", "ready": False, "restartCount": 3, "image": "x",
                    "imageID": "", "state": {"waiting": {"reason": "CrashLoopBackOff",
                                                         "message": "back-off 40s"}},
                    "lastState": {"terminated": {"exitCode": 2, "reason": "Error",
                                                 "message": said}}}]}})
            await eventually(lambda: _reason(kmock, "wan", "Degraded") == "CrashLoopBackOff",
                             what="Degraded=CrashLoopBackOff")
            message = cond(obj(kmock, DD, "wan"), "Degraded")["message"]  # type: ignore[index]
            assert message == f"pod wan-abc: engine restarted 3 times; last exit 2: {said}"
            warning = await eventually(lambda: _event(kmock, "wan", "CrashLoopBackOff"),
                                       what="CrashLoopBackOff Event")
            assert warning["type"] == "Warning" and said in warning["message"]

    await _run(scenario)
