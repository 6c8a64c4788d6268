"""Kubernetes Events on a DiffusionDeployment: what `kubectl describe` tells a user.

Owns which Events the operator posts, decided from what it did and saw, never from log lines:

  Warning  InvalidSpec, ChildConflict, ChildApplyFailed   a generation that cannot roll out
  Warning  DriftRepaired                                   a child edited or deleted by hand
  Warning  <pod failure reason> (ImagePullFailed, OOMKilled, EngineStartFailed, ...)
                                                           Degraded turned True, or its reason
  Normal   ChildrenApplied                                 a generation's children written
  Normal   Ready                                           every replica became ready

The decisions (``sync_events``, ``status_events``) are pure; ``post`` hands them to kopf's
event poster (``kopf.event``: a v1 Event whose involvedObject is the DiffusionDeployment).
Called by ``deployments``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import kopf

MAX_MESSAGE = 1000  # the API server refuses longer Event messages (1 KiB)
SYNC_REASONS = ("InvalidSpec", "ChildConflict", "ChildApplyFailed")


@dataclass(frozen=True)
class Event:
    type: str  # "Normal" | "Warning"
    reason: str
    message: str


def _condition(status: Mapping[str, Any] | None, ctype: str) -> Mapping[str, Any]:
    for cond in (status or {}).get("conditions") or []:
        if cond.get("type") == ctype:
            return dict(cond)
    return {}


def _listed(items: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def sync_events(*, generation: int, written: Sequence[str], repaired: Sequence[str],
                failure: tuple[str, str] | None) -> list[Event]:
    """Events for one sync of the children (failure: (reason, message))."""
    out = []
    if repaired:
        out.append(Event("Warning", "DriftRepaired",
                         f"re-applied children changed outside the operator: {_listed(repaired)}"))
    elif written:
        out.append(Event("Normal", "ChildrenApplied",
                         f"generation {generation}: {_listed(written)}"))
    if failure is not None:
        out.append(Event("Warning", failure[0], failure[1]))
    return out


def status_events(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> list[Event]:
    """Events for a status change: a new failure, or all replicas ready (not repeated while
    the same condition holds)."""
    out = []
    was, now = _condition(old, "Degraded"), _condition(new, "Degraded")
    changed = was.get("status") != "True" or was.get("reason") != now.get("reason")
    # InvalidSpec and apply failures are posted when the sync finds them.
    if now.get("status") == "True" and changed and now.get("reason") not in SYNC_REASONS:
        out.append(Event("Warning", str(now.get("reason")), str(now.get("message") or "")))
    ready_was, ready_now = _condition(old, "Ready"), _condition(new, "Ready")
    if ready_now.get("status") == "True" and ready_was.get("status") != "True":
        out.append(Event("Normal", "Ready", str(ready_now.get("message") or "")))
    return out


def post(body: Mapping[str, Any], events: Sequence[Event]) -> None:
    """Queue the events on ``body`` (kopf posts them in the background, with retries)."""
    for event in events:
        kopf.event(kopf.Body(cast("kopf.RawBody", dict(body))), type=event.type,
                   reason=event.reason,
                   message=event.message[:MAX_MESSAGE])
