"""Pieces of API-server behaviour the emulator borrows: selectors, merges and admission.

``label_selected`` / ``field_selected`` filter lists and watches the way the server does for
the selectors the operator sends; ``admission_problems`` refuses what a real server refuses
for the kinds the operator writes (names that are not valid for the kind, objects that break
the kind's schema), so an apply failure in a test carries a server-like message.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from k8s import k8s_schemas

_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# Kinds the operator writes, which the emulator admits like a server: by name and schema.
CHECKED_KINDS = {"ConfigMap", "Service", "Deployment", "PodDisruptionBudget", "LeaderWorkerSet"}


def label_selected(labels: Mapping[str, str], selector: str) -> bool:
    """Equality-based label selectors (``a=b,c==d,e!=f``), all the operator uses."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        else:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
    return True


def _field(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = obj.get(part) if isinstance(obj, Mapping) else None
    return obj


def field_selected(obj: Mapping[str, Any], selector: str) -> bool:
    """Field selectors (``involvedObject.kind=Pod,reason=FailedMount``, ``!=``)."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        negate = "!=" in term
        path, value = term.split("!=" if negate else "=", 1)
        matched = str(_field(obj, path.replace("==", "")) or "") == value.lstrip("=")
        if matched == negate:
            return False
    return True


def selected(obj: Mapping[str, Any], params: Mapping[str, str]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return (label_selected(labels, params.get("labelSelector") or "")
            and field_selected(obj, params.get("fieldSelector") or ""))


def deep_merge(base: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def admission_problems(obj: Mapping[str, Any]) -> list[str]:
    """What the server would say about this object's name and schema (kinds in CHECKED_KINDS)."""
    kind, name = obj.get("kind"), str((obj.get("metadata") or {}).get("name") or "")
    if kind not in CHECKED_KINDS:
        return []
    out = []
    if kind == "Service" and not (_DNS_1035.match(name) and len(name) <= 63):
        out.append(f"metadata.name: Invalid value: {name!r}: a DNS-1035 label must consist of "
                   "lower case alphanumeric characters or '-', start with an alphabetic character, "
                   "and end with an alphanumeric character")
    elif not (_DNS_1123_SUBDOMAIN.match(name) and len(name) <= 253):
        out.append(f"metadata.name: Invalid value: {name!r}: a lowercase RFC 1123 subdomain")
    server_set = {"status", "metadata"}
    body = {k: v for k, v in obj.items() if k not in server_set}
    body["metadata"] = {k: v for k, v in (obj.get("metadata") or {}).items()
                        if k not in ("managedFields",)}
    out.extend(k8s_schemas.problems(body))
    return out
