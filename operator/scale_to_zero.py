"""Scale from zero: ``spec.autoscaling.scaleToZero`` and its KEDA ``ScaledObject``.

Off by default. The plain HorizontalPodAutoscaler (``autoscaling``) cannot go below one
replica; KEDA can, by activating a target at zero when a trigger's value exceeds its
``activationThreshold``. With ``scaleToZero.enabled`` the operator renders a ``ScaledObject``
*instead of* the HPA (KEDA makes its own HPA from it; two would fight), targeting the
DiffusionDeployment's scale subresource like the HPA does, with one Prometheus trigger:

- ``query``: by default the engines' waiting requests summed over the deployment's Service
  (``ditserve:num_requests_waiting``, labelled ``namespace``/``service`` by the chart's
  ServiceMonitor), ``or vector(0)`` so no series reads as an empty queue;
- ``threshold``: ``targetWaitingPerReplica`` (waiting requests per replica, as the HPA);
- ``activationThreshold`` 0: the first waiting request (a value of 1) wakes the deployment.

The cost, documented in docs/kubernetes.md: the first request after an idle period waits a
whole cold start (pod scheduling, the model from the node cache, warm-up), and at zero
replicas no engine exists to queue it, so something in front must hold requests and count
them (``query`` should then read that count: the KEDA HTTP add-on's interceptor queue, a
gateway's or a job queue's metric). Called by ``autoscaling`` (reading) and ``render``; pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ditserve.operator.spec_reader import SpecReader

KEDA_API_VERSION = "keda.sh/v1alpha1"
SCALED_OBJECT_KIND = "ScaledObject"
ENGINE_QUEUE = "ditserve:num_requests_waiting"
SHARED_JOBS = "ditserve:video_jobs_unfinished"  # every replica reports the shared store's


@dataclass(frozen=True)
class ScaleToZeroSpec:
    """``spec.autoscaling.scaleToZero``: off unless ``enabled``."""

    enabled: bool = False
    prometheus_address: str | None = None
    query: str | None = None  # None: the engines' queue summed over the Service
    polling_interval_s: int = 15


def read_scale_to_zero(reader: SpecReader, *, autoscaling_enabled: bool) -> ScaleToZeroSpec:
    spec = ScaleToZeroSpec(
        enabled=reader.flag("enabled", False),
        prometheus_address=reader.text("prometheusAddress") or None,
        query=reader.text("query") or None,
        polling_interval_s=reader.integer("pollingIntervalSeconds", 15, 1),
    )
    if spec.enabled and not autoscaling_enabled:
        reader.problems.append("autoscaling.scaleToZero.enabled needs autoscaling.enabled")
    if spec.enabled and not spec.prometheus_address:
        reader.problems.append("autoscaling.scaleToZero.prometheusAddress is required: KEDA "
                               "reads the queue from Prometheus (e.g. "
                               "http://prometheus-operated.monitoring:9090)")
    return spec


def default_query(namespace: str, service: str, *, shared_jobs: bool = False) -> str:
    """The engines' queue summed over the Service; with shared jobs the shared store's
    unfinished jobs, which each replica reports alike (their max, not their sum)."""
    if shared_jobs:
        return (f'max({SHARED_JOBS}{{namespace="{namespace}",service="{service}"}}) '
                "or vector(0)")
    return (f'sum({ENGINE_QUEUE}{{namespace="{namespace}",service="{service}"}}) '
            "or vector(0)")


def scaled_object(spec: ScaleToZeroSpec, *, min_replicas: int, max_replicas: int,
                  target_waiting_per_replica: int, scale_down_window_s: int,
                  meta: dict[str, Any], target: dict[str, str], namespace: str,
                  service: str, shared_jobs: bool = False) -> dict[str, Any]:
    """The ScaledObject scaling ``target`` (the DiffusionDeployment) between ``min_replicas``
    (0 to scale to zero) and ``max_replicas`` on the queue."""
    return {
        "apiVersion": KEDA_API_VERSION, "kind": SCALED_OBJECT_KIND, "metadata": meta,
        "spec": {
            "scaleTargetRef": target,
            "minReplicaCount": min_replicas,
            "maxReplicaCount": max_replicas,
            "pollingInterval": spec.polling_interval_s,
            # Zero only after the queue stayed empty this long (the HPA's scale-down window).
            "cooldownPeriod": scale_down_window_s,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
                # As the HPA: at most one more replica a minute while large models load.
                "scaleUp": {"stabilizationWindowSeconds": 0,
                            "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]},
                "scaleDown": {"stabilizationWindowSeconds": scale_down_window_s,
                              "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]},
            }}},
            "triggers": [{"type": "prometheus", "metadata": {
                "serverAddress": spec.prometheus_address or "",
                "query": spec.query or default_query(namespace, service,
                                                     shared_jobs=shared_jobs),
                "threshold": str(target_waiting_per_replica),
                # Active above 0: the first waiting request wakes a deployment at zero.
                "activationThreshold": "0",
                "ignoreNullValues": "true",
            }}],
        },
    }
