"""Autoscaling a DiffusionDeployment on queue depth: ``spec.autoscaling`` and its
HorizontalPodAutoscaler.

Owns reading ``spec.autoscaling`` and rendering it. The choice (docs/kubernetes.md,
"Autoscaling"): a plain ``autoscaling/v2`` HorizontalPodAutoscaler, not a KEDA ScaledObject.
It needs no extra controller beyond an adapter that serves the engine's Prometheus metric
through the custom metrics API (prometheus-adapter), it validates against the cluster's own
OpenAPI schema, and it scales the DiffusionDeployment itself through its ``/scale``
subresource, so ``spec.replicas`` stays the one number everyone reads and the operator never
fights the autoscaler over the workload's replicas.

The metric is an ``Object`` metric of the deployment's Service: the engines' waiting requests
(``ditserve:num_requests_waiting``, exported as ``ditserve_num_requests_waiting`` by the
adapter rule in the docs) summed over the Service, with an ``AverageValue`` target = waiting
requests per replica. Per replica, not per pod: a replica spanning nodes has worker pods that
serve no HTTP and export no queue.

No scale to zero with the HPA: at zero replicas nothing exports the metric and nothing holds
the first request while a pod starts (minutes for a large model), so ``minReplicas`` is at
least 1 unless ``scaleToZero`` is enabled, which renders a KEDA ScaledObject instead (see
``scale_to_zero`` for how and at what cost). Called by ``spec`` (reading) and ``render``
(the manifest); pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ditserve.operator.scale_to_zero import ScaleToZeroSpec, read_scale_to_zero

if TYPE_CHECKING:
    from ditserve.operator.spec_reader import SpecReader

DEFAULT_METRIC = "ditserve_num_requests_waiting"
# A deployment sharing video jobs (spec.jobs.redis) scales on the shared queue instead: the
# unfinished jobs of the store (queued + in progress), which every replica reports alike
# (the adapter rule takes their max, not their sum). Running jobs count too, so a queue that
# just emptied into busy replicas does not scale them away.
JOBS_METRIC = "ditserve_video_jobs_unfinished"
HPA_KIND = "HorizontalPodAutoscaler"


@dataclass(frozen=True)
class AutoscalingSpec:
    """``spec.autoscaling``: off unless ``enabled``."""

    enabled: bool = False
    min_replicas: int = 1
    max_replicas: int = 1
    target_waiting_per_replica: int = 4
    metric: str | None = None  # None: DEFAULT_METRIC, or JOBS_METRIC with shared jobs
    scale_down_window_s: int = 300
    scale_to_zero: ScaleToZeroSpec = field(default_factory=ScaleToZeroSpec)

    @property
    def uses_hpa(self) -> bool:
        return self.enabled and not self.scale_to_zero.enabled

    @property
    def uses_keda(self) -> bool:
        return self.enabled and self.scale_to_zero.enabled


def read_autoscaling(reader: SpecReader) -> AutoscalingSpec:
    """``spec.autoscaling`` from its reader; problems go to the reader's shared list."""
    spec = AutoscalingSpec(
        enabled=reader.flag("enabled", False),
        min_replicas=reader.integer("minReplicas", 1, 0),
        max_replicas=reader.integer("maxReplicas", 1, 1),
        target_waiting_per_replica=reader.integer("targetWaitingPerReplica", 4, 1),
        metric=reader.text("metric") or None,
        scale_down_window_s=reader.integer("scaleDownStabilizationSeconds", 300, 0),
        scale_to_zero=read_scale_to_zero(reader.child("scaleToZero"),
                                         autoscaling_enabled=reader.flag("enabled", False)),
    )
    if spec.enabled:
        if spec.min_replicas < 1 and not spec.scale_to_zero.enabled:
            reader.problems.append(
                "autoscaling.minReplicas must be at least 1: scaling to zero would leave no "
                "engine to export the queue metric and nothing to hold the first request while "
                "a pod starts (or enable autoscaling.scaleToZero, a KEDA ScaledObject)")
        if spec.max_replicas < spec.min_replicas:
            reader.problems.append(f"autoscaling.maxReplicas ({spec.max_replicas}) must be at "
                                   f"least autoscaling.minReplicas ({spec.min_replicas})")
    return spec


def metric_of(spec: AutoscalingSpec, *, shared_jobs: bool) -> str:
    """The custom metric the HPA reads: the spec's, else the queue the deployment has."""
    return spec.metric or (JOBS_METRIC if shared_jobs else DEFAULT_METRIC)


def horizontal_pod_autoscaler(spec: AutoscalingSpec, *, meta: dict[str, Any],
                              target: dict[str, str], service: str,
                              shared_jobs: bool = False) -> dict[str, Any]:
    """The HPA scaling ``target`` (the DiffusionDeployment) on its Service's queue: the
    engines' waiting requests, or with ``shared_jobs`` the shared job queue's depth."""
    return {
        "apiVersion": "autoscaling/v2", "kind": HPA_KIND, "metadata": meta,
        "spec": {
            "scaleTargetRef": target,
            "minReplicas": spec.min_replicas,
            "maxReplicas": spec.max_replicas,
            "metrics": [{"type": "Object", "object": {
                "describedObject": {"apiVersion": "v1", "kind": "Service", "name": service},
                "metric": {"name": metric_of(spec, shared_jobs=shared_jobs)},
                "target": {"type": "AverageValue",
                           "averageValue": str(spec.target_waiting_per_replica)}}}],
            "behavior": {
                # Desired replicas = total waiting / target, so a queue behind a loading pod
                # asks for no more than it needs; at most one more replica a minute bounds a
                # burst's GPU bill while the first new pods load.
                "scaleUp": {"stabilizationWindowSeconds": 0,
                            "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]},
                "scaleDown": {"stabilizationWindowSeconds": spec.scale_down_window_s,
                              "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]},
            },
        },
    }
