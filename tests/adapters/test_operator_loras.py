"""``spec.loras`` in a DiffusionDeployment: admitted by the CRD, mounted read-only in every
engine pod, rendered as ``--lora-modules`` and into the engine config every rank reads;
bad entries land as precise spec problems."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml
from k8s.crd_schema import schema_errors  # type: ignore[import-not-found]

from ditserve.operator.errors import InvalidSpecError
from ditserve.operator.render import Owner, render
from ditserve.operator.spec import parse_spec

OWNER = Owner(name="flux", namespace="models", uid="0b9e7b5c-1111-2222-3333-444455556666",
              generation=1)
LORAS = [{"name": "style", "hostPath": "/mnt/models/loras/style.safetensors"},
         {"name": "detail", "persistentVolumeClaim": {"claimName": "loras",
                                                      "subPath": "detail"}}]


def spec_of(**extra: Any) -> dict[str, Any]:
    return {"model": {"hostPath": "/mnt/models/flux", "sizeGiB": 24}, "loras": LORAS, **extra}


def kinds(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["kind"]: m for m in render(parse_spec(spec), OWNER)}


def test_loras_are_mounted_read_only_and_served() -> None:
    manifests = kinds(spec_of())
    pod = manifests["Deployment"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["lora-style"]["hostPath"] == {"path": "/mnt/models/loras/style.safetensors",
                                                 "type": "File"}
    assert volumes["lora-detail"]["persistentVolumeClaim"] == {"claimName": "loras",
                                                               "readOnly": True}
    (engine,) = pod["containers"]
    mounts = {m["name"]: m for m in engine["volumeMounts"]}
    assert mounts["lora-style"] == {"name": "lora-style", "readOnly": True,
                                    "mountPath": "/loras/style/style.safetensors"}
    assert mounts["lora-detail"] == {"name": "lora-detail", "readOnly": True,
                                     "mountPath": "/loras/detail", "subPath": "detail"}
    args = engine["args"]
    assert args[args.index("--lora-modules"):] == [
        "--lora-modules", "style=/loras/style/style.safetensors", "detail=/loras/detail"]
    config = yaml.safe_load(manifests["ConfigMap"]["data"]["engine.yaml"])
    assert config["adapters"]["lora_modules"] == {
        "style": "/loras/style/style.safetensors", "detail": "/loras/detail"}
    for manifest in manifests.values():
        kubernetes_validate.validate(manifest, "1.33.0", strict=True)


def test_every_rank_of_a_multi_node_replica_mounts_them() -> None:
    manifests = kinds(spec_of(parallelism={"data": 2, "sequence": 8}))
    lws = manifests["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    for template in (lws["leaderTemplate"], lws["workerTemplate"]):
        (engine,) = template["spec"]["containers"]
        assert {"lora-style", "lora-detail"} <= {m["name"] for m in engine["volumeMounts"]}


def test_the_crd_admits_loras_and_rejects_bad_ones() -> None:
    cr = {"apiVersion": "ditserve.io/v1alpha1", "kind": "DiffusionDeployment",
          "metadata": {"name": "flux", "namespace": "models"}, "spec": spec_of()}
    assert schema_errors(cr) == []
    bad = {**cr, "spec": spec_of(loras=[{"name": "Bad_Name", "hostPath": "/x"}])}
    assert schema_errors(bad)


@pytest.mark.parametrize(("loras", "message"), [
    ([{"name": "a"}], "exactly one of hostPath or persistentVolumeClaim"),
    ([{"name": "a", "hostPath": "relative/x"}], "hostPath must be an absolute path"),
    ([{"name": "a", "hostPath": "/x"}, {"name": "a", "hostPath": "/y"}], "listed twice"),
    ([{"name": "a", "persistentVolumeClaim": {"claimName": "c", "subPath": "../x"}}],
     "without '..'"),
    ([{"name": "UPPER", "hostPath": "/x"}], "lowercase"),
])
def test_bad_loras_are_spec_problems(loras: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        parse_spec({"model": {"hostPath": "/m"}, "loras": loras})


def test_lora_host_paths_must_lie_under_the_admin_roots() -> None:
    from ditserve.operator.policy import AdminPolicy

    policy = AdminPolicy.from_env({"DITSERVE_MODEL_HOST_PATHS": "/mnt/models"})
    assert policy.problems(parse_spec(spec_of())) == []
    outside = parse_spec(spec_of(loras=[{"name": "x", "hostPath": "/var/lib/kubelet/x"}]))
    (problem,) = policy.problems(outside)
    assert "loras[x].hostPath '/var/lib/kubelet/x' is outside" in problem
