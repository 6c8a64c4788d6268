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
- ``results.s3`` (``url`` ``s3://BUCKET/PREFIX``, ``endpoint``, ``region``,
  ``credentialsSecret``): finished MP4s in an S3-compatible bucket instead of a volume
  (``DITSERVE_JOB_RESULTS``; the endpoint and region as ``AWS_ENDPOINT_URL_S3`` /
  ``AWS_REGION``; the Secret's keys - ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
  optionally ``AWS_SESSION_TOKEN`` - into rank 0's environment, as ``model.credentialsSecret``
  does for the cache's pulls). Either the volume or the bucket, not both.

``leaseSeconds`` becomes ``server.job_lease_s``. Called by ``spec`` (parsing), ``pod``
(volume, mount, env) and ``judge`` (the server section); pure.
"""

from __future__ import annotations

import re
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
JOB_RESULTS_ENV = "DITSERVE_JOB_RESULTS"  # likewise: the s3:// result store
S3_ENDPOINT_ENV, S3_REGION_ENV = "AWS_ENDPOINT_URL_S3", "AWS_REGION"  # boto3 reads them
JOBS_ENV = (JOB_STORE_ENV, JOB_NAMESPACE_ENV, f"{JOB_NAMESPACE_ENV}_NAME", POD_NAMESPACE_ENV,
            JOB_RESULTS_ENV)
S3_URL = re.compile(r"^s3://[a-z0-9][a-z0-9.\-]{1,62}(/\S*)?$")


@dataclass(frozen=True)
class JobsSpec:
    """``spec.jobs``: ``url_secret`` (Secret name, key) of the Redis URL; the results
    volume's claim and sub path; the lease."""

    url_secret: tuple[str, str] | None = None
    results_claim: str | None = None
    results_sub_path: str = ""
    lease_s: float | None = None
    s3_url: str | None = None
    s3_endpoint: str | None = None
    s3_region: str | None = None
    s3_credentials_secret: str | None = None

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
    s3 = j.child("results").child("s3")
    url = s3.text("url") or None
    if url is not None and not S3_URL.match(url):
        root.problems.append(f"spec.jobs.results.s3.url must be s3://BUCKET or "
                             f"s3://BUCKET/PREFIX, got {url!r}")
    claim = pvc.text("claimName") or None
    if claim is not None and url is not None:
        root.problems.append("spec.jobs.results takes persistentVolumeClaim or s3, not both")
    return JobsSpec(url_secret=(name, secret.text("key", "url") or "url") if name else None,
                    results_claim=claim, results_sub_path=sub, lease_s=lease, s3_url=url,
                    s3_endpoint=s3.text("endpoint") or None, s3_region=s3.text("region") or None,
                    s3_credentials_secret=s3.child("credentialsSecret").text("name") or None)


def jobs_problems(jobs: JobsSpec, replicas: int, autoscaling: AutoscalingSpec) -> list[str]:
    """What the rest of the spec makes impossible."""
    max_replicas = max(replicas, autoscaling.max_replicas if autoscaling.enabled else 0)
    if jobs.shared and jobs.results_claim is None and jobs.s3_url is None:
        return ["spec.jobs.redis needs spec.jobs.results (s3, or a persistentVolumeClaim): "
                "replicas sharing jobs must share their videos too (an S3-compatible bucket "
                "or a ReadWriteMany volume)"]
    single = jobs.results_claim is not None or jobs.s3_url is not None
    if not jobs.shared and single and max_replicas > 1:
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


def jobs_env_from(jobs: JobsSpec) -> list[dict[str, Any]]:
    """The bucket's credentials: every key of its Secret (AWS_ACCESS_KEY_ID, ...)."""
    if jobs.s3_credentials_secret is None:
        return []
    return [{"secretRef": {"name": jobs.s3_credentials_secret}}]


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
    out: list[dict[str, Any]] = []
    if jobs.s3_url is not None:
        out.append({"name": JOB_RESULTS_ENV, "value": jobs.s3_url})
        if jobs.s3_endpoint is not None:
            out.append({"name": S3_ENDPOINT_ENV, "value": jobs.s3_endpoint})
        if jobs.s3_region is not None:
            out.append({"name": S3_REGION_ENV, "value": jobs.s3_region})
    if jobs.url_secret is None:
        return out
    name, key = jobs.url_secret
    return [*out, {"name": JOB_STORE_ENV, "valueFrom": {"secretKeyRef": {"name": name, "key": key}}},
            {"name": POD_NAMESPACE_ENV, "valueFrom": {"fieldRef": {
                "fieldPath": "metadata.namespace"}}},
            {"name": f"{JOB_NAMESPACE_ENV}_NAME", "valueFrom": {"fieldRef": {
                "fieldPath": f"metadata.labels['{INSTANCE_LABEL}']"}}},
            {"name": JOB_NAMESPACE_ENV,
             "value": f"$({POD_NAMESPACE_ENV})/$({JOB_NAMESPACE_ENV}_NAME)"}]
