"""What a platform team checks in the rendered manifests: no tenant reaches a node path outside
the admin's roots or writes the node cache with its own image, start errors reach status,
grace periods follow the drain, pods are hardened and spread, the chart's pull secrets
follow its image, every DiT is cached, and autoscaling is a valid HPA on the queue metric.
Every object is checked against the Kubernetes schemas of the oldest and newest supported
minors (kubernetes-validate, strict)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from ditserve.cachectl.cli import build_parser as cachectl_parser
from ditserve.operator import sizing
from ditserve.operator.errors import InvalidSpecError
from ditserve.operator.judge import validate
from ditserve.operator.pod_health import inspect_pods
from ditserve.operator.policy import AdminPolicy
from ditserve.operator.render import Owner, adopt, render
from ditserve.operator.spec import parse_spec

OWNER = Owner(name="flux", namespace="team-a", uid="0b9e7b5c-1111-2222-3333-444455556666")
K8S_VERSIONS = ("1.29.0", "1.37.0")
ADMIN = AdminPolicy(model_roots=("/data/models", "/mnt/nfs/models"), cache_root="/data/cache",
                    engine_image="registry.corp/ditserve:1.2", helper_image="registry.corp/ditserve:1.2",
                    pull_secrets=("corp-registry",))


def spec_of(**overrides: Any) -> dict[str, Any]:
    return {"model": {"hostPath": "/data/models/flux", "sizeGiB": 24}, **overrides}


def kids(spec: dict[str, Any], policy: AdminPolicy = ADMIN) -> dict[str, dict[str, Any]]:
    judged, _ = validate(spec, name=OWNER.name, policy=policy)
    return {m["kind"]: m for m in adopt(render(judged, OWNER, policy=policy), OWNER)}


def pod_of(spec: dict[str, Any], policy: AdminPolicy = ADMIN) -> dict[str, Any]:
    return kids(spec, policy)["Deployment"]["spec"]["template"]["spec"]


def _container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod["containers"] + pod.get("initContainers", []) if c["name"] == name)


# --- 1. the admin's roots ----------------------------------------------------------------

@pytest.mark.parametrize(("spec", "complaint"), [
    (spec_of(model={"hostPath": "/var/lib/kubelet"}), "model.hostPath '/var/lib/kubelet'"),
    (spec_of(model={"hostPath": "/data/models/../../etc"}), "is outside"),
    (spec_of(model={"hostPath": "/data/modelsX/flux"}), "is outside"),  # a prefix, not a root
    (spec_of(model={"hostPath": "/"}), "is outside"),
    (spec_of(cache={"root": "/etc"}), "cache.root '/etc' is not the node cache root '/data/cache'"),
])
def test_a_path_outside_the_admin_roots_is_invalid_and_renders_nothing(
        spec: dict[str, Any], complaint: str) -> None:
    with pytest.raises(InvalidSpecError, match="outside|not the node cache root") as judged:
        validate(spec, name=OWNER.name, policy=ADMIN)
    assert complaint in str(judged.value)
    # render itself refuses too: no code path turns such a spec into manifests.
    with pytest.raises(InvalidSpecError) as rendered:
        render(parse_spec(spec), OWNER, policy=ADMIN)
    assert complaint in str(rendered.value)


def test_allowed_paths_and_the_admins_cache_root_are_used() -> None:
    pod = pod_of(spec_of(model={"hostPath": "/mnt/nfs/models/wan", "sizeGiB": 30}))
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model"]["hostPath"]["path"] == "/mnt/nfs/models/wan"
    assert volumes["cache"]["hostPath"]["path"] == "/data/cache"  # cache.root unset: the admin's


def test_the_cache_is_written_only_by_the_daemon_or_the_admins_image() -> None:
    hostile = spec_of(engine={"image": "tenant.example/anything:latest"})
    pod = pod_of(hostile)
    engine, ensure = _container(pod, "engine"), _container(pod, "cachectl-ensure")
    assert engine["image"] == "tenant.example/anything:latest"
    assert ensure["image"] == ADMIN.helper_image  # never the tenant's image
    mounts = {m["name"]: m for m in engine["volumeMounts"] + ensure["volumeMounts"]
              if m["name"] == "cache"}
    assert mounts["cache"]["readOnly"] is True
    assert all(m.get("readOnly") for m in engine["volumeMounts"] + ensure["volumeMounts"]
               if m["name"] == "cache")
    # A hostPath model: the init container only asks the daemon; it never builds.
    args = cachectl_parser().parse_args(ensure["command"][1:])
    assert args.daemon_only and not args.no_daemon and args.component == "all"
    # A PVC model the daemon cannot see: built in the pod, but with the admin's image.
    pvc = pod_of({"model": {"persistentVolumeClaim": {"claimName": "models"}},
                  "engine": {"image": "tenant.example/anything:latest"}})
    ensure = _container(pvc, "cachectl-ensure")
    assert ensure["image"] == ADMIN.helper_image and "--no-daemon" in ensure["command"]
    assert ensure["securityContext"]["runAsNonRoot"] and pvc["securityContext"]["runAsUser"] != 0


# --- 5. start errors reach status; judged before they run --------------------------------

def test_the_engines_last_words_reach_the_status() -> None:
    engine = _container(pod_of(spec_of()), "engine")
    assert engine["terminationMessagePolicy"] == "FallbackToLogsOnError"
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert env["DITSERVE_TERMINATION_LOG"] == engine["terminationMessagePath"]
    said = ("error: sequence-parallel size 8 does not divide the 12 attention heads of "
            "transformer (Ulysses splits heads over SP ranks)")
    crashing = {"metadata": {"name": "flux-abc"}, "status": {"containerStatuses": [{
        "name": "engine", "ready": False, "restartCount": 3,
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
        "lastState": {"terminated": {"exitCode": 2, "message": said}}}]}}
    findings = inspect_pods([crashing])
    assert findings.worst() == ("CrashLoopBackOff",
                                f"pod flux-abc: engine restarted 3 times; last exit 2: {said}")


# 16 divided no released head count until FLUX.2 (48 heads; [klein] 9B: 32), 7 none until
# MiniMax-H3 (56); 9 and 11 divide none.
@pytest.mark.parametrize("sequence", [11, 9])
def test_an_auto_family_sp_size_that_fits_no_released_model_is_refused(sequence: int) -> None:
    auto = spec_of(parallelism={"sequence": sequence, "gpusPerNode": 16})
    with pytest.raises(InvalidSpecError, match=f"parallelism.sequence={sequence} divides the "
                                               "attention head count of no supported family"):
        validate(auto, name=OWNER.name, policy=ADMIN)
    # The way out for another model: declare its head count.
    declared = spec_of(model={"hostPath": "/data/models/custom", "attentionHeads": 11 * 9 * 16},
                       parallelism={"sequence": sequence, "gpusPerNode": 16})
    assert validate(declared, name=OWNER.name, policy=ADMIN)[1].parallel.sequence_parallel_size \
        == sequence


@pytest.mark.parametrize("sequence", [8, 5])
def test_declared_head_counts_judge_the_sp_size_before_any_gpu(sequence: int) -> None:
    spec = spec_of(model={"hostPath": "/data/models/wan-1.3b", "family": "Wan",
                          "attentionHeads": 12}, parallelism={"sequence": sequence})
    with pytest.raises(InvalidSpecError, match=f"parallelism.sequence={sequence} does not divide "
                                               "model.attentionHeads=12"):
        validate(spec, name=OWNER.name, policy=ADMIN)
    ok = spec_of(model={"hostPath": "/data/models/wan-1.3b", "attentionHeads": 12},
                 parallelism={"sequence": 4})
    assert validate(ok, name=OWNER.name, policy=ADMIN)[1].parallel.sequence_parallel_size == 4


# --- 6. drain and ports ------------------------------------------------------------------

def test_grace_period_follows_the_engines_drain_with_a_pre_stop_wait() -> None:
    pod = pod_of(spec_of(engine={"args": ["--shutdown-grace", "300"]}))
    engine = _container(pod, "engine")
    assert engine["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert pod["terminationGracePeriodSeconds"] == 5 + 300 + 15
    assert pod_of(spec_of())["terminationGracePeriodSeconds"] == 5 + 30 + 15  # default drain


def test_the_rendezvous_port_is_not_an_http_port() -> None:
    with pytest.raises(InvalidSpecError, match="engine.port 29500 is the ranks' rendezvous"):
        validate(spec_of(engine={"port": 29500}, parallelism={"data": 16}), name=OWNER.name,
                 policy=ADMIN)


# --- 7. hardening and placement ----------------------------------------------------------

def test_engine_pods_are_hardened_spread_and_optionally_guaranteed() -> None:
    pod = pod_of(spec_of(replicas=3))
    for container in pod["containers"] + pod["initContainers"]:
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert "/tmp" in mounts  # the writable directory it needs, an emptyDir
    assert {"/dev/shm", "/tmp"} <= {m["mountPath"] for m in _container(pod, "engine")["volumeMounts"]}
    (spread,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert spread["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert spread["podAffinityTerm"]["labelSelector"]["matchLabels"][
        "app.kubernetes.io/instance"] == "flux"
    assert "cpu" not in _container(pod, "engine")["resources"]["limits"]  # Burstable by default

    strict = pod_of(spec_of(replicas=3, engine={"resources": {"guaranteedQoS": True}},
                            scheduling={"replicaSpread": "Required", "requireCachedNodes": True}))
    for container in strict["containers"] + strict["initContainers"]:
        res = container["resources"]
        assert res["limits"]["cpu"] == res["requests"]["cpu"]  # Guaranteed QoS
        assert res["limits"]["memory"] == res["requests"]["memory"]
    assert strict["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    (term,) = strict["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert term["matchExpressions"][0]["values"] == ["Ready"]
    assert "podAntiAffinity" not in pod_of(spec_of(scheduling={"replicaSpread": "None"}))[
        "affinity"]


def test_required_cache_affinity_needs_a_node_cache() -> None:
    with pytest.raises(InvalidSpecError, match="requireCachedNodes needs cache.mode NodeLocal"):
        validate(spec_of(cache={"mode": "None"}, scheduling={"requireCachedNodes": True}),
                 name=OWNER.name, policy=ADMIN)


# --- 8. pull secrets and the LeaderWorkerSet version -------------------------------------

def test_chart_pull_secrets_reach_pods_that_run_the_charts_image() -> None:
    assert pod_of(spec_of())["imagePullSecrets"] == [{"name": "corp-registry"}]
    own = pod_of(spec_of(engine={"image": "mine:1", "imagePullSecrets": [{"name": "mine"}]}))
    # The cache init container still runs the chart's image: both secrets.
    assert own["imagePullSecrets"] == [{"name": "mine"}, {"name": "corp-registry"}]
    no_cache = pod_of(spec_of(engine={"image": "mine:1"}, cache={"mode": "None"}))
    assert "imagePullSecrets" not in no_cache  # nothing of the chart's runs in it


def test_a_leader_worker_set_too_old_to_inject_the_worker_index_is_degraded() -> None:
    pod = {"metadata": {"name": "flux-lws-0-1", "labels": {
        "leaderworkerset.sigs.k8s.io/worker-index": "1"}},
        "spec": {"containers": [{"name": "engine", "env": [
            {"name": "LWS_LEADER_ADDRESS", "value": "flux-lws-0.flux-lws"}]}]}}
    reason, message = inspect_pods([pod]).worst()  # type: ignore[misc]
    assert reason == "LeaderWorkerSetTooOld" and "LeaderWorkerSet >= 0.6" in message
    pod["spec"]["containers"][0]["env"].append({"name": "LWS_WORKER_INDEX", "value": "1"})
    assert inspect_pods([pod]).worst() is None


# --- 9. every DiT through the cache ------------------------------------------------------

def test_every_dit_is_ensured_and_budgeted_as_one_shared_copy() -> None:
    spec = spec_of(model={"hostPath": "/data/models/wan2.2-a14b", "family": "Wan",
                          "sizeGiB": 54},
                   offload={"enabled": True, "useAllGather": False,
                            "runtimeCache": {"enabled": True}},
                   parallelism={"data": 2})
    pod = pod_of(spec)
    ensure = _container(pod, "cachectl-ensure")
    assert cachectl_parser().parse_args(ensure["command"][1:]).component == "all"
    # Both experts map the node's one shared copy: the host budget is the model, once.
    judged, _ = validate(spec, name=OWNER.name, policy=ADMIN)
    assert sizing.dlo_host_bytes(judged) == 54 * sizing.GIB


# --- 10. autoscaling ---------------------------------------------------------------------

def test_autoscaling_is_an_hpa_on_the_queue_scaling_the_deployment_itself() -> None:
    rendered = kids(spec_of(autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 6,
                                         "targetWaitingPerReplica": 3}))
    hpa = rendered["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "ditserve.io/v1alpha1",
                                             "kind": "DiffusionDeployment", "name": "flux"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 6)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["object"]["describedObject"] == {"apiVersion": "v1", "kind": "Service",
                                                   "name": rendered["Service"]["metadata"]["name"]}
    assert metric["object"]["metric"]["name"] == "ditserve_num_requests_waiting"
    assert metric["object"]["target"] == {"type": "AverageValue", "averageValue": "3"}
    assert hpa["metadata"]["ownerReferences"][0]["kind"] == "DiffusionDeployment"
    assert "HorizontalPodAutoscaler" not in kids(spec_of())


@pytest.mark.parametrize(("autoscaling", "complaint"), [
    ({"enabled": True, "minReplicas": 0, "maxReplicas": 4}, "minReplicas must be at least 1"),
    ({"enabled": True, "minReplicas": 5, "maxReplicas": 2}, "maxReplicas (2) must be at least"),
])
def test_autoscaling_refuses_scale_to_zero_and_inverted_bounds(
        autoscaling: dict[str, Any], complaint: str) -> None:
    with pytest.raises(InvalidSpecError, match=complaint.replace("(", r"\(").replace(")", r"\)")):
        validate(spec_of(autoscaling=autoscaling), name=OWNER.name, policy=ADMIN)


# --- every object, oldest and newest supported Kubernetes --------------------------------

VARIANTS = {
    "hardened": spec_of(replicas=3, engine={"resources": {"guaranteedQoS": True},
                                            "args": ["--shutdown-grace", "120"]},
                        scheduling={"replicaSpread": "Required", "requireCachedNodes": True}),
    "autoscaled": spec_of(autoscaling={"enabled": True, "minReplicas": 2, "maxReplicas": 8}),
    "pvc": {"model": {"persistentVolumeClaim": {"claimName": "m"}},
            "cache": {"persistentVolumeClaim": {"claimName": "c"}}},
}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_rendered_object_validates(name: str, version: str) -> None:
    for manifest in kids(VARIANTS[name]).values():
        kubernetes_validate.validate(manifest, version, strict=True)


def test_every_example_deployment_is_judged_valid_and_renders_valid_objects() -> None:
    import yaml
    from k8s.crd_schema import EXAMPLE_PATH, apply_defaults, version_schema

    found = 0
    for path in sorted(EXAMPLE_PATH.parent.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc["kind"] != "DiffusionDeployment":
                continue
            found += 1
            spec = apply_defaults(version_schema(), doc)["spec"]
            judged, _ = validate(spec, name=doc["metadata"]["name"], policy=AdminPolicy())
            owner = Owner(name=doc["metadata"]["name"], namespace="default", uid="u")
            for manifest in render(judged, owner):
                if manifest["kind"] != "LeaderWorkerSet":  # its own schema: test_render_platform
                    for version in K8S_VERSIONS:
                        kubernetes_validate.validate(manifest, version, strict=True)
    assert found >= 5
