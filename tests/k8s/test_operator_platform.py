"""The operator as a platform team runs it, against the emulator: apply failures and ownership
conflicts as conditions, restarts that change nothing, cluster-wide and namespaced modes within
the chart's RBAC, server-side selected watches, mount failures, LeaderWorkerSets, disruption
budgets, and per-node cache status turned into node labels and a status summary."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from k8s.chart import template
from k8s.e2e_support import (
    cond,
    create,
    create_dd,
    dd_url,
    merge_patch,
    obj,
    refused_operator_calls,
)
from k8s.k8s_emulator import (
    CONFIGMAPS,
    DD,
    DEPLOYMENTS,
    LWS,
    NODES,
    PDBS,
    SERVICES,
    Emulator,
    eventually,
    http,
    running_operator,
)

import ditserve.operator.deployments as handlers
from ditserve.operator.nodecache import cache_label_key

pytestmark = [pytest.mark.kmock(cls=Emulator),
              pytest.mark.usefixtures("quick_retries", "operator_calls_within_rbac")]
TEST_TIMEOUT_S = 60
SPEC: dict[str, Any] = {"replicas": 1, "model": {"hostPath": "/mnt/models/tiny", "sizeGiB": 2}}
RETRIED = r"failed temporarily: Child(ApplyFailed|Conflict)"




def _reason(kmock: Emulator, name: str, ctype: str = "Ready",
            namespace: str = "default") -> str | None:
    c = cond(obj(kmock, DD, name, namespace), ctype)
    return None if c is None else c["reason"]


async def _until(kmock: Emulator, name: str, reason: str, ctype: str = "Ready") -> dict[str, Any]:
    await eventually(lambda: _reason(kmock, name, ctype) == reason, what=f"{ctype}={reason}")
    return dict(obj(kmock, DD, name))


def _run(scenario: Callable[[], Any]) -> Any:
    return asyncio.wait_for(scenario(), TEST_TIMEOUT_S)


async def test_a_refused_child_is_a_condition_with_the_servers_message(
        kmock: Emulator, kubeconfig: Path, operator_errors_only: Callable[[str], None]) -> None:
    operator_errors_only(RETRIED)
    # Passes the CRD (the affinity is passed through), but the API server refuses the pods.
    bad = {**SPEC, "scheduling": {"affinity": {"nodeAffinity": "garbage"}}}

    async def scenario() -> None:
        async with running_operator():
            await create_dd(kmock, "bad", bad)
            dd = await _until(kmock, "bad", "ChildApplyFailed")
            message = cond(dd, "Degraded")["message"]  # type: ignore[index]
            assert "Deployment default/bad was refused: 422 Invalid" in message
            assert "nodeAffinity" in message and "is not of type 'object'" in message
            assert cond(dd, "Degraded")["status"] == "True"  # type: ignore[index]
            assert obj(kmock, DEPLOYMENTS, "bad") is None
            await merge_patch(dd_url(kmock, "bad"), {"spec": {"scheduling": {"affinity": None}}})
            await eventually(lambda: obj(kmock, DEPLOYMENTS, "bad"), what="Deployment")
            await eventually(lambda: _reason(kmock, "bad") not in (None, "ChildApplyFailed"),
                             what="recovered")

    await _run(scenario)


async def test_an_object_it_does_not_own_is_a_conflict_and_left_untouched(
        kmock: Emulator, kubeconfig: Path, operator_errors_only: Callable[[str], None]) -> None:
    operator_errors_only(RETRIED)
    theirs = await create(kmock, "/api/v1/namespaces/default/services", {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "taken", "labels": {
            "app": "someone-else"}},
        "spec": {"selector": {"app": "someone-else"}, "ports": [{"port": 80}]}})

    async def scenario() -> None:
        async with running_operator():
            await create_dd(kmock, "taken", SPEC)
            dd = await _until(kmock, "taken", "ChildConflict")
            message = cond(dd, "Ready")["message"]  # type: ignore[index]
            assert "Service default/taken already exists and is not owned" in message
            assert "it has no controller" in message and "left untouched" in message
            assert obj(kmock, SERVICES, "taken") == theirs  # not a byte changed
            assert obj(kmock, CONFIGMAPS, "taken-engine") is None  # nothing else applied
            assert obj(kmock, DEPLOYMENTS, "taken") is None
            # Its owner removes it: the next retry creates the operator's own.
            status, _ = await http("DELETE", f"{kmock.url}/api/v1/namespaces/default/services/taken")
            assert status == 200
            svc = await eventually(lambda: obj(kmock, SERVICES, "taken"), what="own Service")
            assert svc["metadata"]["ownerReferences"][0]["kind"] == "DiffusionDeployment"
            await eventually(lambda: _reason(kmock, "taken") != "ChildConflict", what="cleared")

    await _run(scenario)


def _writes(kmock: Emulator, since: int) -> list[str]:
    return [f"{c.method} {c.path}" for c in kmock.calls[since:] if c.by_operator
            and c.method in ("POST", "PUT", "PATCH", "DELETE")]


async def test_a_restarted_operator_changes_nothing(kmock: Emulator, kubeconfig: Path,
                                                    no_operator_errors: None) -> None:
    spec = {**SPEC, "replicas": 2}

    async def scenario() -> None:
        async with running_operator():
            await create_dd(kmock, "steady", spec)
            for resource, name in ((DEPLOYMENTS, "steady"), (PDBS, "steady"),
                                   (CONFIGMAPS, "steady-engine"), (SERVICES, "steady")):
                await eventually(lambda r=resource, n=name: obj(kmock, r, n), what=name)
            await eventually(lambda: _reason(kmock, "steady"), what="status")
        before = {r: obj(kmock, r, n)["metadata"]["resourceVersion"] for r, n in (
            (DEPLOYMENTS, "steady"), (PDBS, "steady"), (CONFIGMAPS, "steady-engine"),
            (SERVICES, "steady"))}
        status = obj(kmock, DD, "steady")["status"]
        mark = len(kmock.calls)
        async with running_operator():
            # The resume handler reads every child, then recomputes the status.
            def resumed() -> bool:
                calls = kmock.calls[mark:]
                read = [i for i, c in enumerate(calls) if c.by_operator and c.method == "GET"
                        and c.path.endswith("/configmaps/steady-engine")]
                return bool(read) and any(c.plural == "pods" and c.method == "GET"
                                          for c in calls[read[0]:] if c.by_operator)
            await eventually(resumed, what="resume")
            await eventually(lambda: any(c.path.endswith("/diffusiondeployments/steady") and
                                         c.method == "GET" and c.by_operator
                                         for c in kmock.calls[mark:]), what="status read")
        assert {r: obj(kmock, r, n)["metadata"]["resourceVersion"] for r, n in (
            (DEPLOYMENTS, "steady"), (PDBS, "steady"), (CONFIGMAPS, "steady-engine"),
            (SERVICES, "steady"))} == before
        assert obj(kmock, DD, "steady")["status"] == status
        # kopf may keep its own progress annotations on the object; nothing else is written.
        assert [w for w in _writes(kmock, mark)
                if not w.endswith("/diffusiondeployments/steady")] == []

    await _run(scenario)


async def test_cluster_wide_mode_reconciles_every_namespace(kmock: Emulator, kubeconfig: Path,
                                                            no_operator_errors: None) -> None:
    async def scenario() -> None:
        async with running_operator(clusterwide=True):
            await create_dd(kmock, "a", SPEC, namespace="default")
            await create_dd(kmock, "b", SPEC, namespace="team-b")
            await eventually(lambda: obj(kmock, DEPLOYMENTS, "a", "default"), what="a")
            await eventually(lambda: obj(kmock, DEPLOYMENTS, "b", "team-b"), what="b")
            await eventually(lambda: _reason(kmock, "b", namespace="team-b"), what="b status")
        watches = {c.path for c in kmock.calls if c.by_operator and ("watch", "true") in c.params}
        assert "/apis/ditserve.io/v1alpha1/diffusiondeployments" in watches  # no namespace

    await _run(scenario)


def test_the_rbac_check_refuses_what_the_chart_does_not_grant(kmock: Emulator,
                                                              tmp_path: Path) -> None:
    """Non-vacuous: a chart that watches another namespace does not allow the e2e calls."""
    from k8s.k8s_emulator import Call

    call = Call(method="GET", path="/apis/apps/v1/namespaces/default/deployments/x",
                action="fetch", group="apps", plural="deployments", namespace="default", name="x",
                subresource=None, params=(), user_agent="ditserve-operator")
    kmock.calls.append(call)
    elsewhere = template(tmp_path, {"operator": {"watchNamespaces": ["other"]}})
    assert refused_operator_calls(kmock, elsewhere) == [
        "get /apis/apps/v1/namespaces/default/deployments/x {}"]
    kmock.calls.clear()
    kmock.calls.append(Call(**{**call.__dict__, "path": "/api/v1/nodes/n", "group": "",
                               "plural": "nodes", "namespace": None, "method": "PATCH"}))
    no_labels = template(tmp_path, {"operator": {"labelCachedNodes": False}})
    assert refused_operator_calls(kmock, no_labels) == ["patch /api/v1/nodes/n {}"]
    kmock.calls.clear()
    kmock.calls.append(call)  # allowed by the default chart (the autouse check)


async def test_namespaced_mode_stays_within_its_role_bindings(
        kmock: Emulator, kubeconfig: Path, tmp_path: Path, no_operator_errors: None) -> None:
    async def scenario() -> None:
        async with running_operator(namespaces=("default",)):
            await create_dd(kmock, "ns", {**SPEC, "replicas": 2})
            await eventually(lambda: obj(kmock, PDBS, "ns"), what="PDB")
            await eventually(lambda: _reason(kmock, "ns"), what="status")
        chart = template(tmp_path, {"operator": {"watchNamespaces": ["default"]}})
        assert refused_operator_calls(kmock, chart) == []

    await _run(scenario)


async def test_watches_are_selected_on_the_server(kmock: Emulator, kubeconfig: Path,
                                                  no_operator_errors: None) -> None:
    async def scenario() -> None:
        async with running_operator():
            await create_dd(kmock, "sel", SPEC)
            await eventually(lambda: _reason(kmock, "sel"), what="status")
        watches = {(c.plural, dict(c.params).get("labelSelector"), dict(c.params).get("fieldSelector"))
                   for c in kmock.calls if c.by_operator and ("watch", "true") in c.params}
        managed = "app.kubernetes.io/managed-by=ditserve-operator"
        assert {("pods", managed, None), ("deployments", managed, None),
                ("leaderworkersets", managed, None),
                ("events", None, "involvedObject.kind=Pod,reason=FailedMount")} <= watches

    await _run(scenario)


async def test_a_mount_failure_is_degraded_as_soon_as_the_kubelet_says_so(
        kmock: Emulator, kubeconfig: Path, no_operator_errors: None) -> None:
    async def scenario() -> None:
        async with running_operator():
            await create_dd(kmock, "mnt", SPEC)
            await eventually(lambda: obj(kmock, DEPLOYMENTS, "mnt"), what="Deployment")
            pod = await create(kmock, "/api/v1/namespaces/default/pods", {
                "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "mnt-0", "labels": {
                    "app.kubernetes.io/name": "ditserve-engine", "app.kubernetes.io/instance": "mnt",
                    "app.kubernetes.io/managed-by": "ditserve-operator"}},
                "spec": {"containers": [{"name": "engine", "image": "x"}]},
                "status": {"phase": "Pending", "containerStatuses": [{
                    "name": "engine", "ready": False, "restartCount": 0, "image": "x",
                    "imageID": "", "state": {"waiting": {"reason": "PodInitializing"}}}]}})
            await create(kmock, "/api/v1/namespaces/default/events", {
                "apiVersion": "v1", "kind": "Event", "metadata": {"name": "mnt-0.1"},
                "involvedObject": {"kind": "Pod", "namespace": "default", "name": "mnt-0",
                                   "uid": pod["metadata"]["uid"]},
                "reason": "FailedMount", "type": "Warning",
                "message": 'MountVolume.SetUp failed for volume "model" : hostPath type check '
                           "failed: /mnt/models/tiny is not a directory"})
            dd = await _until(kmock, "mnt", "VolumeMountFailed", "Degraded")
            assert "/mnt/models/tiny is not a directory" in cond(dd, "Ready")["message"]  # type: ignore[index]

    await _run(scenario)


async def test_a_replica_across_nodes_is_a_leader_worker_set(kmock: Emulator, kubeconfig: Path,
                                                             no_operator_errors: None) -> None:
    async def scenario() -> None:
        async with running_operator():
            await create_dd(kmock, "big", {**SPEC, "parallelism": {"data": 16}})
            lws = await eventually(lambda: obj(kmock, LWS, "big-lws"), what="LeaderWorkerSet")
            assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
            assert obj(kmock, DEPLOYMENTS, "big") is None
            await merge_patch(f"{kmock.url}/apis/leaderworkerset.x-k8s.io/v1/namespaces/default/"
                              "leaderworkersets/big-lws/status",
                              {"status": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}})
            dd = await _until(kmock, "big", "AllReplicasReady")
            assert dd["status"]["topology"] == {"gpusPerPod": 8, "podsPerReplica": 2,
                                                "totalGPUs": 16}
            # Down to one node: a Deployment again, and the operator's LWS goes first.
            await merge_patch(dd_url(kmock, "big"), {"spec": {"parallelism": {"data": 4}}})
            await eventually(lambda: obj(kmock, DEPLOYMENTS, "big"), what="Deployment")
            assert obj(kmock, LWS, "big-lws") is None

    await _run(scenario)


class EmulatorWithoutLWS(Emulator):
    lws_installed = False


@pytest.mark.kmock(cls=EmulatorWithoutLWS)
async def test_without_the_lws_controller_the_condition_says_to_install_it(
        kmock: Emulator, kubeconfig: Path, operator_errors_only: Callable[[str], None]) -> None:
    operator_errors_only(RETRIED)

    async def scenario() -> None:
        async with running_operator():
            await create_dd(kmock, "big", {**SPEC, "parallelism": {"data": 16}})
            dd = await _until(kmock, "big", "ChildApplyFailed")
            assert "the LeaderWorkerSet API is not installed" in cond(dd, "Ready")["message"]  # type: ignore[index]

    await _run(scenario)


async def test_the_disruption_budget_follows_the_replicas(kmock: Emulator, kubeconfig: Path,
                                                          no_operator_errors: None) -> None:
    async def scenario() -> None:
        async with running_operator():
            await create_dd(kmock, "pdb", {**SPEC, "replicas": 3})
            pdb = await eventually(lambda: obj(kmock, PDBS, "pdb"), what="PDB")
            assert pdb["spec"]["maxUnavailable"] == 1
            await merge_patch(dd_url(kmock, "pdb"), {"spec": {"replicas": 1}})
            await eventually(lambda: obj(kmock, DEPLOYMENTS, "pdb")["spec"]["replicas"] == 1,
                             what="scaled")
            assert obj(kmock, PDBS, "pdb") is None  # deleted before the children were applied

    await _run(scenario)


async def test_node_caches_become_node_labels_and_a_status_summary(
        kmock: Emulator, kubeconfig: Path, no_operator_errors: None) -> None:
    key = cache_label_key("/mnt/models/tiny", "bfloat16")
    nodecache_url = "/apis/ditserve.io/v1alpha1/nodecaches/gpu-1"

    def labels() -> dict[str, str]:
        return dict(obj(kmock, NODES, "gpu-1", None)["metadata"].get("labels") or {})

    async def report(*entries: dict[str, Any]) -> None:
        await merge_patch(f"{kmock.url}{nodecache_url}/status", {"status": {
            "heartbeatTime": handlers._now(), "entries": list(entries)}})

    async def scenario() -> None:
        await create(kmock, "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {
            "name": "gpu-1", "labels": {"kubernetes.io/hostname": "gpu-1"}}})
        await create(kmock, "/apis/ditserve.io/v1alpha1/nodecaches", {
            "apiVersion": "ditserve.io/v1alpha1", "kind": "NodeCache",
            "metadata": {"name": "gpu-1"}})
        async with running_operator():
            await create_dd(kmock, "cached", SPEC)
            await eventually(lambda: _reason(kmock, "cached"), what="status")
            await report({"state": "Ready", "model": "/mnt/models/tiny", "dtype": "bfloat16",
                          "key": "a" * 64})
            await eventually(lambda: labels().get(key) == "Ready", what="node label")
            dd = await eventually(
                lambda: (d := obj(kmock, DD, "cached")) and (d["status"].get("nodeCache") or {})
                .get("readyNodes") == 1 and d, what="summary")
            assert dd["status"]["nodeCache"]["nodes"] == [{"name": "gpu-1", "state": "Ready"}]
            assert labels()["kubernetes.io/hostname"] == "gpu-1"  # other labels untouched
            await report({"state": "Failed", "model": "/mnt/models/tiny", "dtype": "bfloat16",
                          "message": "no space left on device"})
            await eventually(lambda: key not in labels(), what="label removed")
            await eventually(lambda: (obj(kmock, DD, "cached")["status"].get("nodeCache") or {})
                             .get("failedNodes") == 1, what="failed summary")

    await _run(scenario)
