"""The DiffusionDeployment CRD as a test oracle: its schema as JSON Schema, and its defaulting.

The API server validates a CR against the CRD's openAPIV3Schema and fills in the schema's
defaults; no API server runs here, so these helpers do both (structurally, like the server:
a default applies where its parent object exists). CEL rules are evaluated in test_crd.py.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import yaml

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "ditserve.io_diffusiondeployments.yaml"
CHART_CRD_PATH = REPO / "charts" / "ditserve" / "crds" / "ditserve.io_diffusiondeployments.yaml"
NODECACHE_CRD_PATH = REPO / "crds" / "ditserve.io_nodecaches.yaml"
EXAMPLE_PATH = REPO / "examples" / "deployment.yaml"


def load_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def version_schema(crd: dict[str, Any] | None = None) -> dict[str, Any]:
    crd = crd or load_crd()
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return version["schema"]["openAPIV3Schema"]


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """A copy of ``value`` with the schema's defaults filled in, recursively."""
    value = copy.deepcopy(value)
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
    elif isinstance(value, list) and "items" in schema:
        value = [apply_defaults(schema["items"], item) for item in value]
    return value


def validator(schema: dict[str, Any] | None = None) -> jsonschema.Draft7Validator:
    # openAPIV3Schema is JSON Schema plus x-kubernetes-* keywords, which jsonschema ignores.
    return jsonschema.Draft7Validator(schema or version_schema())


def schema_errors(obj: dict[str, Any]) -> list[str]:
    """Every schema violation of a CR, as 'path: message'."""
    return [
        f"{'.'.join(str(p) for p in err.absolute_path) or '<root>'}: {err.message}"
        for err in sorted(validator().iter_errors(obj), key=lambda e: list(e.absolute_path))
    ]
