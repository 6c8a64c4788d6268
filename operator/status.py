"""A DiffusionDeployment's status, derived from its spec, its child Deployment and its pods.

Owns ``compute_status``: one pure function of the observed world (plus an injected ``now``)
that both the reconcile handler and the child-watch handler call, so every writer computes
the same answer. Conditions follow metav1.Condition; ``lastTransitionTime`` only moves when
a condition's status changes. Every field written here is declared in the CRD's schema
(anything undeclared would be pruned by the API server).

Reasons, by condition:
  Ready        True: AllReplicasReady. False: InvalidSpec, ChildrenMissing, ScaledToZero,
               ImagePullFailed, CacheEnsureFailed, CrashLoopBackOff, Unschedulable,
               WaitingForCache, ReplicasNotReady.
  Progressing  True: Creating, RollingOut. False: RolloutComplete, ProgressDeadlineExceeded,
               InvalidSpec.
  CacheReady   True: CacheEntryReady, CacheDisabled. False: CacheWarming, CacheEnsureFailed.
               Unknown: NoPods, PodsPending.
  Degraded     True: InvalidSpec, ProgressDeadlineExceeded, ImagePullFailed,
               CacheEnsureFailed, CrashLoopBackOff, Unschedulable. False: AsExpected.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ditserve.operator import pod as podlib
from ditserve.operator import render
from ditserve.operator.errors import InvalidSpecError
from ditserve.operator.spec import DeploymentSpec, validate

CONDITION_TYPES = ("Ready", "Progressing", "CacheReady", "Degraded")
_PULL_FAILURES = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName"}


@dataclass(frozen=True)
class Condition:
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str


@dataclass(frozen=True)
class PodFindings:
    """What the pods say, worst first; each field is a message or None."""

    image_pull: str | None = None
    ensure_failed: str | None = None
    crash_loop: str | None = None
    unschedulable: str | None = None
    warming: int = 0
    ensured: int = 0
    pending: int = 0


def _container_statuses(pod: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    return list(pod.get("status", {}).get(key) or [])


def inspect_pods(pods: Sequence[Mapping[str, Any]]) -> PodFindings:
    """Classify the engine pods: image pulls, cache init, crash loops, scheduling."""
    image_pull = ensure_failed = crash_loop = unschedulable = None
    warming = ensured = pending = 0
    for pod in pods:
        name = pod.get("metadata", {}).get("name", "?")
        for cond in pod.get("status", {}).get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                unschedulable = unschedulable or f"pod {name}: {cond.get('message') or cond.get('reason')}"
        ensure_state = None
        for st in _container_statuses(pod, "initContainerStatuses"):
            if st.get("name") != podlib.ENSURE_CONTAINER:
                continue
            state, last = st.get("state") or {}, st.get("lastState") or {}
            waiting = state.get("waiting") or {}
            failed = (state.get("terminated") or {}).get("exitCode", 0) != 0 or (
                waiting.get("reason") == "CrashLoopBackOff"
                and (last.get("terminated") or {}).get("exitCode", 0) != 0)
            if waiting.get("reason") in _PULL_FAILURES:
                image_pull = image_pull or f"pod {name}: {waiting.get('message') or waiting['reason']}"
            elif failed:
                term = state.get("terminated") or last.get("terminated") or {}
                ensure_failed = ensure_failed or (
                    f"pod {name}: cachectl ensure exited {term.get('exitCode')}: "
                    f"{term.get('message') or term.get('reason') or 'see its logs'}")
                ensure_state = "failed"
            elif "running" in state:
                ensure_state = "warming"
            elif "terminated" in state:
                ensure_state = "done"
        for st in _container_statuses(pod, "containerStatuses"):
            if st.get("name") != podlib.ENGINE_CONTAINER:
                continue
            waiting = (st.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in _PULL_FAILURES:
                image_pull = image_pull or f"pod {name}: {waiting.get('message') or waiting['reason']}"
            elif waiting.get("reason") == "CrashLoopBackOff":
                crash_loop = crash_loop or (
                    f"pod {name}: engine restarted {st.get('restartCount', 0)} times: "
                    f"{waiting.get('message') or 'see its logs'}")
            if st.get("ready") or "running" in (st.get("state") or {}):
                ensure_state = ensure_state or "done"  # engines only start after the init
        if ensure_state == "warming":
            warming += 1
        elif ensure_state == "done":
            ensured += 1
        elif ensure_state is None:
            pending += 1
    return PodFindings(image_pull, ensure_failed, crash_loop, unschedulable, warming, ensured,
                       pending)


def _counts(deployment: Mapping[str, Any] | None) -> tuple[int, int, int]:
    st = (deployment or {}).get("status") or {}
    return (int(st.get("replicas") or 0), int(st.get("readyReplicas") or 0),
            int(st.get("updatedReplicas") or 0))


def _deadline_exceeded(deployment: Mapping[str, Any]) -> str | None:
    for cond in (deployment.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return str(cond.get("message") or "the rollout made no progress in time")
    return None


def _failure(findings: PodFindings, deployment: Mapping[str, Any]) -> tuple[str, str] | None:
    """The worst current failure, as (reason, message)."""
    for reason, message in (
        ("ImagePullFailed", findings.image_pull),
        ("CacheEnsureFailed", findings.ensure_failed),
        ("CrashLoopBackOff", findings.crash_loop),
        ("Unschedulable", findings.unschedulable),
        ("ProgressDeadlineExceeded", _deadline_exceeded(deployment)),
    ):
        if message:
            return reason, message
    return None


def _conditions_valid(spec: DeploymentSpec, generation: int, applied: int | None,
                      deployment: Mapping[str, Any] | None,
                      pods: Sequence[Mapping[str, Any]]) -> tuple[list[Condition], tuple[str, str] | None]:
    if deployment is None:
        msg = "the engine Deployment does not exist yet"
        return [Condition("Ready", "False", "ChildrenMissing", msg),
                Condition("Progressing", "True", "Creating", msg),
                Condition("CacheReady", "Unknown", "NoPods", "no engine pods yet")
                if spec.cache.enabled else
                Condition("CacheReady", "True", "CacheDisabled", "cache.mode is None"),
                Condition("Degraded", "False", "AsExpected", "no failures observed")], None
    want = spec.replicas
    total, ready, updated = _counts(deployment)
    findings = inspect_pods(pods)
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
    elif findings.ensure_failed:
        cache = Condition("CacheReady", "False", "CacheEnsureFailed", findings.ensure_failed)
    elif findings.warming:
        cache = Condition("CacheReady", "False", "CacheWarming",
                          f"{findings.warming} pod(s) running cachectl ensure")
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


def compute_status(body: Mapping[str, Any], deployment: Mapping[str, Any] | None,
                   pods: Sequence[Mapping[str, Any]], *, now: str) -> dict[str, Any]:
    """The whole ``status`` of the DiffusionDeployment ``body`` (see the module doc)."""
    meta = body.get("metadata", {})
    previous: Mapping[str, Any] = body.get("status") or {}
    generation = int(meta.get("generation") or 1)
    name = meta.get("name", "")
    owner = render.Owner.from_body(body)
    try:
        spec, _ = validate(body.get("spec"))
    except InvalidSpecError as e:
        # Judged at this generation: observedGeneration says the current spec was seen.
        conds = [Condition("Ready", "False", "InvalidSpec", str(e)),
                 Condition("Progressing", "False", "InvalidSpec", "fix the spec to roll out"),
                 Condition("Degraded", "True", "InvalidSpec", str(e))]
        keep = [c for c in previous.get("conditions") or [] if c.get("type") == "CacheReady"]
        merged = _merge(conds, previous.get("conditions") or [], now=now, generation=generation)
        return {**_counters(deployment, name), "observedGeneration": generation,
                "conditions": merged + keep,
                "lastFailure": _last_failure(("InvalidSpec", str(e)), previous, now)}

    applied_raw = ((deployment or {}).get("metadata") or {}).get("annotations", {}).get(
        render.GENERATION_ANNOTATION)
    applied = int(applied_raw) if applied_raw else None
    observed = applied if applied is not None else int(previous.get("observedGeneration") or 0)
    conds, failure = _conditions_valid(spec, generation, applied, deployment, pods)
    status: dict[str, Any] = {
        **_counters(deployment, name),
        "observedGeneration": observed,
        "conditions": _merge(conds, previous.get("conditions") or [], now=now, generation=observed),
        "topology": {"gpusPerPod": spec.parallelism.gpus_per_pod,
                     "totalGPUs": spec.parallelism.gpus_per_pod * spec.replicas},
        "endpoint": {"url": render.endpoint_url(owner, spec)},
    }
    last = _last_failure(failure, previous, now)
    if last:
        status["lastFailure"] = last
    return status


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
