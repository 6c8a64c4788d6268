"""Which labels and annotations a user may put on engine pods.

Owns the label and annotation key/value syntax the API server enforces and the keys that
belong to the operator (its selectors and bookkeeping) or to the LeaderWorkerSet controller.
Called by ``spec.parse_spec``; pure.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# Pod labels the operator sets (selectors, ownership) or that belong to other controllers.
RESERVED_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance",
                   "app.kubernetes.io/component", "app.kubernetes.io/part-of",
                   "app.kubernetes.io/managed-by")
RESERVED_PREFIXES = ("ditserve.io/", "leaderworkerset.sigs.k8s.io/")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _key_problem(key: str) -> str | None:
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return "its prefix must be a DNS subdomain"
    if not _LABEL_NAME.match(name):
        return "its name must be 1-63 letters, digits, '-', '_' or '.', starting and ending " \
               "with a letter or digit"
    return None


def _reserved(key: str) -> bool:
    return key in RESERVED_LABELS or key.startswith(RESERVED_PREFIXES)


def pod_metadata_problems(labels: Mapping[str, str], annotations: Mapping[str, str]) -> list[str]:
    """What the API server would refuse in engine.podLabels and engine.podAnnotations, said
    before applying, plus the keys the operator and the LeaderWorkerSet controller own."""
    out = []
    for what, mapping in (("podLabels", labels), ("podAnnotations", annotations)):
        for key, value in mapping.items():
            if _reserved(key):
                out.append(f"engine.{what} must not set {key!r}: the operator (or the "
                           "LeaderWorkerSet controller) owns it")
            elif (problem := _key_problem(key)) is not None:
                out.append(f"engine.{what} key {key!r} is not a valid key: {problem}")
            elif what == "podLabels" and value and not _LABEL_NAME.match(value):
                out.append(f"engine.podLabels value {value!r} of {key!r} must be at most 63 "
                           "letters, digits, '-', '_' or '.', starting and ending with a "
                           "letter or digit")
    return out
