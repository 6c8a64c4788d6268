"""Offline schema oracles for every kind the chart and the operator render.

Built-in kinds go to kubernetes-validate (strict: unknown fields are errors). Custom resources
the project does not define are checked against their projects' CRD schemas, vendored in
``schemas/`` with their source and license (LeaderWorkerSet, ServiceMonitor); a
LeaderWorkerSet's pod templates are checked as core/v1 PodTemplateSpecs by kubernetes-validate.
CRD schemas are made strict the same way: an object without ``x-kubernetes-preserve-unknown-
fields`` may hold only the properties it declares (a real server would silently prune others,
which would hide a typo in what the operator renders). Kinds whose CRDs the project ships in
``crds/`` (kopf's peering objects) are checked against those.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

K8S_VERSION = "1.33.0"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
PROJECT_CRDS = Path(__file__).resolve().parents[2] / "crds"
POD_TEMPLATE_MARKER = "x-ditserve-pod-template-spec"
VENDORED = {
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset.x-k8s.io_v1.yaml",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_v1_servicemonitor.yaml",
}


def _strict(schema: Any) -> Any:
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def project_crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> openAPIV3Schema of every CRD in the project's crds/."""
    out = {}
    for path in sorted(PROJECT_CRDS.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for version in spec["versions"]:
                key = (f"{spec['group']}/{version['name']}", spec["names"]["kind"])
                out[key] = version["schema"]["openAPIV3Schema"]
    return out


@functools.cache
def vendored_schema(api_version: str, kind: str) -> dict[str, Any]:
    if (api_version, kind) in project_crd_schemas():
        schema = copy.deepcopy(project_crd_schemas()[(api_version, kind)])
        schema.setdefault("properties", {}).update(
            {"apiVersion": {"type": "string"}, "kind": {"type": "string"}})
        schema["properties"]["metadata"] = {"type": "object"}
        return _strict(schema)
    doc = yaml.safe_load((SCHEMAS / VENDORED[(api_version, kind)]).read_text())
    schema = copy.deepcopy(doc["openAPIV3Schema"])
    # metadata is an ObjectMeta the server checks on its own; the CRD leaves it open.
    schema["properties"]["metadata"] = {"type": "object"}
    return _strict(schema)


def _pod_templates(schema: Any, value: Any, path: str) -> list[tuple[str, Any]]:
    """The values the schema marks as PodTemplateSpecs, with their paths."""
    if isinstance(schema, dict) and schema.get(POD_TEMPLATE_MARKER):
        return [(path, value)]
    out = []
    if isinstance(schema, dict) and isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                out.extend(_pod_templates(sub, value[key], f"{path}.{key}"))
    return out


def problems(obj: dict[str, Any], version: str = K8S_VERSION) -> list[str]:
    """Why an API server of ``version`` would refuse ``obj`` for its schema (empty if not)."""
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key not in VENDORED and key not in project_crd_schemas():
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            return [f"{'.'.join(str(p) for p in e.path) or '<root>'}: {e.message}"]
        return []
    schema = vendored_schema(*key)
    out = [f"{'.'.join(str(p) for p in err.absolute_path) or '<root>'}: {err.message}"
           for err in jsonschema.Draft7Validator(schema).iter_errors(obj)]
    for path, template in _pod_templates(schema, obj, ""):
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate",
                   "metadata": {"name": "template"}, "template": template}
        try:
            kubernetes_validate.validate(wrapped, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            inner = ".".join(str(p) for p in list(e.path)[1:])
            out.append(f"{path.lstrip('.')}.{inner}: {e.message}")
    return out


def validate(obj: dict[str, Any], version: str = K8S_VERSION) -> None:
    """Raise AssertionError listing the schema problems of ``obj``."""
    found = problems(obj, version)
    assert not found, f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}: {found}"
