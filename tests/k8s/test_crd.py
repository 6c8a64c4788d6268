"""The DiffusionDeployment CRD: a valid, structural CRD whose schema accepts the example and
every CR the tests use, rejects invalid ones for the right reason (schema and CEL rules,
the latter evaluated with cel-python), and whose defaults equal the operator's."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import celpy
import kubernetes_validate
import pytest
import yaml
from k8s.crd_schema import (
    CHART_CRD_PATH,
    EXAMPLE_PATH,
    apply_defaults,
    load_crd,
    schema_errors,
    version_schema,
)

from ditserve.operator.judge import validate
from ditserve.operator.spec import DeploymentSpec, parse_spec


def cel_errors(obj: dict[str, Any]) -> list[str]:
    """Every x-kubernetes-validations rule the (defaulted) object breaks, as its message."""
    env = celpy.Environment()
    out: list[str] = []

    def walk(schema: dict[str, Any], value: Any) -> None:
        for rule in schema.get("x-kubernetes-validations", []):
            program = env.program(env.compile(rule["rule"]))
            if not program.evaluate({"self": celpy.json_to_cel(value)}):
                out.append(rule["message"])
        if isinstance(value, dict):
            for key, sub in (schema.get("properties") or {}).items():
                if key in value:
                    walk(sub, value[key])
        elif isinstance(value, list) and "items" in schema:
            for item in value:
                walk(schema["items"], item)

    walk(version_schema(), obj)
    return out


def admit(obj: dict[str, Any]) -> list[str]:
    """What an API server would say: defaults first, then schema and CEL problems."""
    defaulted = apply_defaults(version_schema(), obj)
    return schema_errors(defaulted) + cel_errors(defaulted)


def cr(spec: dict[str, Any], name: str = "flux") -> dict[str, Any]:
    return {"apiVersion": "ditserve.io/v1alpha1", "kind": "DiffusionDeployment",
            "metadata": {"name": name, "namespace": "default"}, "spec": spec}


def _test_crs() -> Iterator[tuple[str, dict[str, Any]]]:
    from k8s.test_operator_e2e import SPEC
    from k8s.test_render import VARIANTS

    for path in sorted(EXAMPLE_PATH.parent.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] == "DiffusionDeployment":
                yield f"{path.stem}/{doc['metadata']['name']}", doc
    yield "e2e", cr(SPEC)
    for name, spec in VARIANTS.items():
        yield name, cr(spec)


def test_crd_is_a_valid_kubernetes_object() -> None:
    kubernetes_validate.validate(load_crd(), "1.33.0", strict=True)


def test_chart_ships_the_same_crd() -> None:
    assert yaml.safe_load(CHART_CRD_PATH.read_text()) == load_crd()


def _nodes(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from _nodes(sub, f"{path}.{key}")
    if "items" in schema:
        yield from _nodes(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _nodes(schema["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural() -> None:
    """Every node has a type (or is int-or-string); anyOf only in the int-or-string form."""
    for path, node in _nodes(version_schema()):
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
            assert "type" not in node, path
        else:
            assert "type" in node, path
            assert "anyOf" not in node, path


def test_crd_shape_subresources_and_columns() -> None:
    crd = load_crd()
    assert crd["spec"]["group"] == "ditserve.io" and crd["spec"]["scope"] == "Namespaced"
    assert crd["spec"]["names"]["shortNames"] == ["dd"]
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["storage"] and version["served"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                                "statusReplicasPath": ".status.replicas",
                                                "labelSelectorPath": ".status.selector"}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert "nodeCache" in version_schema()["properties"]["status"]["properties"]
    assert columns == ["Ready", "Reason", "Replicas", "Ready Replicas", "GPUs", "Model", "Age"]
    status = version_schema()["properties"]["status"]["properties"]
    assert {"observedGeneration", "conditions", "replicas", "readyReplicas", "updatedReplicas",
            "selector", "topology", "endpoint", "lastFailure"} <= set(status)


@pytest.mark.parametrize(("name", "obj"), list(_test_crs()), ids=[n for n, _ in _test_crs()])
def test_every_cr_in_the_repo_is_admitted_and_valid_for_the_engine(name: str,
                                                                   obj: dict[str, Any]) -> None:
    assert admit(obj) == []
    validate(apply_defaults(version_schema(), obj)["spec"])


def test_crd_defaults_equal_the_operators_defaults() -> None:
    minimal = cr({"model": {"hostPath": "/m"}})
    defaulted = apply_defaults(version_schema(), minimal)["spec"]
    assert parse_spec(defaulted) == parse_spec(minimal["spec"])
    assert defaulted["rollout"] == {"maxUnavailable": 1, "maxSurge": 0}
    assert defaulted["cache"]["mode"] == "NodeLocal"
    # Every default the CRD declares is read by the operator (no orphan default).
    assert parse_spec(defaulted) == DeploymentSpec(model=parse_spec(defaulted).model)


GOOD = {"model": {"hostPath": "/mnt/models/flux", "sizeGiB": 24}}
INVALID = {
    "negative replicas": ({"replicas": -1}, "spec.replicas: -1 is less than the minimum of 0"),
    "two model sources": ({"model": {"hostPath": "/m", "persistentVolumeClaim": {
        "claimName": "c"}}}, "set exactly one of model.hostPath, model.persistentVolumeClaim or "
                             "model.uri"),
    "no model source": ({"model": {"dtype": "float16"}},
                        "set exactly one of model.hostPath, model.persistentVolumeClaim or model.uri"),
    "uri and hostPath": ({"model": {"hostPath": "/m", "uri": "hf://org/flux"}},
                         "set exactly one of model.hostPath, model.persistentVolumeClaim or model.uri"),
    "uri without cache": ({"model": {"uri": "hf://org/flux"}, "cache": {"mode": "None"}},
                          "model.uri needs cache.mode NodeLocal"),
    "bad uri scheme": ({"model": {"uri": "http://example/flux"}}, "does not match"),
    "credentials without uri": ({"model": {"hostPath": "/m", "credentialsSecret": {"name": "s"}}},
                                "model.credentialsSecret only applies with model.uri"),
    "relative hostPath": ({"model": {"hostPath": "models/flux"}}, "does not match '^/'"),
    "subPath escapes": ({"model": {"persistentVolumeClaim": {"claimName": "c",
                                                             "subPath": "a/../../etc"}}},
                        "must not contain '..'"),
    "unknown dtype": ({"model": {"hostPath": "/m", "dtype": "int8"}}, "'int8' is not one of"),
    "unknown family": ({"model": {"hostPath": "/m", "family": "Unet"}}, "'Unet' is not one of"),
    "too many GPUs": ({"parallelism": {"data": 128, "sequence": 4}}, "must be at most 256"),
    "ragged multi-node": ({"parallelism": {"data": 12, "gpusPerNode": 8}},
                          "needs data x sequence to be a multiple of parallelism.gpusPerNode"),
    "SP group across nodes": ({"parallelism": {"data": 2, "sequence": 12, "gpusPerNode": 8}},
                              "needs parallelism.sequence to divide parallelism.gpusPerNode"),
    "managed flag in args": ({"engine": {"args": ["--log-level", "debug", "--port=9000"]}},
                             "engine.args must not set flags the operator sets"),
    "reserved pod label": ({"engine": {"podLabels": {"app.kubernetes.io/instance": "x"}}},
                           "engine.podLabels must not set the operator's labels"),
    "reserved annotation": ({"engine": {"podAnnotations": {"ditserve.io/config-hash": "x"}}},
                            "engine.podAnnotations must not set ditserve.io/*"),
    "zero dp": ({"parallelism": {"data": 0}}, "0 is less than the minimum of 1"),
    "offload without size": ({"model": {"hostPath": "/m"}, "offload": {"enabled": True}},
                             "offload.enabled needs model.sizeGiB"),
    "runtime cache without cache": ({"offload": {"enabled": True, "runtimeCache": {
        "enabled": True}}, "cache": {"mode": "None"}}, "needs cache.mode NodeLocal"),
    "cache pvc without cache": ({"cache": {"mode": "None", "persistentVolumeClaim": {
        "claimName": "x"}}}, "only applies with cache.mode NodeLocal"),
    "bad cache mode": ({"cache": {"mode": "Shared"}}, "'Shared' is not one of"),
    "bad memory": ({"engine": {"resources": {"memory": "lots"}}}, "does not match"),
    "low port": ({"engine": {"port": 80}}, "80 is less than the minimum of 1024"),
    "frozen rollout": ({"rollout": {"maxSurge": 0, "maxUnavailable": "0%"}},
                       "cannot both be 0"),
    "bad toleration": ({"scheduling": {"tolerations": [{"operator": "Maybe"}]}},
                       "'Maybe' is not one of"),
    "short startup": ({"probes": {"startupTimeoutSeconds": 5}}, "less than the minimum of 30"),
    "operator env": ({"engine": {"env": [{"name": "X", "value": "1"},
                                         {"name": "WORLD_SIZE", "value": "8"}]}},
                     "engine.env must not set variables the operator sets"),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_crs_are_rejected_for_the_right_reason(case: str) -> None:
    change, reason = INVALID[case]
    spec = copy.deepcopy(GOOD)
    for key, value in change.items():
        spec[key] = value
    problems = admit(cr(spec))
    assert len(problems) == 1 and reason in problems[0], problems


MULTI_NODE = {**GOOD, "parallelism": {"data": 16}}
BAD_NAMES = {
    "too long": ("x" * 53, GOOD, "at most 52 characters"),
    "a dot (valid for the CR, not for the Service)": ("flux.dev", GOOD, "DNS-1035 label"),
    "a leading digit": ("1flux", GOOD, "DNS-1035 label"),
    "too long for a LeaderWorkerSet": ("x" * 45, MULTI_NODE, "at most 44 characters"),
}


@pytest.mark.parametrize("case", sorted(BAD_NAMES))
def test_names_every_child_cannot_take_are_rejected(case: str) -> None:
    from ditserve.operator.errors import InvalidSpecError

    name, spec, reason = BAD_NAMES[case]
    problems = admit(cr(spec, name=name))
    assert len(problems) == 1 and reason in problems[0], problems
    # The operator says the same (for a server that skipped the CRD's rules).
    with pytest.raises(InvalidSpecError, match=reason):
        validate(apply_defaults(version_schema(), cr(spec))["spec"], name=name)
    assert admit(cr(spec, name="x" * 44)) == []


def test_cel_rules_agree_with_the_operators_own_checks() -> None:
    """Where the CRD's CEL and the operator both judge a spec, they agree."""
    from ditserve.operator.errors import InvalidSpecError

    for case in ("two model sources", "no model source", "subPath escapes", "offload without size",
                 "runtime cache without cache", "cache pvc without cache", "frozen rollout",
                 "operator env", "ragged multi-node", "SP group across nodes",
                 "managed flag in args", "uri and hostPath", "uri without cache",
                 "credentials without uri",
                 "reserved pod label", "reserved annotation"):
        change, _ = INVALID[case]
        spec = {**copy.deepcopy(GOOD), **change}
        with pytest.raises(InvalidSpecError):
            validate(apply_defaults(version_schema(), cr(spec))["spec"], name="flux")


def test_example_files_hold_only_valid_objects() -> None:
    """Everything else in examples/ validates against the Kubernetes schemas; the restricted
    example's engine pod meets the restricted Pod Security level."""
    from k8s.test_render import _violates_restricted

    from ditserve.operator.render import Owner, render

    for path in sorted(EXAMPLE_PATH.parent.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] != "DiffusionDeployment":
                kubernetes_validate.validate(doc, "1.33.0", strict=True)
    restricted = [d for d in yaml.safe_load_all(
        (EXAMPLE_PATH.parent / "restricted-namespace.yaml").read_text())
        if d["kind"] == "DiffusionDeployment"][0]
    owner = Owner.from_body({**restricted, "metadata": {**restricted["metadata"], "uid": "u"}})
    kids = {m["kind"]: m for m in render(parse_spec(restricted["spec"]), owner)}
    assert _violates_restricted(kids["Deployment"]["spec"]["template"]["spec"]) == []
