"""A ``model.hostPath`` written with a trailing slash, ``//`` or a ``.`` segment names the cache
entry cachectl records (it resolves the path): the pod's cached-node affinity, the node label
the operator sets from the NodeCache, ``status.nodeCache`` and the node-event index agree."""

from __future__ import annotations

from typing import Any

import pytest

from ditserve.cachectl.cli import build_parser as cachectl_parser
from ditserve.cachectl.commands import model_paths
from ditserve.operator import node_handlers
from ditserve.operator.nodecache import READY, node_label_patch, node_path
from ditserve.operator.render import Owner, render
from ditserve.operator.spec import parse_spec
from ditserve.operator.status import compute_status

NOW = "2026-01-01T01:00:00Z"
OWNER = Owner(name="flux", namespace="ml", uid="u", generation=1)
SPELLINGS = ["/mnt/models/flux/", "/mnt/models//flux", "//mnt/models/./flux/."]


def _spec(host_path: str) -> dict[str, Any]:
    return {"model": {"hostPath": host_path, "sizeGiB": 2},
            "scheduling": {"requireCachedNodes": True}}


def _pod(host_path: str) -> dict[str, Any]:
    (dep,) = [m for m in render(parse_spec(_spec(host_path)), OWNER) if m["kind"] == "Deployment"]
    return dict(dep["spec"]["template"]["spec"])


def _recorded_model(pod: dict[str, Any]) -> str:
    """The model path the daemon records for the init container's `cachectl ensure`."""
    (init,) = pod["initContainers"]
    model_dir, _ = model_paths(cachectl_parser().parse_args(init["command"][1:]))
    return str(model_dir)


def _node_cache(model: str) -> dict[str, Any]:
    return {"metadata": {"name": "gpu-1"}, "status": {
        "heartbeatTime": "2026-01-01T00:59:00Z",
        "entries": [{"state": READY, "model": model, "dtype": "bfloat16"}]}}


@pytest.mark.parametrize("host_path", SPELLINGS)
def test_every_spelling_keys_the_entry_cachectl_records(host_path: str) -> None:
    pod = _pod(host_path)
    recorded = _recorded_model(pod)
    assert recorded == "/mnt/models/flux"
    # The node gets its label from the daemon's entry; the pod requires that very label.
    patch = node_label_patch({"metadata": {"name": "gpu-1", "labels": {}}}, _node_cache(recorded))
    assert patch is not None
    (label,) = patch["metadata"]["labels"]
    (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert [e["key"] for e in term["matchExpressions"]] == [label]
    # The volume mounts that directory, and status.nodeCache finds the entry.
    (volume,) = [v for v in pod["volumes"] if v["name"] == "model"]
    assert volume["hostPath"]["path"] == recorded
    body = {"metadata": {"name": "flux", "namespace": "ml", "generation": 1, "uid": "u"},
            "spec": _spec(host_path), "status": {}}
    status = compute_status(body, None, [], now=NOW, nodecaches=[_node_cache(recorded)])
    assert status["nodeCache"]["readyNodes"] == 1
    # A NodeCache event finds the deployments serving its entry through this index.
    index = node_handlers.dd_cache_models(spec=_spec(host_path), name="flux", namespace="ml")
    assert index == {(recorded, "bfloat16"): ("ml", "flux")}


def test_node_path_is_lexical_and_keeps_dot_dot() -> None:
    assert node_path("/mnt/models/flux") == "/mnt/models/flux"
    assert node_path("/") == "/"
    assert node_path("relative/x/") == "relative/x/"  # refused later, as written
    # ".." through a node symlink may lead elsewhere: kept, and refused by the admin policy.
    assert node_path("/mnt/models/link/../flux/") == "/mnt/models/link/../flux"
