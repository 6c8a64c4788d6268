"""compute_status: conditions, reasons, counters and transition times from observed objects
(a pure function with an injected clock)."""

from __future__ import annotations

from typing import Any

import pytest

from ditserve.operator.render import GENERATION_ANNOTATION
from ditserve.operator.status import compute_status, status_changed

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"
SPEC = {"replicas": 2, "model": {"hostPath": "/mnt/models/m", "sizeGiB": 4}, "parallelism": {"sequence": 2}}


def dd(spec: dict[str, Any] | None = None, generation: int = 3,
       status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "flux", "namespace": "ml", "generation": generation, "uid": "u"},
            "spec": spec or SPEC, "status": status or {}}


def deployment(*, applied: int = 3, replicas: int = 2, ready: int = 0, updated: int = 2,
               conditions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"metadata": {"generation": 5, "annotations": {GENERATION_ANNOTATION: str(applied)}},
            "status": {"observedGeneration": 5, "replicas": replicas, "readyReplicas": ready,
                       "updatedReplicas": updated, "conditions": conditions or []}}


def pod(name: str = "p", *, init: dict[str, Any] | None = None, engine: dict[str, Any] | None = None,
        scheduled: dict[str, Any] | None = None, last_init: dict[str, Any] | None = None) -> dict:
    status: dict[str, Any] = {"conditions": [scheduled] if scheduled else []}
    if init is not None:
        status["initContainerStatuses"] = [{"name": "cachectl-ensure", "state": init,
                                            "lastState": last_init or {}}]
    if engine is not None:
        status["containerStatuses"] = [{"name": "engine", "state": engine, "restartCount": 4,
                                        "ready": "running" in engine}]
    return {"metadata": {"name": name}, "status": status}


