"""render(spec) -> manifests: topology, volumes, probes, env, memory, labels, and every
manifest valid against the Kubernetes OpenAPI schemas (kubernetes-validate, strict)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml

from ditserve.engine.config import EngineConfig
from ditserve.operator import sizing
from ditserve.operator.errors import InvalidSpecError
from ditserve.operator.policy import AdminPolicy
from ditserve.operator.render import (
    CONFIG_HASH_ANNOTATION,
    Owner,
    adopt,
    render,
    selector_labels,
)
from ditserve.operator.spec import parse_spec

K8S_VERSION = "1.33.0"
OWNER = Owner(name="flux", namespace="models", uid="0b9e7b5c-1111-2222-3333-444455556666",
              generation=7)
GIB = 1024**3


def spec_of(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": {"hostPath": "/mnt/models/flux", "sizeGiB": 24}}
    base.update(overrides)
    return base


def children(spec: dict[str, Any], **kw: Any) -> dict[str, dict[str, Any]]:
    manifests = adopt(render(parse_spec(spec), OWNER, **kw), OWNER)
    return {m["kind"]: m for m in manifests}


def pod_of(spec: dict[str, Any]) -> dict[str, Any]:
    return children(spec)["Deployment"]["spec"]["template"]["spec"]


def engine_of(spec: dict[str, Any]) -> dict[str, Any]:
    (engine,) = pod_of(spec)["containers"]
    return engine


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def mebi(n_gib: float) -> str:
    return f"{int(n_gib * 1024)}Mi"


VARIANTS = {
    "minimal": spec_of(),
    "dp4-offload-cache": spec_of(parallelism={"data": 4}, replicas=2,
                                 offload={"enabled": True, "runtimeCache": {"enabled": True}},
                                 compile={"enabled": True}),
    "sp2-no-allgather-resident": spec_of(parallelism={"sequence": 2},
                                         offload={"enabled": True, "useAllGather": False,
                                                  "residentLayers": 8}),
    "pvc-restricted": {
        "model": {"persistentVolumeClaim": {"claimName": "models", "subPath": "flux"},
                  "dtype": "float16"},
        "cache": {"persistentVolumeClaim": {"claimName": "ditserve-cache"}},
        "engine": {"apiKeySecret": {"name": "flux-key"}, "env": [{"name": "LOG_LEVEL",
                                                                   "value": "debug"}],
                   "args": ["--log-level", "debug"], "port": 9000},
        "scheduling": {"nodeSelector": {"gpu": "h100"},
                       "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                        "effect": "NoSchedule"}],
                       "priorityClassName": "inference", "runtimeClassName": "nvidia",
                       "affinity": {"nodeAffinity": {
                           "requiredDuringSchedulingIgnoredDuringExecution": {
                               "nodeSelectorTerms": [{"matchExpressions": [
                                   {"key": "zone", "operator": "In", "values": ["a"]}]}]}}}},
        "rollout": {"maxUnavailable": "25%", "maxSurge": 1},
    },
    "no-cache": spec_of(cache={"mode": "None"}, replicas=0),
}


@pytest.mark.parametrize("version", ["1.29.0", K8S_VERSION, "1.37.0"])  # oldest to newest
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_manifest_validates_against_kubernetes_schemas(name: str, version: str) -> None:
    for manifest in children(VARIANTS[name]).values():
        kubernetes_validate.validate(manifest, version, strict=True)


@pytest.mark.parametrize(("dp", "sp", "gpus"), [(1, 1, 1), (2, 1, 2), (1, 4, 4), (2, 4, 8)])
def test_gpus_per_pod_come_from_the_topology(dp: int, sp: int, gpus: int) -> None:
    engine = engine_of(spec_of(parallelism={"data": dp, "sequence": sp}, replicas=3))
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == str(gpus)
    assert engine["resources"]["requests"]["nvidia.com/gpu"] == str(gpus)
    env = env_of(engine)
    assert env["WORLD_SIZE"] == str(gpus)
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == "29500"


def test_engine_config_map_matches_the_engine_contract() -> None:
    kids = children(VARIANTS["dp4-offload-cache"])
    data = yaml.safe_load(kids["ConfigMap"]["data"]["engine.yaml"])
    assert data.pop("server") == {"host": "0.0.0.0", "port": 8000}
    config = EngineConfig.from_mapping(data)  # the engine reads back exactly this
    assert config.parallel.data_parallel_size == 4 and config.parallel.sequence_parallel_size == 1
    assert config.offload.enabled and config.offload.runtime_cache and config.offload.use_allgather
    assert config.model == "/models/model" and config.dtype == "bfloat16"
    assert config.compile == "inductor"
    minimal = yaml.safe_load(children(VARIANTS["minimal"])["ConfigMap"]["data"]["engine.yaml"])
    assert minimal.get("compile") is None  # not enabled: the engine runs the blocks eagerly
    engine = kids["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert engine["command"] == ["ditserve", "serve", "--config", "/etc/ditserve/engine.yaml"]


def test_config_change_rolls_the_pods() -> None:
    def config_hash(spec: dict[str, Any]) -> str:
        return children(spec)["Deployment"]["spec"]["template"]["metadata"]["annotations"][
            CONFIG_HASH_ANNOTATION]

    assert config_hash(spec_of()) == config_hash(spec_of())
    assert config_hash(spec_of()) != config_hash(spec_of(batching={"maxNumSeqs": 8}))


def test_hostpath_volumes_probes_and_cache_mounts() -> None:
    pod = pod_of(spec_of())
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model"]["hostPath"] == {"path": "/mnt/models/flux", "type": "Directory"}
    assert volumes["cache"]["hostPath"] == {"path": "/var/cache/ditserve", "type": "Directory"}
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    engine = pod["containers"][0]
    mounts = {m["name"]: m for m in engine["volumeMounts"]}
    assert mounts["cache"] == {"name": "cache", "mountPath": "/var/cache/ditserve", "readOnly": True}
    assert mounts["model"]["readOnly"] is True and mounts["shm"]["mountPath"] == "/dev/shm"
    assert engine["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert engine["livenessProbe"]["httpGet"]["path"] == "/health"
    # 300 s + 20 s/GiB for 24 GiB = 780 s, probed every 10 s.
    assert engine["startupProbe"]["httpGet"]["path"] == "/health"
    assert engine["startupProbe"]["failureThreshold"] * engine["startupProbe"]["periodSeconds"] == 780
    assert env_of(engine)["DITSERVE_CACHE_ROOT"] == "/var/cache/ditserve"

    (init,) = pod["initContainers"]
    # The daemon opens the model by path: the init container names it by its node path, asks
    # for every DiT of the model, and only asks: the daemon writes the cache, not this pod.
    assert init["command"] == ["cachectl", "ensure", "--model", "/mnt/models/flux", "--dtype",
                               "bfloat16", "--component", "all", "--root", "/var/cache/ditserve",
                               "--timeout", "1320", "--daemon-only"]
    init_mounts = {m["name"]: m for m in init["volumeMounts"]}
    assert init_mounts["model"]["mountPath"] == "/mnt/models/flux"
    assert init_mounts["cache"]["readOnly"] is True


def test_sp_pods_ensure_the_cache_entry_their_engines_join() -> None:
    (init,) = pod_of(spec_of(parallelism={"sequence": 2}))["initContainers"]
    # The engine passes (sp_size 2, ulysses) to the cache identity; so does the init container.
    assert init["command"][-5:-1] == ["--sp-size", "2", "--sp-impl", "ulysses"]
    (plain,) = pod_of(spec_of())["initContainers"]
    assert "--sp-size" not in plain["command"]


def test_explicit_startup_timeout_wins() -> None:
    engine = engine_of(spec_of(probes={"startupTimeoutSeconds": 95}))
    probe = engine["startupProbe"]
    assert probe["failureThreshold"] == 10 and probe["periodSeconds"] == 10


def test_pvc_volumes_api_key_env_scheduling_and_rollout() -> None:
    kids = children(VARIANTS["pvc-restricted"])
    dep = kids["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert volumes["cache"]["persistentVolumeClaim"] == {"claimName": "ditserve-cache"}
    engine = pod["containers"][0]
    model_mount = next(m for m in engine["volumeMounts"] if m["name"] == "model")
    assert model_mount["subPath"] == "flux"
    # The daemon cannot see a PVC: the init container builds or joins under the lock itself.
    (init,) = pod["initContainers"]
    assert init["command"][:4] == ["cachectl", "ensure", "--model", "/models/model"]
    assert init["command"][-1] == "--no-daemon"
    env = env_of(engine)
    assert env["DITSERVE_API_KEY"] == {"secretKeyRef": {"name": "flux-key", "key": "api-key"}}
    assert env["LOG_LEVEL"] == "debug"
    assert engine["args"] == ["--log-level", "debug"]
    assert engine["ports"][0]["containerPort"] == 9000
    assert kids["Service"]["spec"]["ports"][0]["port"] == 9000
    assert pod["nodeSelector"] == {"gpu": "h100"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["priorityClassName"] == "inference" and pod["runtimeClassName"] == "nvidia"
    assert "nodeAffinity" in pod["affinity"]
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": "25%"}


def test_default_rollout_never_surges() -> None:
    dep = children(spec_of())["Deployment"]
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate",
                                       "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}


def _violates_restricted(pod: dict[str, Any]) -> list[str]:
    """The Pod Security 'restricted' checks that a pod spec alone decides."""
    out = [f"hostPath volume {v['name']}" for v in pod.get("volumes", []) if "hostPath" in v]
    if not pod.get("securityContext", {}).get("runAsNonRoot"):
        out.append("pod runAsNonRoot")
    if pod.get("securityContext", {}).get("seccompProfile", {}).get("type") != "RuntimeDefault":
        out.append("pod seccompProfile")
    for c in pod["containers"] + pod.get("initContainers", []):
        sc = c.get("securityContext", {})
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{c['name']} allowPrivilegeEscalation")
        if sc.get("capabilities", {}).get("drop") != ["ALL"]:
            out.append(f"{c['name']} capabilities")
        if sc.get("privileged"):
            out.append(f"{c['name']} privileged")
    return out


def test_pvc_pods_meet_the_restricted_pod_security_level() -> None:
    assert _violates_restricted(pod_of(VARIANTS["pvc-restricted"])) == []
    # hostPath is the only thing keeping the default pods out of it.
    assert _violates_restricted(pod_of(spec_of())) == ["hostPath volume model",
                                                       "hostPath volume cache"]


def test_no_cache_mode_has_no_init_container_nor_cache_volume() -> None:
    pod = pod_of(VARIANTS["no-cache"])
    assert "initContainers" not in pod
    assert "cache" not in {v["name"] for v in pod["volumes"]}
    assert "DITSERVE_CACHE_ROOT" not in env_of(pod["containers"][0])


@pytest.mark.parametrize(("offload", "parallelism", "host_gib"), [
    ({}, {"data": 2}, 0),                                                  # weights on the GPU
    ({"enabled": True}, {"data": 4}, 24),                                  # 4 ranks x 1/4 shard
    ({"enabled": True}, {"data": 2, "sequence": 2}, 48),                   # DP group of 2, 4 ranks
    ({"enabled": True, "useAllGather": False}, {"data": 2}, 48),           # a full copy per rank
    ({"enabled": True, "useAllGather": False, "runtimeCache": {"enabled": True}},
     {"data": 2}, 24),                                                     # one shared mapping
    ({"enabled": True}, {}, 24),                                           # group of 1: full copy
])
def test_memory_includes_the_offload_modes_host_memory(offload: dict[str, Any],
                                                       parallelism: dict[str, Any],
                                                       host_gib: int) -> None:
    spec = spec_of(offload=offload, parallelism=parallelism)
    assert sizing.dlo_host_bytes(parse_spec(spec)) == host_gib * GIB
    resources = engine_of(spec)["resources"]
    # engine 16Gi + DLO host memory + 8Gi of /dev/shm; request = limit.
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == mebi(16 + host_gib + 8)
    assert "cpu" not in resources["limits"]


def test_labels_selector_and_ownership() -> None:
    kids = children(spec_of())
    for manifest in kids.values():
        labels = manifest["metadata"]["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "ditserve-operator"
        assert labels["app.kubernetes.io/instance"] == "flux"
        assert manifest["metadata"]["namespace"] == "models"
        (ref,) = manifest["metadata"]["ownerReferences"]
        assert ref == {"apiVersion": "ditserve.io/v1alpha1", "kind": "DiffusionDeployment",
                       "name": "flux", "uid": OWNER.uid, "controller": True,
                       "blockOwnerDeletion": True}
        assert manifest["metadata"]["annotations"]["ditserve.io/generation"] == "7"
    dep = kids["Deployment"]
    assert dep["spec"]["selector"]["matchLabels"] == selector_labels("flux")
    template_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert selector_labels("flux").items() <= template_labels.items()
    assert kids["Service"]["spec"]["selector"] == selector_labels("flux")


def test_image_comes_from_the_spec_or_the_operator_default() -> None:
    assert engine_of(spec_of())["image"] == "ghcr.io/ditserve/ditserve:0.1.0"
    kids = children(spec_of(), policy=AdminPolicy(engine_image="registry.example/ditserve:dev"))
    assert kids["Deployment"]["spec"]["template"]["spec"]["containers"][0]["image"] == (
        "registry.example/ditserve:dev")
    assert engine_of(spec_of(engine={"image": "mine:1"}))["image"] == "mine:1"


def test_render_refuses_a_spec_the_engine_rejects() -> None:
    spec = parse_spec(spec_of(offload={"enabled": False, "residentLayers": 2}))
    with pytest.raises(InvalidSpecError, match="only apply with offload enabled"):
        render(spec, OWNER)
