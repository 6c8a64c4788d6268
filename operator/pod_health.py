"""What the engine pods say: failures (worst first) and the cache init container's progress.

Owns ``inspect_pods``: one pure pass over a deployment's pods (and the Warning events about
them) that finds every failure a user must act on as soon as the kubelet reports it, not only
when the rollout's progress deadline expires (40 minutes for a large model):

  ImagePullFailed       ErrImagePull, ImagePullBackOff, InvalidImageName, ErrImageNeverPull
  ContainerConfigError  CreateContainerConfigError (a missing Secret/ConfigMap or key)
  ContainerStartFailed  CreateContainerError, RunContainerError
  VolumeMountFailed     a FailedMount event for a pod that has not started (a missing hostPath
                        directory, PVC, Secret or ConfigMap volume)
  OOMKilled             a container killed for exceeding its memory limit (from the first
                        kill, before the kubelet backs off into CrashLoopBackOff)
  ModelDownloadFailed   the cachectl-pull init container failed (a model.uri the daemon could not
                        download: NotFound, Unauthorized, DigestMismatch, DiskFull ...; its
                        last words say which)
  CacheEnsureFailed     the cachectl-ensure init container failed
  LeaderWorkerSetTooOld a LeaderWorkerSet pod without LWS_WORKER_INDEX (LWS < 0.6 injects
                        none: every pod of the group would think it is node 0)
  CrashLoopBackOff      the engine keeps exiting; the message is the engine's own last words
                        (its termination log: the fatal start error, or its last log lines)
  Unschedulable         PodScheduled=False
Called by ``status``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ditserve.operator import pod as podlib

PULL_FAILURES = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
CONFIG_FAILURES = {"CreateContainerConfigError"}
START_FAILURES = {"CreateContainerError", "RunContainerError"}
MOUNT_EVENT_REASONS = {"FailedMount"}
# Worst first: the reason the Ready and Degraded conditions report.
FAILURE_ORDER = ("ImagePullFailed", "ContainerConfigError", "ContainerStartFailed",
                 "VolumeMountFailed", "LeaderWorkerSetTooOld", "OOMKilled", "ModelDownloadFailed",
                 "CacheEnsureFailed",
                 "CrashLoopBackOff", "Unschedulable")
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_MIN_VERSION = "0.6"
MAX_EXIT_MESSAGE = 600  # a log tail can be long; the condition keeps its end


@dataclass
class PodFindings:
    """The first message per failure reason, and how the cache init containers are doing."""

    failures: dict[str, str] = field(default_factory=dict)
    warming: int = 0
    ensured: int = 0
    pending: int = 0

    def note(self, reason: str, message: str) -> None:
        self.failures.setdefault(reason, message)

    def worst(self) -> tuple[str, str] | None:
        for reason in FAILURE_ORDER:
            if reason in self.failures:
                return reason, self.failures[reason]
        return None


def _statuses(pod: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    return list((pod.get("status") or {}).get(key) or [])


def _memory_limit(pod: Mapping[str, Any], container: str) -> str:
    spec = pod.get("spec") or {}
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        if c.get("name") == container:
            return str(((c.get("resources") or {}).get("limits") or {}).get("memory") or "?")
    return "?"


def _container_failures(findings: PodFindings, pod: Mapping[str, Any], name: str,
                        st: Mapping[str, Any]) -> None:
    """The failures one container status shows (any container of the pod)."""
    state, last = st.get("state") or {}, st.get("lastState") or {}
    waiting = state.get("waiting") or {}
    reason, said = waiting.get("reason"), waiting.get("message")
    who = f"pod {name}: container {st.get('name')}"
    if reason in PULL_FAILURES:
        findings.note("ImagePullFailed", f"pod {name}: {said or reason}")
    elif reason in CONFIG_FAILURES:
        findings.note("ContainerConfigError", f"{who} cannot be created: {said or reason}")
    elif reason in START_FAILURES:
        findings.note("ContainerStartFailed", f"{who} did not start: {said or reason}")
    terminated = state.get("terminated") or last.get("terminated") or {}
    if terminated.get("reason") == "OOMKilled" and not st.get("ready"):
        findings.note("OOMKilled", (
            f"{who} was killed for exceeding its memory limit "
            f"({_memory_limit(pod, str(st.get('name')))}; restarts {st.get('restartCount', 0)}): "
            "raise engine.resources.memory, or lower batching.maxNumSeqs or model.sizeGiB"))


def not_started(pod: Mapping[str, Any]) -> bool:
    """No container of the pod has run yet (volumes are mounted before any container starts)."""
    statuses = _statuses(pod, "initContainerStatuses") + _statuses(pod, "containerStatuses")
    return (pod.get("status") or {}).get("phase", "Pending") == "Pending" and not any(
        "running" in (s.get("state") or {}) or "terminated" in (s.get("state") or {})
        or (s.get("lastState") or {}) for s in statuses)


def _mount_failures(findings: PodFindings, pods: Sequence[Mapping[str, Any]],
                    events: Iterable[Mapping[str, Any]]) -> None:
    waiting = {(p.get("metadata") or {}).get("uid"): (p.get("metadata") or {}).get("name")
               for p in pods if not_started(p)}
    for event in events:
        involved = event.get("involvedObject") or {}
        if (event.get("reason") in MOUNT_EVENT_REASONS and involved.get("kind") == "Pod"
                and involved.get("uid") in waiting):
            findings.note("VolumeMountFailed",
                          f"pod {waiting[involved['uid']]}: {event.get('message') or event['reason']}")


# The cache's init containers, in the order they run: (name, failure reason, command).
_INIT_STEPS = ((podlib.PULL_CONTAINER, "ModelDownloadFailed", "cachectl pull"),
               (podlib.ENSURE_CONTAINER, "CacheEnsureFailed", "cachectl ensure"))


def _init_state(findings: PodFindings, pod: Mapping[str, Any], name: str,
                st: Mapping[str, Any], reason: str, command: str) -> str | None:
    state, last = st.get("state") or {}, st.get("lastState") or {}
    waiting = state.get("waiting") or {}
    term = state.get("terminated") or {}
    failed = term.get("exitCode", 0) != 0 or (
        waiting.get("reason") == "CrashLoopBackOff"
        and (last.get("terminated") or {}).get("exitCode", 0) != 0)
    if failed:
        term = term or last.get("terminated") or {}
        message = str(term.get("message") or term.get("reason") or "see its logs").strip()
        if len(message) > MAX_EXIT_MESSAGE:
            message = "..." + message[-MAX_EXIT_MESSAGE:]
        findings.note(reason, f"pod {name}: {command} exited {term.get('exitCode')}: {message}")
        return "failed"
    if "running" in state:
        return "warming"
    if "terminated" in state:
        return "done"
    return None


def _ensure_state(findings: PodFindings, pod: Mapping[str, Any], name: str) -> str | None:
    """The cache init containers' state: failed, warming (pulling or ensuring), done, or
    None before any ran."""
    by_name = {st.get("name"): st for st in _statuses(pod, "initContainerStatuses")}
    result = None
    for container, reason, command in _INIT_STEPS:
        if container not in by_name:
            continue
        result = _init_state(findings, pod, name, by_name[container], reason, command)
        if result != "done":
            return result
    return result


def _last_words(st: Mapping[str, Any]) -> str:
    """The engine's last exit as '; exited N: <termination message>' ('' if it left none)."""
    term = (st.get("lastState") or {}).get("terminated") or {}
    message = str(term.get("message") or "").strip()
    if not message:
        return ""
    if len(message) > MAX_EXIT_MESSAGE:
        message = "..." + message[-MAX_EXIT_MESSAGE:]
    return f"; last exit {term.get('exitCode')}: {message}"


