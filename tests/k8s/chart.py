"""The Helm chart rendered by the real helm binary, for the chart tests and the RBAC e2e check."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml
from k8s.conftest import require_tool
from k8s.crd_schema import REPO

CHART = REPO / "charts" / "ditserve"
RELEASE_NAMESPACE = "ditserve-system"


def helm(tmp_path: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {"HELM_CACHE_HOME": str(tmp_path / "c"), "HELM_CONFIG_HOME": str(tmp_path / "cf"),
           "HELM_DATA_HOME": str(tmp_path / "d"), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([require_tool("helm"), *args], capture_output=True, text=True,
                            env=env, timeout=120)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def template(tmp_path: Path, values: dict[str, Any] | None = None,
             release: str = "rel") -> list[dict[str, Any]]:
    """Every object `helm template` renders (CRDs and the test hook included)."""
    args = ["template", release, str(CHART), "--namespace", RELEASE_NAMESPACE, "--include-crds"]
    if values is not None:
        path = tmp_path / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        args += ["-f", str(path)]
    out = helm(tmp_path, *args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in by_kind(docs, kind) if d["metadata"]["name"] == name]
    return doc
