"""RBAC as the API server's authorizer applies it, for matching recorded calls to a chart.

``Authorizer`` takes the chart's rendered ClusterRoles and (Cluster)RoleBindings and answers,
for one request the emulator recorded, whether a service account may make it: a
ClusterRoleBinding grants its role's rules everywhere (cluster-scoped resources included), a
RoleBinding only for namespaced resources in its namespace. Verbs follow the server's request
attribute mapping (GET of a collection is list, or watch with ?watch=true, ...). Discovery
paths are granted to every authenticated user by the default system:discovery role.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from k8s.k8s_emulator import Call

_DISCOVERY = re.compile(r"^/(version|api|apis)(/[^/]+(/[^/]+)?)?/?$")


@dataclass(frozen=True)
class Grant:
    namespace: str | None  # None: cluster-wide (a ClusterRoleBinding)
    rules: tuple[Mapping[str, Any], ...]


def verb_of(call: Call) -> str:
    params = dict(call.params)
    if call.method == "GET":
        if call.name:
            return "get"
        return "watch" if params.get("watch") in ("true", "1") else "list"
    return {"POST": "create", "PATCH": "patch", "PUT": "update",
            "DELETE": "delete" if call.name else "deletecollection"}[call.method]


class Authorizer:
    def __init__(self, docs: Iterable[Mapping[str, Any]], *, service_account: str,
                 namespace: str) -> None:
        docs = list(docs)
        roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterRole"}
        self.grants: list[Grant] = []
        for binding in docs:
            if binding["kind"] not in ("ClusterRoleBinding", "RoleBinding"):
                continue
            if not any(s.get("kind") == "ServiceAccount" and s.get("name") == service_account
                       and s.get("namespace") == namespace for s in binding["subjects"]):
                continue
            role = roles[binding["roleRef"]["name"]]
            where = None if binding["kind"] == "ClusterRoleBinding" else \
                binding["metadata"]["namespace"]
            self.grants.append(Grant(where, tuple(role.get("rules") or ())))

    def allows(self, call: Call, *, cluster_scoped: bool) -> bool:
        if call.plural is None:
            return bool(_DISCOVERY.match(call.path))
        resource = call.plural + (f"/{call.subresource}" if call.subresource else "")
        verb = verb_of(call)
        for grant in self.grants:
            if grant.namespace is not None and (cluster_scoped or call.namespace != grant.namespace):
                continue
            for rule in grant.rules:
                if (call.group in rule.get("apiGroups", ()) and resource in rule.get("resources", ())
                        and verb in rule.get("verbs", ())):
                    return True
        return False

    def refused(self, calls: Iterable[Call], *, cluster_scoped: set[str]) -> list[str]:
        """The calls this identity may not make, described (cluster_scoped: plural names)."""
        return [f"{verb_of(c) if c.plural else c.method} {c.path} {dict(c.params)}"
                for c in calls if not self.allows(c, cluster_scoped=c.plural in cluster_scoped)]