def _lws_too_old(findings: PodFindings, pod: Mapping[str, Any], name: str) -> None:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if LWS_WORKER_INDEX_LABEL not in labels:
        return
    for container in (pod.get("spec") or {}).get("containers") or []:
        if container.get("name") != podlib.ENGINE_CONTAINER:
            continue
        if not any(e.get("name") == "LWS_WORKER_INDEX" for e in container.get("env") or []):
            findings.note("LeaderWorkerSetTooOld", (
                f"pod {name}: the LeaderWorkerSet controller injected no LWS_WORKER_INDEX; "
                f"multi-node replicas need LeaderWorkerSet >= {LWS_MIN_VERSION}: upgrade it"))


def inspect_pods(pods: Sequence[Mapping[str, Any]],
                 events: Iterable[Mapping[str, Any]] = ()) -> PodFindings:
    """Classify the engine pods (see the module doc)."""
    findings = PodFindings()
    for pod in pods:
        name = (pod.get("metadata") or {}).get("name", "?")
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                findings.note("Unschedulable",
                              f"pod {name}: {cond.get('message') or cond.get('reason')}")
        for st in _statuses(pod, "initContainerStatuses") + _statuses(pod, "containerStatuses"):
            _container_failures(findings, pod, name, st)
        ensure = _ensure_state(findings, pod, name)
        _lws_too_old(findings, pod, name)
        for st in _statuses(pod, "containerStatuses"):
            if st.get("name") != podlib.ENGINE_CONTAINER:
                continue
            waiting = (st.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") == "CrashLoopBackOff":
                findings.note("CrashLoopBackOff", (
                    f"pod {name}: engine restarted {st.get('restartCount', 0)} times"
                    f"{_last_words(st) or ': ' + (waiting.get('message') or 'see its logs')}"))
            if st.get("ready") or "running" in (st.get("state") or {}):
                ensure = ensure or "done"  # engines only start after the init container
        if ensure == "warming":
            findings.warming += 1
        elif ensure == "done":
            findings.ensured += 1
        elif ensure is None:
            findings.pending += 1
    _mount_failures(findings, pods, events)
    return findings
