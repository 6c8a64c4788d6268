"""Per-node cache status: reading NodeCache objects, node labels, and a deployment's summary.

Each cachectl daemon reports its node's cache entries in a cluster-scoped ``NodeCache`` object
named after the node (written by ``ditserve.cachectl.node_status``; schema in
crds/ditserve.io_nodecaches.yaml). The operator reads them for two things:

- ``node_label_patch``: one label per model with a Ready entry on the node
  (``cache.ditserve.io/m-<digest of path and dtype>: Ready``), which engine pods prefer through
  a static preferred node-affinity term (``preferred_cached_node_term``). A static term keeps
  the pod template unchanged when entries come and go, so a cache change never rolls pods.
- ``summarize``: which nodes have the deployment's entry Ready, Building or Failed, for the
  DiffusionDeployment's ``status.nodeCache``.

Entries are matched to a deployment by the model's node path and dtype, the inputs the daemon
was asked to build from (only hostPath models go through the daemon). The path is compared as
``node_path`` writes it, the form cachectl records. Pure; called by ``pod`` (the affinity
term), ``status`` (the summary), ``handlers`` (the node labels) and ``model_spec`` (the path).
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

PLURAL = "nodecaches"
LABEL_PREFIX = "cache.ditserve.io/"
READY, BUILDING, FAILED, UNKNOWN = "Ready", "Building", "Failed", "Unknown"
STATES = (READY, BUILDING, FAILED)
# A daemon that has not written for this long may be gone: its node's states become Unknown.
STALE_AFTER_S = 15 * 60
MAX_LISTED_NODES = 32
PREFERENCE_WEIGHT = 50


@dataclass(frozen=True)
class NodeEntry:
    """One cache entry on one node, as its daemon reported it."""

    node: str
    model: str | None
    dtype: str
    state: str
    message: str = ""


def node_path(path: str) -> str:
    """An absolute node path in the form cachectl records it: no repeated or trailing slash,
    no "." segment (``/mnt/models//flux/`` -> ``/mnt/models/flux``); others are returned as is.

    cachectl records ``Path.resolve()`` of the path, run in the init container that mounts the
    model at this very path, so it resolves no symlink of the node's (the mount point is a
    plain directory there). Lexical only, and ".." is kept: the operator cannot see the
    node's symlinks, through which ".." may lead elsewhere (the admin policy refuses it)."""
    if not path.startswith("/"):
        return path
    return "/" + "/".join(part for part in path.split("/") if part not in ("", "."))


def cache_label_key(model: str, dtype: str) -> str:
    """The node label that says a Ready entry of (model path, dtype) is on the node."""
    digest = hashlib.sha256(f"{model}\0{dtype}".encode()).hexdigest()[:24]
    return f"{LABEL_PREFIX}m-{digest}"


def entries_of(body: Mapping[str, Any]) -> list[NodeEntry]:
    """The well-formed entries of one NodeCache object (malformed ones are skipped)."""
    node = str((body.get("metadata") or {}).get("name") or "")
    out = []
    for item in (body.get("status") or {}).get("entries") or []:
        if not isinstance(item, Mapping) or item.get("state") not in STATES:
            continue
        model = item.get("model")
        out.append(NodeEntry(node=node, model=model if isinstance(model, str) else None,
                             dtype=str(item.get("dtype") or ""), state=str(item["state"]),
                             message=str(item.get("message") or "")))
    return out


def _parse_time(text: Any) -> datetime.datetime | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(
            tzinfo=datetime.timezone.utc)
    except ValueError:
        return None


def is_stale(body: Mapping[str, Any], now: str) -> bool:
    """Whether the node's daemon has not reported for STALE_AFTER_S (or never said when)."""
    beat, at = _parse_time((body.get("status") or {}).get("heartbeatTime")), _parse_time(now)
    if beat is None or at is None:
        return True
    return (at - beat).total_seconds() > STALE_AFTER_S


def ready_model_keys(body: Mapping[str, Any]) -> set[str]:
    """Label keys of the models with a Ready entry on this node."""
    return {cache_label_key(e.model, e.dtype) for e in entries_of(body)
            if e.state == READY and e.model}


def node_label_patch(node: Mapping[str, Any], nodecache: Mapping[str, Any] | None) -> dict | None:
    """A merge patch that makes the node's cache labels match its NodeCache (None: nothing to
    do). Only keys under LABEL_PREFIX are touched; a deleted NodeCache removes them all."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    have = {k for k, v in labels.items() if k.startswith(LABEL_PREFIX) and v == READY}
    stray = {k for k in labels if k.startswith(LABEL_PREFIX)} - have
    want = ready_model_keys(nodecache) if nodecache is not None else set()
    changes: dict[str, str | None] = {k: READY for k in want - have}
    changes.update({k: None for k in (have - want) | stray})
    return {"metadata": {"labels": changes}} if changes else None


def preferred_cached_node_term(model: str, dtype: str) -> dict[str, Any]:
    """A preferred node-affinity term for nodes with a Ready entry of this model."""
    return {"weight": PREFERENCE_WEIGHT, "preference": {"matchExpressions": [
        {"key": cache_label_key(model, dtype), "operator": "In", "values": [READY]}]}}


def summarize(nodecaches: Iterable[Mapping[str, Any]], *, model: str, dtype: str,
              now: str) -> dict[str, Any]:
    """``status.nodeCache`` of a deployment serving (model path, dtype).

    Per node the best state wins (Ready over Building over Failed: a node that has a Ready
    entry serves it even if a rebuild failed); a stale node reports Unknown.
    """
    rank = {READY: 0, BUILDING: 1, FAILED: 2}
    nodes: dict[str, NodeEntry] = {}
    unknown: list[str] = []
    for body in nodecaches:
        mine = [e for e in entries_of(body) if e.model == model and e.dtype == dtype]
        if not mine:
            continue
        if is_stale(body, now):
            unknown.append(mine[0].node)
            continue
        best = min(mine, key=lambda e: rank[e.state])
        nodes[best.node] = best
    counts = {state: sum(1 for e in nodes.values() if e.state == state) for state in STATES}
    listed = sorted(nodes.values(), key=lambda e: (rank[e.state], e.node))
    rows: list[dict[str, Any]] = [
        {"name": e.node, "state": e.state, **({"message": e.message[:1024]} if e.message else {})}
        for e in listed] + [{"name": n, "state": UNKNOWN,
                             "message": "its cachectl daemon has not reported recently"}
                            for n in sorted(unknown)]
    return {"readyNodes": counts[READY], "buildingNodes": counts[BUILDING],
            "failedNodes": counts[FAILED], "unknownNodes": len(unknown),
            "nodes": rows[:MAX_LISTED_NODES]}
