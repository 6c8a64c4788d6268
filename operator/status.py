"""A DiffusionDeployment's status, derived from its spec, its workload and its pods.

Owns ``compute_status``: one pure function of the observed world (plus an injected ``now``)
that both the reconcile handler and the watch handlers call, so every writer computes the
same answer. The world is the owner, its workload (Deployment or LeaderWorkerSet), its pods,
the Warning events about them, the last failure to apply its children (the handlers keep it)
and the nodes' NodeCache objects. Conditions follow metav1.Condition; ``lastTransitionTime``
only moves when a condition's status changes. Every field written here is declared in the
CRD's schema (anything undeclared would be pruned by the API server).

Reasons, by condition (pod failure reasons: see ``pod_health``):
  Ready        True: AllReplicasReady. False: InvalidSpec, ChildConflict, ChildApplyFailed,
               ChildrenMissing, ScaledToZero, a pod failure, WaitingForCache,
               ReplicasNotReady.
  Progressing  True: Creating, RollingOut. False: RolloutComplete, ProgressDeadlineExceeded,
               InvalidSpec, ChildConflict, ChildApplyFailed.
  CacheReady   True: CacheEntryReady, CacheDisabled. False: CacheWarming, ModelDownloadFailed,
               CacheEnsureFailed.
               Unknown: NoPods, PodsPending.
  Degraded     True: InvalidSpec, ChildConflict, ChildApplyFailed, a pod failure,
               PodCreateFailed (the workload's controller cannot create pods: PodSecurity,
               ResourceQuota, LimitRange; its own message), ProgressDeadlineExceeded.
               False: AsExpected.
``lastRepair`` names the children the operator last put back after someone edited or
deleted them (drift).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ditserve.operator import nodecache, render
from ditserve.operator.errors import InvalidSpecError
from ditserve.operator.judge import validate
from ditserve.operator.pod_health import PodFindings, inspect_pods
from ditserve.operator.policy import AdminPolicy
from ditserve.operator.spec import DeploymentSpec

CONDITION_TYPES = ("Ready", "Progressing", "CacheReady", "Degraded")


@dataclass(frozen=True)
class ApplyFailure:
    """Why the children are not as rendered (ChildConflict or ChildApplyFailed), at which
    generation of the owner; kept by the handlers between their status writes."""

    reason: str
    message: str
    generation: int


@dataclass(frozen=True)
class Repair:
    """Children put back after drift (descriptions), and when."""

    children: tuple[str, ...]
    time: str

    def as_status(self) -> dict[str, Any]:
        return {"time": self.time, "children": list(self.children),
                "message": "re-applied after a change outside the operator: "
                           + ", ".join(self.children)}


@dataclass(frozen=True)
class Condition:
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str


def _counts(deployment: Mapping[str, Any] | None) -> tuple[int, int, int]:
    st = (deployment or {}).get("status") or {}
    return (int(st.get("replicas") or 0), int(st.get("readyReplicas") or 0),
            int(st.get("updatedReplicas") or 0))


def _deadline_exceeded(deployment: Mapping[str, Any]) -> str | None:
    for cond in (deployment.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return str(cond.get("message") or "the rollout made no progress in time")
    return None


def _create_failure(workload: Mapping[str, Any]) -> str | None:
    """The controller's message when it cannot create pods (ReplicaFailure=True): admission
    refused them (PodSecurity, ResourceQuota, LimitRange), so none will ever start."""
    for cond in (workload.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            return str(cond.get("message") or cond.get("reason") or "pods cannot be created")
    return None


def _failure(findings: PodFindings, deployment: Mapping[str, Any]) -> tuple[str, str] | None:
    """The worst current failure, as (reason, message)."""
    worst = findings.worst()
    if worst is not None:
        return worst
    refused = _create_failure(deployment)
    if refused:
        return "PodCreateFailed", f"the workload's controller cannot create pods: {refused}"
    deadline = _deadline_exceeded(deployment)
    return ("ProgressDeadlineExceeded", deadline) if deadline else None


def _conditions_valid(spec: DeploymentSpec, generation: int, applied: int | None,
                      deployment: Mapping[str, Any] | None, pods: Sequence[Mapping[str, Any]],
                      events: Iterable[Mapping[str, Any]],
                      ) -> tuple[list[Condition], tuple[str, str] | None]:
    if deployment is None:
        msg = "the engine workload does not exist yet"
        return [Condition("Ready", "False", "ChildrenMissing", msg),
                Condition("Progressing", "True", "Creating", msg),
                Condition("CacheReady", "Unknown", "NoPods", "no engine pods yet")
                if spec.cache.enabled else
                Condition("CacheReady", "True", "CacheDisabled", "cache.mode is None"),
                Condition("Degraded", "False", "AsExpected", "no failures observed")], None
    want = spec.replicas
    total, ready, updated = _counts(deployment)
    findings = inspect_pods(pods, events)
    failure = _failure(findings, deployment)
    counts = f"{ready}/{want} replicas ready"

    if want == 0:
        ready_c = Condition("Ready", "False", "ScaledToZero", "spec.replicas is 0")
    elif ready >= want:
        ready_c = Condition("Ready", "True", "AllReplicasReady", counts)
    elif failure and failure[0] != "ProgressDeadlineExceeded":
        ready_c = Condition("Ready", "False", failure[0], f"{counts}; {failure[1]}")
    elif findings.warming:
        ready_c = Condition("Ready", "False", "WaitingForCache",
                            f"{counts}; {findings.warming} pod(s) waiting for the model's cache entry")
    else:
        ready_c = Condition("Ready", "False", "ReplicasNotReady", counts)

    dep_meta_gen = int((deployment.get("metadata") or {}).get("generation") or 0)
    dep_seen_gen = int((deployment.get("status") or {}).get("observedGeneration") or 0)
    rolling = (
        (applied is not None and applied < generation)
        or dep_seen_gen < dep_meta_gen
        or updated < want or total > want or ready < want
    )
    if _deadline_exceeded(deployment):
        prog = Condition("Progressing", "False", "ProgressDeadlineExceeded",
                         _deadline_exceeded(deployment) or "")
    elif rolling:
        prog = Condition("Progressing", "True", "RollingOut",
                         f"{updated}/{want} updated, {ready}/{want} ready, {total} pods")
    else:
        prog = Condition("Progressing", "False", "RolloutComplete", f"{want} replicas up to date")

    if not spec.cache.enabled:
        cache = Condition("CacheReady", "True", "CacheDisabled", "cache.mode is None")
    elif "ModelDownloadFailed" in findings.failures:
        cache = Condition("CacheReady", "False", "ModelDownloadFailed",
                          findings.failures["ModelDownloadFailed"])
    elif "CacheEnsureFailed" in findings.failures:
        cache = Condition("CacheReady", "False", "CacheEnsureFailed",
                          findings.failures["CacheEnsureFailed"])
    elif findings.warming:
        doing = ("pulling the model or running cachectl ensure" if spec.model.uri
                 else "running cachectl ensure")
        cache = Condition("CacheReady", "False", "CacheWarming",
                          f"{findings.warming} pod(s) {doing}")
    elif findings.ensured:
        cache = Condition("CacheReady", "True", "CacheEntryReady",
                          f"{findings.ensured} pod(s) started from a published cache entry")
    elif pods:
        cache = Condition("CacheReady", "Unknown", "PodsPending", "engine pods have not started yet")
    else:
        cache = Condition("CacheReady", "Unknown", "NoPods", "no engine pods")

    degraded = (Condition("Degraded", "True", failure[0], failure[1]) if failure else
                Condition("Degraded", "False", "AsExpected", "no failures observed"))
    return [ready_c, prog, cache, degraded], failure


def _merge(conditions: list[Condition], previous: Sequence[Mapping[str, Any]], *,
           now: str, generation: int) -> list[dict[str, Any]]:
    before = {c.get("type"): c for c in previous or []}
    out = []
    for cond in conditions:
        old = before.get(cond.type) or {}
        moved = old.get("status") != cond.status or not old.get("lastTransitionTime")
        out.append({"type": cond.type, "status": cond.status, "reason": cond.reason,
                    "message": cond.message, "observedGeneration": generation,
                    "lastTransitionTime": now if moved else old["lastTransitionTime"]})
    return out


def compute_status(body: Mapping[str, Any], workload: Mapping[str, Any] | None,
                   pods: Sequence[Mapping[str, Any]], *, now: str,
                   events: Iterable[Mapping[str, Any]] = (),
                   apply_failure: ApplyFailure | None = None,
                   nodecaches: Iterable[Mapping[str, Any]] | None = None,
                   policy: AdminPolicy | None = None,
                   repair: Repair | None = None) -> dict[str, Any]:
    """The whole ``status`` of the DiffusionDeployment ``body`` (see the module doc).

    ``nodecaches``: every NodeCache object, or None when the operator does not read them;
    ``policy``: the admin's (default: the chart's defaults); ``repair``: the last drift repair.
    """
    meta = body.get("metadata", {})
    previous: Mapping[str, Any] = body.get("status") or {}
    generation = int(meta.get("generation") or 1)
    name = meta.get("name", "")
    owner = render.Owner.from_body(body)
    try:
        spec, _ = validate(body.get("spec"), name=name, policy=policy)
    except InvalidSpecError as e:
        return _judged_failure(("InvalidSpec", str(e)), workload, previous, name=name,
                               generation=generation, now=now)
    if apply_failure is not None and apply_failure.generation == generation:
        return _judged_failure((apply_failure.reason, apply_failure.message), workload,
                               previous, name=name, generation=generation, now=now)

    applied_raw = ((workload or {}).get("metadata") or {}).get("annotations", {}).get(
        render.GENERATION_ANNOTATION)
    applied = int(applied_raw) if applied_raw else None
    observed = applied if applied is not None else int(previous.get("observedGeneration") or 0)
    conds, failure = _conditions_valid(spec, generation, applied, workload, pods, events)
    par = spec.parallelism
    status: dict[str, Any] = {
        **_counters(workload, name),
        "observedGeneration": observed,
        "conditions": _merge(conds, previous.get("conditions") or [], now=now, generation=observed),
        "topology": {"gpusPerPod": par.gpus_per_pod, "podsPerReplica": par.pods_per_replica,
                     "totalGPUs": par.gpus_per_replica * spec.replicas},
        "endpoint": {"url": render.endpoint_url(owner, spec)},
    }
    if nodecaches is not None and spec.cache.enabled and spec.model.host_path:
        status["nodeCache"] = nodecache.summarize(nodecaches, model=spec.model.host_path,
                                                  dtype=spec.model.dtype, now=now)
    last = _last_failure(failure, previous, now)
    if last:
        status["lastFailure"] = last
    if repair is not None:
        status["lastRepair"] = repair.as_status()
    elif previous.get("lastRepair"):
        status["lastRepair"] = dict(previous["lastRepair"])
    return status


def _judged_failure(failure: tuple[str, str], workload: Mapping[str, Any] | None,
                    previous: Mapping[str, Any], *, name: str, generation: int,
                    now: str) -> dict[str, Any]:
    """The status of a generation the operator judged and could not roll out (an invalid spec,
    a child it may not or could not write): the children are left as they were, and
    observedGeneration says the current spec was seen."""
    reason, message = failure
    conds = [Condition("Ready", "False", reason, message),
             Condition("Progressing", "False", reason, "fix the cause to roll out"),
             Condition("Degraded", "True", reason, message)]
    keep = [c for c in previous.get("conditions") or [] if c.get("type") == "CacheReady"]
    merged = _merge(conds, previous.get("conditions") or [], now=now, generation=generation)
    out = {**_counters(workload, name), "observedGeneration": generation,
           "conditions": merged + keep, "lastFailure": _last_failure(failure, previous, now)}
    for key in ("topology", "endpoint", "nodeCache", "lastRepair"):  # still describe what runs
        if key in previous:
            out[key] = previous[key]
    return out


def _counters(deployment: Mapping[str, Any] | None, name: str) -> dict[str, Any]:
    total, ready, updated = _counts(deployment)
    return {"replicas": total, "readyReplicas": ready, "updatedReplicas": updated,
            "selector": render.selector_string(name)}


def _last_failure(failure: tuple[str, str] | None, previous: Mapping[str, Any],
                  now: str) -> dict[str, Any] | None:
    old = previous.get("lastFailure") or None
    if failure is None:
        return dict(old) if old else None
    reason, message = failure
    if old and old.get("reason") == reason and old.get("message") == message:
        return dict(old)  # the same failure still going on: keep when it started
    return {"reason": reason, "message": message, "time": now}


def status_changed(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Whether writing ``new`` would change anything (skip no-op PATCHes)."""
    old = old or {}
    return any(old.get(key) != value for key, value in new.items())
