"""Where engine pods may run: the user's affinity, the node cache preference (or requirement),
and the spread of one deployment's replicas over distinct nodes.

Owns the pod's ``affinity``. By default replicas prefer distinct nodes (a node failure takes
one replica, not all) and nodes that hold the model's Ready cache entry; both can be made hard
requirements (``scheduling.replicaSpread: Required``, ``scheduling.requireCachedNodes``) or
turned off. A malformed user affinity is passed through untouched: the API server refuses it
with its own message, which the status reports. Called by ``pod``; pure.
"""

from __future__ import annotations

import copy
from typing import Any

from ditserve.operator import nodecache
from ditserve.operator.spec import DeploymentSpec

HOSTNAME = "kubernetes.io/hostname"
SPREAD_WEIGHT = 100


def _section(affinity: dict[str, Any], kind: str, rule: str) -> list[Any] | None:
    section = affinity.setdefault(kind, {})
    if not isinstance(section, dict):
        return None
    terms = section.setdefault(rule, [])
    return terms if isinstance(terms, list) else None


def _cache_terms(affinity: dict[str, Any], spec: DeploymentSpec) -> None:
    if not (spec.cache.enabled and spec.model.host_path):
        return
    model, dtype = spec.model.host_path, spec.model.dtype
    if spec.scheduling.require_cached_nodes:
        node = affinity.setdefault("nodeAffinity", {})
        required = node.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {}) \
            if isinstance(node, dict) else None
        if isinstance(required, dict):
            expression = {"key": nodecache.cache_label_key(model, dtype), "operator": "In",
                          "values": [nodecache.READY]}
            terms = required.setdefault("nodeSelectorTerms", [])
            if not terms:
                terms.append({"matchExpressions": []})
            for term in terms:  # terms are ORed: the requirement must hold in each
                if isinstance(term, dict):
                    term.setdefault("matchExpressions", []).append(dict(expression))
    elif spec.scheduling.prefer_cached_nodes:
        preferred = _section(affinity, "nodeAffinity",
                             "preferredDuringSchedulingIgnoredDuringExecution")
        if preferred is not None:
            preferred.append(nodecache.preferred_cached_node_term(model, dtype))


def _spread_terms(affinity: dict[str, Any], spec: DeploymentSpec,
                  selector: dict[str, str]) -> None:
    term = {"labelSelector": {"matchLabels": dict(selector)}, "topologyKey": HOSTNAME}
    if spec.scheduling.replica_spread == "Required":
        required = _section(affinity, "podAntiAffinity",
                            "requiredDuringSchedulingIgnoredDuringExecution")
        if required is not None:
            required.append(term)
    elif spec.scheduling.replica_spread == "Preferred":  # also at 1: scaling never rolls pods
        preferred = _section(affinity, "podAntiAffinity",
                             "preferredDuringSchedulingIgnoredDuringExecution")
        if preferred is not None:
            preferred.append({"weight": SPREAD_WEIGHT, "podAffinityTerm": term})


def affinity(spec: DeploymentSpec, selector: dict[str, str]) -> dict[str, Any] | None:
    """The pod's affinity (see the module doc); None when there is nothing to say."""
    out = copy.deepcopy(dict(spec.scheduling.affinity or {}))
    _cache_terms(out, spec)
    _spread_terms(out, spec, selector)
    return out or None
