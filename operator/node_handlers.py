"""kopf handlers for the per-node cache status (NodeCache objects written by cachectl daemons).

Owns two reactions to a node's NodeCache changing (its entries, not just its heartbeat):
- the node's ``cache.ditserve.io/m-*`` labels are made to match its Ready entries (merge patch
  of those keys only), so engine pods' static preferred affinity finds them
  (``nodecache.node_label_patch``); off with DITSERVE_LABEL_CACHED_NODES=false;
- the DiffusionDeployments serving a model listed there, before or after the change, get their
  status (``status.nodeCache``) recomputed.
It also keeps every NodeCache in the operator's memo for ``deployments._sync_status``.
Registered by importing ``handlers``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import kopf

from ditserve.operator import deployments, nodecache
from ditserve.operator.errors import KubeApiError
from ditserve.operator.kube import resource_path

LABEL_ENV = "DITSERVE_LABEL_CACHED_NODES"  # "false": never write node labels
NODECACHES = ("ditserve.io", "v1alpha1", nodecache.PLURAL)
if TYPE_CHECKING:
    from ditserve.operator.deployments import Log


def labels_enabled() -> bool:
    return os.environ.get(LABEL_ENV, "true").strip().lower() not in ("false", "0", "no")


@kopf.on.startup()
def remember_nodecaches(memo: Any, **_: Any) -> None:
    memo["nodecaches"] = {}  # node name -> its NodeCache (metadata.name and status)
    memo["nodecache_entries"] = {}  # node name -> what its entries said last


@kopf.index(*deployments.DD)
def dd_cache_models(spec: kopf.Spec, name: str, namespace: str | None,
                    **_: Any) -> dict[tuple[str, str], tuple[str, str]] | None:
    """(model hostPath, dtype) -> (namespace, name) of the deployments that serve it."""
    model = spec.get("model") or {}
    host_path = model.get("hostPath")
    if not isinstance(host_path, str) or (spec.get("cache") or {}).get("mode") == "None":
        return None
    return {(nodecache.node_path(host_path), str(model.get("dtype") or "bfloat16")):
            (namespace or "default", name)}


def _signature(body: Mapping[str, Any] | None) -> frozenset[tuple[Any, ...]]:
    if body is None:
        return frozenset()
    return frozenset((e.model, e.dtype, e.state, e.message) for e in nodecache.entries_of(body))


async def _relabel(memo: Any, node_name: str, body: Mapping[str, Any] | None,
                   logger: Log) -> None:
    client = deployments.kube_client(memo)
    path = resource_path("v1", "nodes", None, node_name)
    try:
        node = await client.get(path)
        if node is None:
            return  # the node is gone; its NodeCache follows it (owner reference)
        patch = nodecache.node_label_patch(node, body)
        if patch is not None:
            await client.patch(path, patch)
    except KubeApiError as e:
        logger.warning(f"could not update the cache labels of node {node_name}: {e}")


@kopf.on.event(*NODECACHES)
async def nodecache_changed(body: kopf.Body, name: str, type: str, memo: Any, logger: Log,
                            **kwargs: Any) -> None:
    dd_cache_models: kopf.Index = kwargs["dd_cache_models"]  # the index below, by its name
    deleted = type == "DELETED"
    snapshot = None if deleted else {"metadata": {"name": name},
                                     "status": dict(body.get("status") or {})}
    before = memo["nodecaches"].get(name)
    if snapshot is None:
        memo["nodecaches"].pop(name, None)
    else:
        memo["nodecaches"][name] = snapshot
    if memo["nodecache_entries"].get(name) == _signature(snapshot) and not deleted:
        return  # a heartbeat: nothing a deployment or a label depends on changed
    memo["nodecache_entries"][name] = _signature(snapshot)
    if labels_enabled():
        await _relabel(memo, name, snapshot, logger)
    models = {(e.model, e.dtype) for b in (before, snapshot) if b is not None
              for e in nodecache.entries_of(b) if e.model}
    owners = {owner for key in models if key in dd_cache_models for owner in dd_cache_models[key]}
    for namespace, dd_name in sorted(owners):
        try:
            await deployments.refresh(memo, namespace, dd_name, resync=False, logger=logger)
        except KubeApiError as e:
            logger.warning(f"could not refresh the status of {namespace}/{dd_name}: {e}")
