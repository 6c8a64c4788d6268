"""The Helm chart with the real helm binary: lint --strict, template with default and
non-default values, every rendered manifest valid against the Kubernetes OpenAPI schemas,
and the pieces other components depend on (operator and cachectl command lines, RBAC, labels,
image) checked against their real parsers and the operator's defaults."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from k8s.conftest import require_tool
from k8s.crd_schema import CRD_PATH, REPO

from ditserve.cachectl.cli import build_parser as cachectl_parser
from ditserve.operator.main import build_parser as operator_parser
from ditserve.operator.render import DEFAULT_IMAGE

CHART = REPO / "charts" / "ditserve"
K8S_VERSION = "1.33.0"
NON_DEFAULT = {
    "image": {"repository": "registry.example/ml/ditserve", "tag": "dev", "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "fullnameOverride": "dits",
    "commonLabels": {"team": "ml"},
    "operator": {"watchNamespaces": ["ml", "ml-dev"], "verbose": True, "livenessPort": 9090,
                 "engineImage": "registry.example/ml/ditserve-engine:dev",
                 "nodeSelector": {"pool": "system"}, "priorityClassName": "system-cluster-critical"},
    "serviceAccount": {"name": "dits-op", "annotations": {"iam": "role"}},
    "cachectl": {"root": "/data/ditserve-cache", "modelHostPaths": ["/data/models", "/mnt/nfs"],
                 "metricsPort": 9500, "maxBuilds": 1,
                 "nodeSelector": {"nvidia.com/gpu.present": "true"}},
}


def helm(tmp_path: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {"HELM_CACHE_HOME": str(tmp_path / "c"), "HELM_CONFIG_HOME": str(tmp_path / "cf"),
           "HELM_DATA_HOME": str(tmp_path / "d"), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([require_tool("helm"), *args], capture_output=True, text=True,
                            env=env, timeout=120)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def template(tmp_path: Path, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    args = ["template", "rel", str(CHART), "--namespace", "ditserve-system", "--include-crds"]
    if values is not None:
        path = tmp_path / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        args += ["-f", str(path)]
    out = helm(tmp_path, *args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("helm")
    return {"default": template(tmp), "non-default": template(tmp, NON_DEFAULT)}


@pytest.mark.parametrize("values", [None, NON_DEFAULT], ids=["default", "non-default"])
def test_lint_strict(tmp_path: Path, values: dict[str, Any] | None) -> None:
    args = ["lint", "--strict", str(CHART)]
    if values is not None:
        (tmp_path / "v.yaml").write_text(yaml.safe_dump(values))
        args += ["-f", str(tmp_path / "v.yaml")]
    assert "0 chart(s) failed" in helm(tmp_path, *args).stdout


@pytest.mark.parametrize("which", ["default", "non-default"])
def test_rendered_manifests_validate(rendered: dict[str, list[dict[str, Any]]], which: str) -> None:
    docs = rendered[which]
    assert {d["kind"] for d in docs} >= {"CustomResourceDefinition", "ServiceAccount",
                                         "ClusterRole", "Deployment"}
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    (crd,) = by_kind(docs, "CustomResourceDefinition")
    assert crd == yaml.safe_load(CRD_PATH.read_text())


def test_standard_labels_everywhere(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for which, docs in rendered.items():
        for doc in docs:
            if doc["kind"] == "CustomResourceDefinition":
                continue  # crds/ is not templated
            labels = doc["metadata"]["labels"]
            for key in ("app.kubernetes.io/name", "app.kubernetes.io/instance",
                        "app.kubernetes.io/version", "app.kubernetes.io/managed-by",
                        "app.kubernetes.io/component", "helm.sh/chart"):
                assert key in labels, (which, doc["kind"], key)
            assert labels["app.kubernetes.io/managed-by"] == "Helm"
    assert all(d["metadata"]["labels"].get("team") == "ml"
               for d in rendered["non-default"] if d["kind"] != "CustomResourceDefinition")


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]["containers"][0]


def test_operator_deployment(rendered: dict[str, list[dict[str, Any]]]) -> None:
    (dep,) = by_kind(rendered["default"], "Deployment")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    op = _container(dep)
    assert op["image"] == DEFAULT_IMAGE  # the chart's default is what the operator assumes
    env = {e["name"]: e["value"] for e in op["env"]}
    assert env["DITSERVE_ENGINE_IMAGE"] == DEFAULT_IMAGE
    assert op["securityContext"]["readOnlyRootFilesystem"] and env["HOME"] == "/tmp"
    assert op["command"][0] == "ditserve-operator"
    args = operator_parser().parse_args(op["command"][1:])
    assert args.namespace == [] and args.liveness_port == 8080
    assert op["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "liveness"}
    assert op["securityContext"]["runAsNonRoot"] and op["resources"]["limits"]["memory"]

    (dep,) = by_kind(rendered["non-default"], "Deployment")
    op = _container(dep)
    assert op["image"] == "registry.example/ml/ditserve:dev"
    args = operator_parser().parse_args(op["command"][1:])
    assert args.namespace == ["ml", "ml-dev"] and args.verbose and args.liveness_port == 9090
    assert {e["name"]: e["value"] for e in op["env"]}["DITSERVE_ENGINE_IMAGE"] == (
        "registry.example/ml/ditserve-engine:dev")
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "dits-op"


def test_rbac_is_least_privilege(rendered: dict[str, list[dict[str, Any]]]) -> None:
    (role,) = by_kind(rendered["default"], "ClusterRole")
    granted = {(group, res, verb) for rule in role["rules"] for group in rule["apiGroups"]
               for res in rule["resources"] for verb in rule["verbs"]}
    assert not any("*" in item for item in granted)
    assert not any(verb in ("delete", "deletecollection", "update", "escalate", "bind", "impersonate")
                   for _, _, verb in granted)
    assert not any(res in ("secrets", "namespaces", "nodes", "customresourcedefinitions")
                   for _, res, _ in granted)
    for needed in [("ditserve.io", "diffusiondeployments", "watch"),
                   ("ditserve.io", "diffusiondeployments/status", "patch"),
                   ("apps", "deployments", "create"), ("apps", "deployments", "patch"),
                   ("", "configmaps", "patch"), ("", "services", "create"),
                   ("", "pods", "list"), ("", "events", "create")]:
        assert needed in granted, needed
    (binding,) = by_kind(rendered["default"], "ClusterRoleBinding")
    assert binding["subjects"][0]["namespace"] == "ditserve-system"

    docs = rendered["non-default"]
    assert by_kind(docs, "ClusterRoleBinding") == []
    assert sorted(b["metadata"]["namespace"] for b in by_kind(docs, "RoleBinding")) == ["ml", "ml-dev"]


def test_cachectl_daemonset(rendered: dict[str, list[dict[str, Any]]]) -> None:
    (ds,) = by_kind(rendered["default"], "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    daemon = _container(ds)
    assert daemon["command"][0] == "cachectl"
    args = cachectl_parser().parse_args(daemon["command"][1:])
    assert args.command == "serve"
    assert str(args.root) == "/var/cache/ditserve" and args.metrics_port == 9400
    assert daemon["ports"] == [{"name": "metrics", "containerPort": 9400, "protocol": "TCP"}]
    assert "/var/cache/ditserve/cachectl.sock" in daemon["livenessProbe"]["exec"]["command"][-1]
    assert daemon["resources"]["limits"]["memory"] and daemon["resources"]["limits"]["cpu"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["cache"]["hostPath"] == {"path": "/var/cache/ditserve", "type": "DirectoryOrCreate"}
    assert volumes["models-0"]["hostPath"]["path"] == "/mnt/models"
    mounts = {m["name"]: m for m in daemon["volumeMounts"]}
    assert mounts["models-0"] == {"name": "models-0", "mountPath": "/mnt/models", "readOnly": True}
    assert daemon["securityContext"]["allowPrivilegeEscalation"] is False

    (ds,) = by_kind(rendered["non-default"], "DaemonSet")
    args = cachectl_parser().parse_args(_container(ds)["command"][1:])
    assert str(args.root) == "/data/ditserve-cache" and args.metrics_port == 9500
    assert args.max_builds == 1
    assert ds["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    mounts = [m["mountPath"] for m in _container(ds)["volumeMounts"]]
    assert {"/data/models", "/mnt/nfs", "/data/ditserve-cache"} <= set(mounts)


def test_cachectl_can_be_disabled(tmp_path: Path) -> None:
    docs = template(tmp_path, {"cachectl": {"enabled": False}})
    assert by_kind(docs, "DaemonSet") == []


@pytest.mark.parametrize(("values", "complaint"), [
    ({"cachectl": {"root": "relative/path"}}, "/cachectl/root"),
    ({"operator": {"watchNamespaces": ["Not_A_Namespace"]}}, "/operator/watchNamespaces/0"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"operator": {"replicas": 2}}, "replicas"),
])
def test_values_schema_rejects_bad_values(tmp_path: Path, values: dict[str, Any],
                                          complaint: str) -> None:
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(values))
    result = helm(tmp_path, "template", "rel", str(CHART), "-f", str(tmp_path / "bad.yaml"),
                  check=False)
    assert result.returncode != 0 and complaint in result.stderr, result.stderr


def test_notes_tell_how_to_apply_and_wait(tmp_path: Path) -> None:
    out = helm(tmp_path, "install", "rel", str(CHART), "--dry-run=client",
               "--namespace", "ditserve-system").stdout
    notes = out[out.index("NOTES:"):]
    assert "kubectl apply -f examples/deployment.yaml" in notes
    assert "--for=condition=Ready" in notes


def test_example_models_are_visible_to_the_default_daemon(
        rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The daemon builds entries by the model's node path: the example's hostPath must lie
    under a directory the default DaemonSet mounts at the same path."""
    from k8s.crd_schema import EXAMPLE_PATH

    (ds,) = by_kind(rendered["default"], "DaemonSet")
    mounted = [m["mountPath"] for m in _container(ds)["volumeMounts"]
               if m["name"].startswith("models-")]
    host_path = yaml.safe_load(EXAMPLE_PATH.read_text())["spec"]["model"]["hostPath"]
    assert any(host_path.startswith(root.rstrip("/") + "/") for root in mounted)
