"""The Helm chart with the real helm binary: lint --strict and template over a matrix of values,
every rendered object valid for its schema (kubernetes-validate strict; vendored CRD schemas
for ServiceMonitors), and the pieces other components depend on (operator and cachectl command
lines, RBAC, labels, images, the test hook) checked against their real parsers and the
operator's defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s import k8s_schemas
from k8s.chart import CHART, RELEASE_NAMESPACE, by_kind, helm, named, template
from k8s.crd_schema import CRD_PATH, NODECACHE_CRD_PATH

from ditserve.cachectl.cli import build_parser as cachectl_parser
from ditserve.operator.main import build_parser as operator_parser
from ditserve.operator.policy import AdminPolicy
from ditserve.operator.render import DEFAULT_IMAGE

NON_DEFAULT = {
    "image": {"repository": "registry.example/ml/ditserve", "tag": "dev", "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "fullnameOverride": "dits",
    "commonLabels": {"team": "ml"},
    "operator": {"watchNamespaces": ["ml", "ml-dev"], "verbose": True, "livenessPort": 9090,
                 "engineImage": "registry.example/ml/ditserve-engine:dev",
                 "podLabels": {"cost-center": "gpu"},
                 "nodeSelector": {"pool": "system"}, "priorityClassName": "system-cluster-critical"},
    "serviceAccount": {"name": "dits-op", "annotations": {"iam": "role"}},
    "cachectl": {"root": "/data/ditserve-cache", "modelHostPaths": ["/data/models", "/mnt/nfs"],
                 "metricsPort": 9500, "maxBuilds": 1, "podLabels": {"cost-center": "gpu"},
                 # null drops the chart's default GPU selector (Helm merges maps)
                 "nodeSelector": {"nvidia.com/gpu.present": None, "pool": "gpu"}},
    "metrics": {"serviceMonitor": {"enabled": True, "interval": "15s",
                                   "labels": {"release": "prometheus"}}},
}
MATRIX: dict[str, dict[str, Any] | None] = {
    "default": None,
    "non-default": NON_DEFAULT,
    "operator-off": {"operator": {"enabled": False}},
    "cachectl-off": {"cachectl": {"enabled": False}, "metrics": {"serviceMonitor": {"enabled": True}}},
    "no-node-status-no-labels": {"cachectl": {"nodeStatus": {"enabled": False}},
                                 "operator": {"labelCachedNodes": False}, "tests": {"enabled": False}},
    "no-rbac-no-accounts": {"rbac": {"create": False}, "serviceAccount": {"create": False},
                            "cachectl": {"serviceAccount": {"create": False, "name": "node-sa"}}},
    "job-store-redis": {"jobStore": {"redis": {
        "enabled": True, "password": "s3cret", "secretNamespaces": ["ml", "default"],
        "persistence": {"size": "2Gi"}}}},
    "job-store-redis-plain": {"jobStore": {"redis": {"enabled": True}}},
}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("helm")
    return {name: template(tmp, values) for name, values in MATRIX.items()}


@pytest.mark.parametrize("which", sorted(MATRIX))
def test_lint_strict(tmp_path: Path, which: str) -> None:
    args = ["lint", "--strict", str(CHART)]
    if MATRIX[which] is not None:
        (tmp_path / "v.yaml").write_text(yaml.safe_dump(MATRIX[which]))
        args += ["-f", str(tmp_path / "v.yaml")]
    assert "0 chart(s) failed" in helm(tmp_path, *args).stdout


@pytest.mark.parametrize("which", sorted(MATRIX))
def test_rendered_objects_validate(rendered: dict[str, list[dict[str, Any]]], which: str) -> None:
    docs = rendered[which]
    for doc in docs:
        for version in ("1.29.0", k8s_schemas.K8S_VERSION, "1.37.0"):  # oldest to newest
            k8s_schemas.validate(doc, version)
    crds = {d["metadata"]["name"]: d for d in by_kind(docs, "CustomResourceDefinition")}
    assert crds["diffusiondeployments.ditserve.io"] == yaml.safe_load(CRD_PATH.read_text())
    assert crds["nodecaches.ditserve.io"] == yaml.safe_load(NODECACHE_CRD_PATH.read_text())


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
    # Leader election on: a rolling update never runs two reconciling operators at once.
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "RollingUpdate"}
    op = _container(dep)
    assert op["image"] == DEFAULT_IMAGE  # the chart's default is what the operator assumes
    env = {e["name"]: e["value"] for e in op["env"]}
    assert env["DITSERVE_OPERATOR_PEERING"] == "rel-ditserve-operator"
    (peering,) = by_kind(rendered["default"], "ClusterKopfPeering")
    assert peering["metadata"]["name"] == "rel-ditserve-operator"
    # The admin's roots reach the operator as the policy it enforces.
    assert AdminPolicy.from_env(env) == AdminPolicy(
        model_roots=("/mnt/models",), cache_root="/var/cache/ditserve",
        engine_image=DEFAULT_IMAGE, helper_image=DEFAULT_IMAGE)
    assert env["DITSERVE_ENGINE_IMAGE"] == DEFAULT_IMAGE
    assert env["DITSERVE_LABEL_CACHED_NODES"] == "true"
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
    policy = AdminPolicy.from_env({e["name"]: e["value"] for e in op["env"]})
    assert policy.model_roots == ("/data/models", "/mnt/nfs")
    assert policy.cache_root == "/data/ditserve-cache" and policy.pull_secrets == ("regcred",)
    assert policy.helper_image == "registry.example/ml/ditserve:dev"  # the chart's, not engines'
    assert sorted(p["metadata"]["namespace"] for p in by_kind(rendered["non-default"],
                                                              "KopfPeering")) == ["ml", "ml-dev"]
    pod = dep["spec"]["template"]
    assert pod["spec"]["serviceAccountName"] == "dits-op"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["metadata"]["labels"]["cost-center"] == "gpu"
    service = named(rendered["non-default"], "Service", "dits-operator")
    assert service["spec"]["ports"][0]["port"] == 9090
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()


def test_operator_can_be_turned_off(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["operator-off"]
    assert by_kind(docs, "Deployment") == []
    assert all(d["metadata"]["labels"].get("app.kubernetes.io/component") != "operator"
               for d in docs if d["kind"] != "CustomResourceDefinition")
    # The CRDs stay: ditserve's two and kopf's peerings.
    assert len(by_kind(docs, "CustomResourceDefinition")) == 4
    assert by_kind(docs, "DaemonSet")  # and so does the node cache
    (hook,) = by_kind(docs, "Pod")
    assert not any("-operator." in a for a in hook["spec"]["containers"][0]["command"])


def _granted(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {(group, res, verb) for rule in role["rules"] for group in rule["apiGroups"]
            for res in rule["resources"] for verb in rule["verbs"]}


def test_rbac_is_least_privilege(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["default"]
    operator = _granted(named(docs, "ClusterRole", "rel-ditserve-operator"))
    nodes = _granted(named(docs, "ClusterRole", "rel-ditserve-operator-nodes"))
    cachectl = _granted(named(docs, "ClusterRole", "rel-ditserve-cachectl"))
    for granted in (operator, nodes, cachectl):
        assert not any("*" in item for item in granted)
        assert not any(verb in ("deletecollection", "escalate", "bind", "impersonate")
                       for _, _, verb in granted)
        assert not any(res in ("secrets", "namespaces", "customresourcedefinitions")
                       for _, res, _ in granted)
    # Deletes only of the children a spec can stop rendering; update only of the finalizers.
    assert {res for _, res, verb in operator if verb == "delete"} == {
        "deployments", "leaderworkersets", "poddisruptionbudgets", "horizontalpodautoscalers",
        "scaledobjects"}
    assert {res for _, res, verb in operator if verb == "update"} == {
        "diffusiondeployments/finalizers"}
    assert not any(res == "nodes" for _, res, _ in operator)  # namespaced rules only
    for needed in [("ditserve.io", "diffusiondeployments", "watch"),
                   ("ditserve.io", "diffusiondeployments/status", "patch"),
                   ("apps", "deployments", "create"), ("apps", "deployments", "patch"),
                   ("leaderworkerset.x-k8s.io", "leaderworkersets", "create"),
                   ("policy", "poddisruptionbudgets", "create"),
                   ("", "configmaps", "patch"), ("", "services", "create"),
                   ("", "pods", "list"), ("", "events", "create"), ("", "events", "watch")]:
        assert needed in operator, needed
    # Drift repair watches every child it owns; leader election reads and patches its peering.
    for needed in [("", "configmaps", "watch"), ("", "services", "watch"),
                   ("policy", "poddisruptionbudgets", "watch"),
                   ("autoscaling", "horizontalpodautoscalers", "watch"),
                   ("autoscaling", "horizontalpodautoscalers", "patch")]:
        assert needed in operator, needed
    assert nodes == {("ditserve.io", "nodecaches", "get"), ("ditserve.io", "nodecaches", "list"),
                     ("ditserve.io", "nodecaches", "watch"), ("", "nodes", "get"),
                     ("", "nodes", "patch")} | {("kopf.dev", "clusterkopfpeerings", verb)
                                                for verb in ("get", "list", "watch", "patch")}
    # The daemons may only write NodeCache objects and read their Node.
    assert cachectl == {("ditserve.io", "nodecaches", "get"), ("ditserve.io", "nodecaches", "create"),
                        ("ditserve.io", "nodecaches/status", "patch"), ("", "nodes", "get")}
    bindings = {b["metadata"]["name"]: b for b in by_kind(docs, "ClusterRoleBinding")}
    assert set(bindings) == {"rel-ditserve-operator", "rel-ditserve-operator-nodes",
                             "rel-ditserve-cachectl"}
    assert bindings["rel-ditserve-cachectl"]["subjects"] == [
        {"kind": "ServiceAccount", "name": "rel-ditserve-cachectl", "namespace": "ditserve-system"}]

    docs = rendered["non-default"]
    # Namespaced: the namespaced rules only where watched; cluster-scoped ones still cluster-wide.
    assert {b["metadata"]["name"] for b in by_kind(docs, "ClusterRoleBinding")} == {
        "dits-operator-nodes", "dits-cachectl"}
    assert sorted(b["metadata"]["namespace"] for b in by_kind(docs, "RoleBinding")) == ["ml", "ml-dev"]
    docs = rendered["no-node-status-no-labels"]
    assert not any(res == "nodes" for role in by_kind(docs, "ClusterRole")
                   for _, res, _ in _granted(role))
    assert [r["metadata"]["name"] for r in by_kind(docs, "ClusterRole")] == [
        "rel-ditserve-operator", "rel-ditserve-operator-nodes"]
    assert not any(by_kind(rendered["no-rbac-no-accounts"], kind)
                   for kind in ("ClusterRole", "ClusterRoleBinding", "RoleBinding", "ServiceAccount"))


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
    # GPU nodes only, and model directories are never created on a node.
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["cache"]["hostPath"] == {"path": "/var/cache/ditserve", "type": "DirectoryOrCreate"}
    assert volumes["models-0"]["hostPath"] == {"path": "/mnt/models", "type": "Directory"}
    mounts = {m["name"]: m for m in daemon["volumeMounts"]}
    assert mounts["models-0"] == {"name": "models-0", "mountPath": "/mnt/models", "readOnly": True}
    assert daemon["securityContext"]["allowPrivilegeEscalation"] is False
    # The node status writer: its identity, a token, and the node's name.
    assert pod["serviceAccountName"] == "rel-ditserve-cachectl"
    assert pod["automountServiceAccountToken"] is True
    env = {e["name"]: e for e in daemon["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    (svc,) = [s for s in by_kind(rendered["default"], "Service") if s["metadata"]["name"].endswith(
        "-cachectl")]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()

    (ds,) = by_kind(rendered["non-default"], "DaemonSet")
    args = cachectl_parser().parse_args(_container(ds)["command"][1:])
    assert str(args.root) == "/data/ditserve-cache" and args.metrics_port == 9500
    assert args.max_builds == 1
    assert ds["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "gpu"}
    assert ds["spec"]["template"]["metadata"]["labels"]["cost-center"] == "gpu"
    assert ds["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    mounts = [m["mountPath"] for m in _container(ds)["volumeMounts"]]
    assert {"/data/models", "/mnt/nfs", "/data/ditserve-cache"} <= set(mounts)

    (ds,) = by_kind(rendered["no-node-status-no-labels"], "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod
    assert "NODE_NAME" not in {e["name"] for e in _container(ds)["env"]}
    (ds,) = by_kind(rendered["no-rbac-no-accounts"], "DaemonSet")
    assert ds["spec"]["template"]["spec"]["serviceAccountName"] == "node-sa"


def test_cachectl_can_be_disabled(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["cachectl-off"]
    assert by_kind(docs, "DaemonSet") == []
    assert [m["metadata"]["name"] for m in by_kind(docs, "ServiceMonitor")] == ["rel-ditserve-engines"]


def test_service_monitors_select_what_the_operator_and_chart_label(
        rendered: dict[str, list[dict[str, Any]]]) -> None:
    from ditserve.operator.render import Owner, render
    from ditserve.operator.spec import parse_spec

    assert by_kind(rendered["default"], "ServiceMonitor") == []
    docs = rendered["non-default"]
    engines = named(docs, "ServiceMonitor", "dits-engines")
    assert engines["metadata"]["labels"]["release"] == "prometheus"
    assert engines["spec"]["namespaceSelector"] == {"matchNames": ["ml", "ml-dev"]}
    (endpoint,) = engines["spec"]["endpoints"]
    assert (endpoint["path"], endpoint["interval"]) == ("/metrics", "15s")
    # An engine Service the operator renders is selected, by its labels and its port's name.
    kids = render(parse_spec({"model": {"hostPath": "/mnt/models/m"}}), Owner("flux", "ml", "u"))
    (service,) = [k for k in kids if k["kind"] == "Service"]
    assert engines["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    daemons = named(docs, "ServiceMonitor", "dits-cachectl")
    (svc,) = [s for s in by_kind(docs, "Service") if s["metadata"]["name"] == "dits-cachectl"]
    assert daemons["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()


def test_helm_test_hook_probes_the_operator_and_a_daemon(
        rendered: dict[str, list[dict[str, Any]]]) -> None:
    from k8s.test_render import _violates_restricted

    (hook,) = by_kind(rendered["non-default"], "Pod")
    assert hook["metadata"]["annotations"]["helm.sh/hook"] == "test"
    command = hook["spec"]["containers"][0]["command"]
    assert command[:2] == ["python", "-c"]
    compile(command[2], "<helm test>", "exec")  # the script is valid Python
    assert command[3:] == ["http://dits-operator.ditserve-system.svc:9090/healthz",
                           "http://dits-cachectl.ditserve-system.svc:9500/metrics"]
    assert _violates_restricted(hook["spec"]) == []
    assert by_kind(rendered["no-node-status-no-labels"], "Pod") == []  # tests.enabled false


@pytest.mark.parametrize(("values", "complaint"), [
    ({"cachectl": {"root": "relative/path"}}, "/cachectl/root"),
    ({"operator": {"watchNamespaces": ["Not_A_Namespace"]}}, "/operator/watchNamespaces/0"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"operator": {"replicas": 6}}, "/operator/replicas"),
    # Two operators without leader election would both reconcile.
    ({"operator": {"replicas": 2, "leaderElection": {"enabled": False}}}, "needs operator.leader"),
    ({"cachectl": {"modelHostPaths": ["models"]}}, "/cachectl/modelHostPaths/0"),
    # The node's whole root as the cache (engine pods would mount it), and ".." segments the
    # API server refuses (and the operator would read as another directory).
    ({"cachectl": {"root": "/"}}, "/cachectl/root"),
    ({"cachectl": {"root": "/var/../etc"}}, "/cachectl/root"),
    ({"cachectl": {"modelHostPaths": ["/mnt/../etc"]}}, "/cachectl/modelHostPaths/0"),
    # One path for two of the daemon's volumes: a pod the API server refuses.
    ({"cachectl": {"modelHostPaths": ["/var/cache/ditserve/"]}}, "where the daemon mounts its cache"),
    ({"cachectl": {"modelHostPaths": ["/tmp"]}}, "its scratch space"),
    ({"nameOverride": "Foo_Bar"}, "/nameOverride"),
    ({"metrics": {"serviceMonitor": {"interval": "often"}}}, "/metrics/serviceMonitor/interval"),
])
def test_values_schema_rejects_bad_values(tmp_path: Path, values: dict[str, Any],
                                          complaint: str) -> None:
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(values))
    result = helm(tmp_path, "template", "rel", str(CHART), "-f", str(tmp_path / "bad.yaml"),
                  check=False)
    assert result.returncode != 0 and complaint in result.stderr, result.stderr


def test_an_empty_model_path_list_allows_no_node_directory(tmp_path: Path) -> None:
    # An admin with PVC-only models sets the list empty: that must not mean the default root.
    (tmp_path / "none.yaml").write_text(yaml.safe_dump({"cachectl": {"modelHostPaths": []}}))
    docs = [d for d in yaml.safe_load_all(helm(tmp_path, "template", "rel", str(CHART), "-f",
                                               str(tmp_path / "none.yaml")).stdout) if d]
    (dep,) = by_kind(docs, "Deployment")
    policy = AdminPolicy.from_env({e["name"]: e["value"] for e in _container(dep)["env"]})
    assert policy.model_roots == ()
    assert not policy.allows_model_path("/mnt/models/flux")
    assert AdminPolicy.from_env({}).model_roots == ("/mnt/models",)  # unset: the default


def test_notes_tell_how_to_apply_and_wait(tmp_path: Path) -> None:
    out = helm(tmp_path, "install", "rel", str(CHART), "--dry-run=client",
               "--namespace", "ditserve-system").stdout
    notes = out[out.index("NOTES:"):]
    assert "kubectl apply -f examples/deployment.yaml" in notes
    assert "--for=condition=Ready" in notes
    assert "kubectl get nodecaches" in notes


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


def test_the_job_store_redis_admits_only_engine_pods(
        rendered: dict[str, list[dict[str, Any]]]) -> None:
    from ditserve.operator.render import labels
    from ditserve.operator.spec import parse_spec

    assert by_kind(rendered["default"], "NetworkPolicy") == []  # off by default
    docs = rendered["job-store-redis"]
    redis = named(docs, "Deployment", "rel-ditserve-redis")
    policy = named(docs, "NetworkPolicy", "rel-ditserve-redis")
    pod_labels = redis["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    # The operator's own labels on engine pods are the only ones admitted, from any namespace.
    engine = labels("wan", parse_spec({"model": {"hostPath": "/mnt/models/wan"}}))
    assert peer["namespaceSelector"] == {}
    assert peer["podSelector"]["matchLabels"].items() <= engine.items()
    assert rule["ports"] == [{"port": "redis", "protocol": "TCP"}]
    secrets = by_kind(docs, "Secret")
    assert sorted(s["metadata"]["namespace"] for s in secrets) == ["default", RELEASE_NAMESPACE, "ml"]
    assert {s["stringData"]["url"] for s in secrets} == {
        f"redis://:s3cret@rel-ditserve-redis.{RELEASE_NAMESPACE}.svc:6379/0"}
    container = _container(redis)
    assert "--requirepass" in container["args"][0] and "s3cret" not in str(container)
    assert container["securityContext"]["readOnlyRootFilesystem"]
    claim = named(docs, "PersistentVolumeClaim", "rel-ditserve-redis")
    assert claim["spec"]["resources"]["requests"]["storage"] == "2Gi"
    plain = rendered["job-store-redis-plain"]
    (secret,) = by_kind(plain, "Secret")
    assert secret["stringData"]["url"] == f"redis://rel-ditserve-redis.{RELEASE_NAMESPACE}.svc:6379/0"
    assert "env" not in _container(named(plain, "Deployment", "rel-ditserve-redis"))
