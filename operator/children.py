"""Bringing a DiffusionDeployment's children to the rendered state, without taking anything over.

Owns ``sync_children``: read every child the spec wants, refuse if any same-named object is
not this owner's (``ChildConflict``: nothing is changed, the object is left untouched), then
create the missing children, server-side apply the ones that differ (under the resourceVersion
their ownership was checked at), and delete this owner's children the spec no longer wants (a
PodDisruptionBudget after scaling to one replica, the Deployment after a switch to a
LeaderWorkerSet or back). A child the API server refuses stops the sync and comes back as
``ChildApplyFailed`` with the server's own message. A child that already matches is not
written, so a restarted operator changes nothing. ``SyncResult`` says what was written, and
which of those writes repaired drift: a child this generation had already been applied to that
someone edited (replicas, image, selector, data) or deleted.
Called by ``handlers``; the only module that writes children.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ditserve.operator import autoscaling, render, scale_to_zero, sizing, workloads
from ditserve.operator.errors import KubeApiError
from ditserve.operator.judge import validate
from ditserve.operator.kube import KubeClient, manifest_path, resource_path
from ditserve.operator.policy import AdminPolicy
from ditserve.operator.spec import DeploymentSpec
from ditserve.operator.status import ApplyFailure

# A child that changes between our read and our write (409) is read again; a few rounds.
SYNC_ATTEMPTS = 3


@dataclass
class SyncResult:
    """What one sync did: the failure that stopped it, the children it wrote, and which of
    those writes repaired drift (descriptions like "Deployment ml/flux (spec changed)")."""

    failure: ApplyFailure | None = None
    written: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)


def _describe(manifest: Mapping[str, Any]) -> str:
    meta = manifest["metadata"]
    return f"{manifest['kind']} {meta.get('namespace')}/{meta['name']}"


# Fields the API server stores as a resource.Quantity, in its canonical form rather than as
# written (57344Mi as 56Gi, 0.5 as 500m, 8000m as 8): compared by value, never as strings.
_QUANTITY_MAPS = {("resources", "requests"), ("resources", "limits")}  # every key a quantity
_QUANTITY_FIELDS = {("emptyDir", "sizeLimit"), ("target", "averageValue"), ("target", "value")}


def _is_quantity(path: tuple[str, ...]) -> bool:
    return path[-3:-1] in _QUANTITY_MAPS or path[-2:] in _QUANTITY_FIELDS


def _same_scalar(want: Any, have: Any, path: tuple[str, ...]) -> bool:
    if want == have:
        return True
    if _is_quantity(path):
        value = sizing.quantity_value(want)
        return value is not None and value == sizing.quantity_value(have)
    return False


def matches(want: Any, have: Any, _path: tuple[str, ...] = ()) -> bool:
    """Whether the live object ``have`` already holds everything ``want`` says (the server adds
    defaults, status and metadata of its own; those do not count as a difference, nor does a
    quantity it stored in its canonical form).

    A key someone added next to the operator's (a selector label, a ConfigMap key) is not
    drift the operator repairs: server-side apply cannot remove a field another manager owns,
    so treating it as drift would re-apply forever. ``_path`` holds the keys leading here
    (list items keep their list's key)."""
    if isinstance(want, Mapping):
        return isinstance(have, Mapping) and all(
            key in have and matches(value, have[key], (*_path[-2:], key))
            for key, value in want.items())
    if isinstance(want, list):
        return (isinstance(have, list) and len(want) == len(have)
                and all(matches(w, h, _path) for w, h in zip(want, have, strict=True)))
    return _same_scalar(want, have, _path)


def _applied_generation(obj: Mapping[str, Any] | None) -> str | None:
    return ((obj or {}).get("metadata") or {}).get("annotations", {}).get(
        render.GENERATION_ANNOTATION)


def _conflict(manifest: Mapping[str, Any], live: Mapping[str, Any]) -> str:
    refs = (live.get("metadata") or {}).get("ownerReferences") or []
    controller = next((r for r in refs if r.get("controller")), None)
    by = (f"it is controlled by {controller.get('kind')} {controller.get('name')}"
          if controller else "it has no controller")
    return (f"{_describe(manifest)} already exists and is not owned by this "
            f"DiffusionDeployment ({by}); it was left untouched: delete or rename it, or give "
            "the DiffusionDeployment another name")


def _stale_candidates(owner: render.Owner, spec: DeploymentSpec) -> list[str]:
    """Paths of children an earlier spec may have made that this one does not render."""
    ns, out = owner.namespace, []
    if not spec.wants_disruption_budget:
        out.append(resource_path("policy/v1", "poddisruptionbudgets", ns, owner.name))
    if not spec.autoscaling.uses_hpa:
        out.append(resource_path("autoscaling/v2", "horizontalpodautoscalers", ns, owner.name))
    if not spec.autoscaling.uses_keda:  # None when KEDA is not installed: nothing to delete
        out.append(resource_path(scale_to_zero.KEDA_API_VERSION, "scaledobjects", ns,
                                 owner.name))
    if spec.parallelism.multi_node:
        out.append(resource_path("apps/v1", "deployments", ns, owner.name))
    else:
        out.append(resource_path(workloads.LWS_API_VERSION, "leaderworkersets", ns,
                                 owner.name + workloads.LWS_SUFFIX))
    return out


async def _delete_stale(client: KubeClient, owner: render.Owner, spec: DeploymentSpec) -> None:
    for path in _stale_candidates(owner, spec):
        live = await client.get(path)  # None also when the API (LWS) is not installed
        if live is not None and render.owned_by(live, owner):
            await client.delete(path, uid=live["metadata"]["uid"])


async def _read(client: KubeClient, manifests: list[dict[str, Any]],
                owner: render.Owner) -> list[dict[str, Any] | None] | ApplyFailure:
    live: list[dict[str, Any] | None] = []
    for manifest in manifests:
        try:
            live.append(await client.get(manifest_path(manifest)))
        except KubeApiError as e:
            return ApplyFailure("ChildApplyFailed", f"reading {_describe(manifest)} failed: "
                                f"{e.status} {e.reason}: {e.message}", owner.generation)
    return live


async def _write(client: KubeClient, manifest: dict[str, Any], obj: dict[str, Any] | None,
                 result: SyncResult, *, applied_before: bool, generation: str) -> None:
    """Create or apply one child if it differs; note what was written and what was drift."""
    what = _describe(manifest)
    if obj is None:
        await client.create(manifest)
        result.written.append(f"{what} (created)")
        if applied_before:  # this generation was rolled out and the child is gone
            result.repaired.append(f"{what} (deleted)")
    elif not matches(manifest, obj):
        applied = await client.apply(manifest, resource_version=obj["metadata"]["resourceVersion"])
        if applied is None:
            raise KubeApiError(409, "Conflict", "deleted while being updated")
        result.written.append(f"{what} (updated)")
        if _applied_generation(obj) == generation:  # ours at this generation, edited since
            result.repaired.append(f"{what} (changed)")


async def _sync_once(client: KubeClient, manifests: list[dict[str, Any]], owner: render.Owner,
                     spec: DeploymentSpec) -> SyncResult:
    live = await _read(client, manifests, owner)
    if isinstance(live, ApplyFailure):
        return SyncResult(failure=live)
    conflicts = [_conflict(m, obj) for m, obj in zip(manifests, live, strict=True)
                 if obj is not None and not render.owned_by(obj, owner)]
    if conflicts:
        return SyncResult(failure=ApplyFailure("ChildConflict", "; ".join(conflicts),
                                               owner.generation))
    # Stale children first: a Deployment must free its GPUs before a LeaderWorkerSet asks.
    await _delete_stale(client, owner, spec)
    generation = str(owner.generation)
    applied_before = any(_applied_generation(obj) == generation for obj in live)
    result = SyncResult()
    for manifest, obj in zip(manifests, live, strict=True):
        try:
            await _write(client, manifest, obj, result, applied_before=applied_before,
                         generation=generation)
        except KubeApiError as e:
            if e.status == 409:
                raise  # changed or created in between: read again
            hint = ""
            if e.status == 404 and manifest["kind"] == workloads.LWS_KIND:
                hint = (" (the LeaderWorkerSet API is not installed: install the LWS controller "
                        "(kubernetes-sigs/lws >= 0.6) or fit a replica on one node)")
            elif e.status == 404 and manifest["kind"] == autoscaling.HPA_KIND:
                hint = " (the autoscaling/v2 API is not served: Kubernetes >= 1.23 is needed)"
            elif e.status == 404 and manifest["kind"] == scale_to_zero.SCALED_OBJECT_KIND:
                hint = (" (the KEDA API is not installed: install KEDA (keda.sh) or turn "
                        "autoscaling.scaleToZero off)")
            result.failure = ApplyFailure("ChildApplyFailed", f"{_describe(manifest)} was "
                                          f"refused: {e.status} {e.reason}: {e.message}{hint}",
                                          owner.generation)
            return result
    return result


async def sync_children(client: KubeClient, body: Mapping[str, Any],
                        policy: AdminPolicy) -> SyncResult:
    """Make the children match the spec (see module doc).

    Raises InvalidSpecError (nothing is touched) when the spec cannot be rendered.
    """
    owner = render.Owner.from_body(body)
    spec, _ = validate(body.get("spec"), name=owner.name, policy=policy)
    manifests = render.adopt(render.render(spec, owner, policy=policy), owner)
    last: KubeApiError | None = None
    for _attempt in range(SYNC_ATTEMPTS):
        try:
            return await _sync_once(client, manifests, owner, spec)
        except KubeApiError as e:
            if e.status != 409:
                return SyncResult(failure=ApplyFailure("ChildApplyFailed", str(e),
                                                       owner.generation))
            last = e
    return SyncResult(failure=ApplyFailure(
        "ChildApplyFailed", f"children kept changing while being applied: {last}",
        owner.generation))
