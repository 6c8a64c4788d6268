"""``spec.jobs``: where a video deployment's jobs live, so its replicas are one service.

Two parts, both optional:

- ``redis.urlSecret`` (``name``, ``key`` default ``url``): a Secret holding the job store's
  URL (``redis://[:PASSWORD@]HOST:PORT/DB``). Engine pods get it as ``DITSERVE_JOB_STORE``
  (from the Secret, so the password never lands in the ConfigMap); every replica then shares
  jobs and takes work when it has room (docs/serving.md, "Many replicas").
- ``results.persistentVolumeClaim`` (``claimName``, ``subPath``): the volume for finished
  MP4s, mounted at ``/videos`` and given as ``server.video_dir``. With Redis it must be one
  every replica mounts (ReadWriteMany); without Redis it holds the default SQLite job store,
  so one replica's jobs survive its restarts - and then the deployment must have one replica
  (the file belongs to one server).

``leaseSeconds`` becomes ``server.job_lease_s``. Called by ``spec`` (parsing), ``pod``
(volume, mount, env) and ``judge`` (the server section); pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ditserve.operator.autoscaling import AutoscalingSpec
from ditserve.operator.spec_reader import SpecReader

RESULTS_MOUNT = "/videos"
RESULTS_VOLUME = "videos"
JOB_STORE_ENV = "DITSERVE_JOB_STORE"  # the engine reads it (engine.server.config)
JOB_NAMESPACE_ENV = "DITSERVE_JOB_NAMESPACE"  # likewise: whose jobs these are
POD_NAMESPACE_ENV = "DITSERVE_POD_NAMESPACE"
INSTANCE_LABEL = "app.kubernetes.io/instance"  # the DiffusionDeployment's name (render.py)
JOBS_ENV = (JOB_STORE_ENV, JOB_NAMESPACE_ENV, f"{JOB_NAMESPACE_ENV}_NAME", POD_NAMESPACE_ENV)


@dataclass(frozen=True)
class JobsSpec:
    """``spec.jobs``: ``url_secret`` (Secret name, key) of the Redis URL; the results
    volume's claim and sub path; the lease."""

    url_secret: tuple[str, str] | None = None
    results_claim: str | None = None
    results_sub_path: str = ""
    lease_s: float | None = None

    @property
    def shared(self) -> bool:
        return self.url_secret is not None


def parse_jobs(root: SpecReader) -> JobsSpec:
    """``spec.jobs``; problems go to the reader's list."""
    j = root.child("jobs")
    secret = j.child("redis").child("urlSecret")
    pvc = j.child("results").child("persistentVolumeClaim")
    name = secret.text("name")
    sub = pvc.text("subPath", "") or ""
    if ".." in sub.split("/") or sub.startswith("/"):
        root.problems.append("spec.jobs.results.persistentVolumeClaim.subPath must be "
                             f"relative without '..', got {sub!r}")
    lease = j.number("leaseSeconds", None)
    if lease is not None and lease < 1:
        root.problems.append(f"spec.jobs.leaseSeconds must be at least 1, got {lease!r}")
    return JobsSpec(url_secret=(name, secret.text("key", "url") or "url") if name else None,
                    results_claim=pvc.text("claimName") or None, results_sub_path=sub,
                    lease_s=lease)


def jobs_problems(jobs: JobsSpec, replicas: int, autoscaling: AutoscalingSpec) -> list[str]:
    """What the rest of the spec makes impossible."""
    max_replicas = max(replicas, autoscaling.max_replicas if autoscaling.enabled else 0)
    if jobs.shared and jobs.results_claim is None:
        return ["spec.jobs.redis needs spec.jobs.results.persistentVolumeClaim: replicas "
                "sharing jobs must share their videos too (a ReadWriteMany volume)"]
    if not jobs.shared and jobs.results_claim is not None and max_replicas > 1:
        return [f"spec.jobs.results without spec.jobs.redis keeps jobs in a SQLite file that "
                f"one server owns, but this deployment may run {max_replicas} replicas: add "
                "spec.jobs.redis.urlSecret (a shared job store), or run one replica"]
    return []


def jobs_server_section(jobs: JobsSpec) -> dict[str, Any]:
    """The ``server:`` keys ``spec.jobs`` sets (the URL travels in the environment)."""
    out: dict[str, Any] = {}
    if jobs.results_claim is not None:
        out["video_dir"] = RESULTS_MOUNT
    if jobs.lease_s is not None:
        out["job_lease_s"] = jobs.lease_s
    return out


def jobs_volumes(jobs: JobsSpec) -> list[dict[str, Any]]:
    if jobs.results_claim is None:
        return []
    return [{"name": RESULTS_VOLUME, "persistentVolumeClaim": {"claimName": jobs.results_claim}}]


def jobs_mounts(jobs: JobsSpec) -> list[dict[str, Any]]:
    if jobs.results_claim is None:
        return []
    mount: dict[str, Any] = {"name": RESULTS_VOLUME, "mountPath": RESULTS_MOUNT}
    if jobs.results_sub_path:
        mount["subPath"] = jobs.results_sub_path
    return [mount]


def jobs_env(jobs: JobsSpec) -> list[dict[str, Any]]:
    """The store's URL from its Secret, and the namespace of this deployment's jobs in it:
    ``<namespace>/<name>`` from the pod's own metadata, so deployments sharing one Redis
    never take each other's jobs."""
    if jobs.url_secret is None:
        return []
    name, key = jobs.url_secret
    return [{"name": JOB_STORE_ENV, "valueFrom": {"secretKeyRef": {"name": name, "key": key}}},
            {"name": POD_NAMESPACE_ENV, "valueFrom": {"fieldRef": {
                "fieldPath": "metadata.namespace"}}},
            {"name": f"{JOB_NAMESPACE_ENV}_NAME", "valueFrom": {"fieldRef": {
                "fieldPath": f"metadata.labels['{INSTANCE_LABEL}']"}}},
            {"name": JOB_NAMESPACE_ENV,
             "value": f"$({POD_NAMESPACE_ENV})/$({JOB_NAMESPACE_ENV}_NAME)"}]