def conds(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


RUNNING = {"running": {"startedAt": T0}}
DONE = {"terminated": {"exitCode": 0}}


def test_all_ready() -> None:
    status = compute_status(dd(), deployment(ready=2), [pod(init=DONE, engine=RUNNING)] * 2, now=T0)
    assert conds(status) == {"Ready": ("True", "AllReplicasReady"),
                             "Progressing": ("False", "RolloutComplete"),
                             "CacheReady": ("True", "CacheEntryReady"),
                             "Degraded": ("False", "AsExpected")}
    assert status["replicas"] == 2 and status["readyReplicas"] == 2
    assert status["updatedReplicas"] == 2
    assert status["observedGeneration"] == 3
    assert status["topology"] == {"gpusPerPod": 2, "podsPerReplica": 1, "totalGPUs": 4}
    assert status["endpoint"] == {"url": "http://flux.ml.svc:8000"}
    assert status["selector"] == "app.kubernetes.io/name=ditserve-engine,app.kubernetes.io/instance=flux"
    assert all(c["lastTransitionTime"] == T0 and c["observedGeneration"] == 3
               for c in status["conditions"])
    assert "lastFailure" not in status


def test_transition_time_moves_only_when_the_status_flips() -> None:
    first = compute_status(dd(), deployment(ready=1), [], now=T0)
    second = compute_status(dd(status=first), deployment(ready=1, updated=2), [], now=T1)
    assert {c["type"]: c["lastTransitionTime"] for c in second["conditions"]}["Ready"] == T0
    third = compute_status(dd(status=second), deployment(ready=2), [], now=T1)
    times = {c["type"]: c["lastTransitionTime"] for c in third["conditions"]}
    assert times["Ready"] == T1 and times["Degraded"] == T0
    assert not status_changed(third, compute_status(dd(status=third), deployment(ready=2), [], now=T1))


def test_new_generation_not_yet_applied_is_progressing() -> None:
    status = compute_status(dd(generation=4), deployment(applied=3, ready=2), [], now=T0)
    assert conds(status)["Progressing"] == ("True", "RollingOut")
    assert status["observedGeneration"] == 3  # what the children reflect


@pytest.mark.parametrize(("pods", "ready", "cache", "degraded"), [
    ([pod(init=RUNNING)], ("False", "WaitingForCache"), ("False", "CacheWarming"),
     ("False", "AsExpected")),
    ([pod(init={"terminated": {"exitCode": 3, "message": "no space left"}})],
     ("False", "CacheEnsureFailed"), ("False", "CacheEnsureFailed"), ("True", "CacheEnsureFailed")),
    ([pod(init={"waiting": {"reason": "CrashLoopBackOff"}},
          last_init={"terminated": {"exitCode": 1}})],
     ("False", "CacheEnsureFailed"), ("False", "CacheEnsureFailed"), ("True", "CacheEnsureFailed")),
    ([pod(init={"waiting": {"reason": "ImagePullBackOff", "message": "not found"}})],
     ("False", "ImagePullFailed"), ("Unknown", "PodsPending"), ("True", "ImagePullFailed")),
    ([pod(init=DONE, engine={"waiting": {"reason": "CrashLoopBackOff"}})],
     ("False", "CrashLoopBackOff"), ("True", "CacheEntryReady"), ("True", "CrashLoopBackOff")),
    ([pod(scheduled={"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                     "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."})],
     ("False", "Unschedulable"), ("Unknown", "PodsPending"), ("True", "Unschedulable")),
    ([pod(init=DONE, engine={"running": {}})], ("False", "ReplicasNotReady"),
     ("True", "CacheEntryReady"), ("False", "AsExpected")),
    ([], ("False", "ReplicasNotReady"), ("Unknown", "NoPods"), ("False", "AsExpected")),
])
def test_pod_findings_become_precise_reasons(pods: list[dict], ready: tuple, cache: tuple,
                                             degraded: tuple) -> None:
    status = compute_status(dd(), deployment(ready=0), pods, now=T0)
    got = conds(status)
    assert (got["Ready"], got["CacheReady"], got["Degraded"]) == (ready, cache, degraded)
    if degraded[0] == "True":
        assert status["lastFailure"]["reason"] == degraded[1]
        assert status["lastFailure"]["time"] == T0


def test_unschedulable_message_names_the_missing_gpus() -> None:
    scheduled = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}
    status = compute_status(dd(), deployment(), [pod("flux-abc", scheduled=scheduled)], now=T0)
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert "flux-abc" in ready["message"] and "Insufficient nvidia.com/gpu" in ready["message"]


def test_progress_deadline_exceeded_is_degraded() -> None:
    dep = deployment(ready=1, conditions=[{"type": "Progressing", "status": "False",
                                           "reason": "ProgressDeadlineExceeded",
                                           "message": "ReplicaSet flux-1 has timed out"}])
    got = conds(compute_status(dd(), dep, [], now=T0))
    assert got["Progressing"] == ("False", "ProgressDeadlineExceeded")
    assert got["Degraded"] == ("True", "ProgressDeadlineExceeded")


def test_last_failure_keeps_its_start_time_and_survives_recovery() -> None:
    crashing = [pod(init=DONE, engine={"waiting": {"reason": "CrashLoopBackOff"}})]
    first = compute_status(dd(), deployment(), crashing, now=T0)
    again = compute_status(dd(status=first), deployment(), crashing, now=T1)
    assert again["lastFailure"]["time"] == T0
    healed = compute_status(dd(status=again), deployment(ready=2), [], now=T1)
    assert conds(healed)["Degraded"] == ("False", "AsExpected")
    assert healed["lastFailure"] == first["lastFailure"]


def test_scaled_to_zero_and_cache_disabled() -> None:
    spec = {**SPEC, "replicas": 0, "cache": {"mode": "None"}}
    got = conds(compute_status(dd(spec), deployment(replicas=0, updated=0), [], now=T0))
    assert got["Ready"] == ("False", "ScaledToZero")
    assert got["CacheReady"] == ("True", "CacheDisabled")
    assert got["Progressing"] == ("False", "RolloutComplete")


def test_missing_deployment_and_invalid_spec() -> None:
    got = conds(compute_status(dd(), None, [], now=T0))
    assert got["Ready"] == ("False", "ChildrenMissing")
    bad = {**SPEC, "offload": {"residentLayers": 3}}
    status = compute_status(dd(bad, generation=9), deployment(ready=2), [], now=T0)
    got = conds(status)
    assert got["Ready"] == ("False", "InvalidSpec") and got["Degraded"] == ("True", "InvalidSpec")
    assert status["observedGeneration"] == 9
    assert "offload.resident_layers only apply with offload enabled" in status["lastFailure"]["message"]


def _engine(state: dict[str, Any], *, last: dict[str, Any] | None = None, ready: bool = False,
            name: str = "engine") -> dict[str, Any]:
    return {"name": name, "state": state, "lastState": last or {}, "ready": ready,
            "restartCount": 1}


def _pod_with(containers: list[dict[str, Any]], *, phase: str = "Running", uid: str = "pu",
              limit: str = "40960Mi") -> dict[str, Any]:
    return {"metadata": {"name": "flux-0", "uid": uid},
            "spec": {"containers": [{"name": "engine", "resources": {"limits": {"memory": limit}}}]},
            "status": {"phase": phase, "containerStatuses": containers}}


@pytest.mark.parametrize(("container", "reason", "said"), [
    (_engine({"waiting": {"reason": "CreateContainerConfigError",
                          "message": 'secret "flux-key" not found'}}),
     "ContainerConfigError", 'secret "flux-key" not found'),
    (_engine({"waiting": {"reason": "RunContainerError", "message": "exec: ditserve: not found"}}),
     "ContainerStartFailed", "exec: ditserve: not found"),
    # The first OOM kill, before any back-off: the engine is running again but not ready.
    (_engine({"running": {}}, last={"terminated": {"reason": "OOMKilled", "exitCode": 137}}),
     "OOMKilled", "exceeding its memory limit (40960Mi"),
    (_engine({"terminated": {"reason": "OOMKilled", "exitCode": 137}}), "OOMKilled",
     "raise engine.resources.memory"),
])
def test_container_failures_are_degraded_at_once(container: dict[str, Any], reason: str,
                                                 said: str) -> None:
    status = compute_status(dd(), deployment(), [_pod_with([container])], now=T0)
    got = {c["type"]: c for c in status["conditions"]}
    assert (got["Degraded"]["status"], got["Degraded"]["reason"]) == ("True", reason)
    assert got["Ready"]["reason"] == reason and said in got["Degraded"]["message"]


def test_an_old_oom_kill_of_a_ready_engine_is_history() -> None:
    healthy = _engine({"running": {}}, last={"terminated": {"reason": "OOMKilled"}}, ready=True)
    status = compute_status(dd(), deployment(ready=2), [_pod_with([healthy])] * 2, now=T0)
    assert conds(status)["Degraded"] == ("False", "AsExpected")


def test_mount_failures_of_pods_that_have_not_started() -> None:
    pending = _pod_with([_engine({"waiting": {"reason": "ContainerCreating"}})], phase="Pending")
    event = {"involvedObject": {"kind": "Pod", "name": "flux-0", "uid": "pu"},
             "reason": "FailedMount", "type": "Warning",
             "message": 'MountVolume.SetUp failed for volume "model" : hostPath type check '
                        "failed: /mnt/models/flux is not a directory"}
    status = compute_status(dd(), deployment(), [pending], now=T0, events=[event])
    got = {c["type"]: c for c in status["conditions"]}
    assert got["Degraded"]["reason"] == "VolumeMountFailed"
    assert "/mnt/models/flux is not a directory" in got["Degraded"]["message"]
    # The same event about a pod that has started since (or another pod) is old news.
    running = _pod_with([_engine({"running": {}})])
    assert conds(compute_status(dd(), deployment(), [running], now=T0, events=[event]))[
        "Degraded"] == ("False", "AsExpected")
    other = {**event, "involvedObject": {"kind": "Pod", "name": "x", "uid": "other"}}
    assert conds(compute_status(dd(), deployment(), [pending], now=T0, events=[other]))[
        "Degraded"] == ("False", "AsExpected")


def test_apply_failures_of_this_generation_are_conditions() -> None:
    from ditserve.operator.status import ApplyFailure

    failure = ApplyFailure("ChildConflict", "Service ml/flux already exists and is not owned", 3)
    status = compute_status(dd(), deployment(ready=2), [], now=T0, apply_failure=failure)
    got = {c["type"]: c for c in status["conditions"]}
    for ctype in ("Ready", "Degraded"):
        assert got[ctype]["reason"] == "ChildConflict"
        assert "Service ml/flux already exists" in got[ctype]["message"]
    assert got["Progressing"]["status"] == "False"
    assert status["observedGeneration"] == 3 and status["lastFailure"]["reason"] == "ChildConflict"
    assert status["readyReplicas"] == 2  # what runs is still reported
    stale = ApplyFailure("ChildApplyFailed", "refused", 2)  # an older generation's: moot
    assert conds(compute_status(dd(), deployment(ready=2), [], now=T0, apply_failure=stale))[
        "Ready"] == ("True", "AllReplicasReady")


def test_leader_worker_set_counts_groups_and_topology_spans_nodes() -> None:
    spec = {"replicas": 2, "model": {"hostPath": "/mnt/models/m"}, "parallelism": {"data": 16}}
    lws = {"metadata": {"generation": 1, "annotations": {GENERATION_ANNOTATION: "3"}},
           "status": {"observedGeneration": 1, "replicas": 2, "readyReplicas": 2,
                      "updatedReplicas": 2}}
    status = compute_status(dd(spec), lws, [pod(init=DONE, engine=RUNNING)] * 4, now=T0)
    assert conds(status)["Ready"] == ("True", "AllReplicasReady")
    assert status["topology"] == {"gpusPerPod": 8, "podsPerReplica": 2, "totalGPUs": 32}


def test_node_cache_summary_for_host_path_models() -> None:
    nodecaches = [{"metadata": {"name": "gpu-1"}, "status": {
        "heartbeatTime": T0, "entries": [{"state": "Ready", "model": "/mnt/models/m", "dtype": "bfloat16"}]}}]
    status = compute_status(dd(), deployment(), [], now=T0, nodecaches=nodecaches)
    assert status["nodeCache"]["readyNodes"] == 1
    assert status["nodeCache"]["nodes"] == [{"name": "gpu-1", "state": "Ready"}]
    assert "nodeCache" not in compute_status(dd(), deployment(), [], now=T0)  # not read
    pvc = {**SPEC, "model": {"persistentVolumeClaim": {"claimName": "m"}}}
    assert "nodeCache" not in compute_status(dd(pvc), deployment(), [], now=T0,
                                             nodecaches=nodecaches)
