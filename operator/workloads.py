"""The workload that runs a deployment's engine pods: a Deployment, or a LeaderWorkerSet.

Owns the choice and both manifests. A replica whose dp x sp group fits one node
(``parallelism.gpusPerNode``) is one pod of a Deployment. A larger group spans
``pods_per_replica`` pods, one per node, that must start, fail and restart together: that is a
LeaderWorkerSet group (kubernetes-sigs/lws, API ``leaderworkerset.x-k8s.io/v1``; its controller
must be installed in the cluster). Group size = pods per replica, LWS replicas = spec.replicas;
the leader (worker index 0) runs rank 0 and the HTTP server, so the Service selects leaders.
Called by ``render``; pure.
"""

from __future__ import annotations

from typing import Any

from ditserve.operator import pod, sizing
from ditserve.operator.spec import DeploymentSpec

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
# The LWS controller creates a headless Service named after the LWS for its pods' DNS names;
# the LWS gets its own name so that Service never collides with the operator's.
LWS_SUFFIX = "-lws"


def workload_kind(spec: DeploymentSpec) -> str:
    return LWS_KIND if spec.parallelism.multi_node else "Deployment"


def workload_name(owner_name: str, spec: DeploymentSpec) -> str:
    return owner_name + LWS_SUFFIX if spec.parallelism.multi_node else owner_name


def leader_selector(spec: DeploymentSpec) -> dict[str, str]:
    """Extra Service selector labels: only rank 0 answers HTTP."""
    return {LWS_WORKER_INDEX_LABEL: "0"} if spec.parallelism.multi_node else {}


def deployment(spec: DeploymentSpec, *, meta: dict[str, Any], template_meta: dict[str, Any],
               selector: dict[str, str], ctx: pod.PodContext) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {
                "maxSurge": spec.rollout.max_surge,
                "maxUnavailable": spec.rollout.max_unavailable}},
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": sizing.progress_deadline_s(spec),
            "template": {"metadata": template_meta,
                         "spec": pod.pod_spec(spec, ctx)},
        },
    }


def leader_worker_set(spec: DeploymentSpec, *, meta: dict[str, Any],
                      template_meta: dict[str, Any], ctx: pod.PodContext) -> dict[str, Any]:
    def template(role: pod.Role) -> dict[str, Any]:
        return {"metadata": template_meta, "spec": pod.pod_spec(spec, ctx, role)}

    return {
        "apiVersion": LWS_API_VERSION, "kind": LWS_KIND, "metadata": meta,
        "spec": {
            "replicas": spec.replicas,
            # Rank 0 must be reachable before the other ranks dial it; workers start when the
            # leader pod exists (LeaderCreated) and retry the rendezvous until it listens.
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": {
                "maxSurge": spec.rollout.max_surge,
                "maxUnavailable": spec.rollout.max_unavailable}},
            "leaderWorkerTemplate": {
                "size": spec.parallelism.pods_per_replica,
                # One rank lost breaks every collective of the group: restart it whole.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": template(pod.Role.LEADER),
                "workerTemplate": template(pod.Role.WORKER),
            },
        },
    }
