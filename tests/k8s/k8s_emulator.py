"""kmock's KubernetesEmulator, patched to behave enough like an API server for kopf and kubectl.

kmock 0.8 stores objects as plain JSON; a real API server also sets server-side metadata,
bumps ``generation`` on spec changes, names list kinds, serves core discovery under ``v1``,
filters lists and watches by label and field selectors, serves ``/scale``, checks
resourceVersion and uid preconditions, validates + defaults custom resources against their
CRD, and refuses objects whose names or schemas are invalid (``api_semantics``). This subclass
adds exactly those, knows the project's CRDs (DiffusionDeployment, NodeCache) and the
LeaderWorkerSet and KEDA APIs (``Emulator.lws_installed``, ``keda_installed``), records every request in ``calls`` (for
the RBAC test), plus helpers to start kopf against it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import itertools
import json
import re
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import kmock
import yaml
from k8s.api_semantics import admission_problems, deep_merge, selected
from k8s.crd_schema import (
    NODECACHE_CRD_PATH,
    apply_defaults,
    load_crd,
    schema_errors,
    version_schema,
)

_resource_versions = itertools.count(1)

DD = kmock.resource("ditserve.io", "v1alpha1", "diffusiondeployments")
DEPLOYMENTS = kmock.resource("apps", "v1", "deployments")
CONFIGMAPS = kmock.resource("", "v1", "configmaps")
SERVICES = kmock.resource("", "v1", "services")
PODS = kmock.resource("", "v1", "pods")
EVENTS = kmock.resource("", "v1", "events")
NODES = kmock.resource("", "v1", "nodes")
PDBS = kmock.resource("policy", "v1", "poddisruptionbudgets")
NODECACHES = kmock.resource("ditserve.io", "v1alpha1", "nodecaches")
LWS = kmock.resource("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")
HPAS = kmock.resource("autoscaling", "v2", "horizontalpodautoscalers")
SCALED_OBJECTS = kmock.resource("keda.sh", "v1alpha1", "scaledobjects")
PEERINGS = kmock.resource("kopf.dev", "v1", "kopfpeerings")
CLUSTER_PEERINGS = kmock.resource("kopf.dev", "v1", "clusterkopfpeerings")
_ALL_VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclasses.dataclass(frozen=True)
class Call:
    """One request as the API server's authorizer sees it."""

    method: str
    path: str
    action: str | None
    group: str | None
    plural: str | None
    namespace: str | None
    name: str | None
    subresource: str | None
    params: tuple[tuple[str, str], ...]
    user_agent: str

    @property
    def by_operator(self) -> bool:
        """Sent by the operator (kopf's client or its own), not by the test."""
        return self.user_agent.startswith(("kopf/", "ditserve-operator"))


class Emulator(kmock.KubernetesEmulator):
    """An in-memory Kubernetes API that knows the project's CRDs (and, unless a subclass says
    otherwise, the LeaderWorkerSet API)."""

    lws_installed = True
    keda_installed = True

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.resources.load_bundled()
        self.calls: list[Call] = []
        nc = yaml.safe_load(NODECACHE_CRD_PATH.read_text())["spec"]["names"]
        self.resources[NODECACHES] = kmock.ResourceInfo(
            kind=nc["kind"], singular=nc["singular"], namespaced=False,
            shortnames=set(nc["shortNames"]), subresources={"status"}, verbs=_ALL_VERBS)
        if self.lws_installed:
            self.resources[LWS] = kmock.ResourceInfo(
                kind="LeaderWorkerSet", singular="leaderworkerset", namespaced=True,
                shortnames={"lws"}, subresources={"status", "scale"}, verbs=_ALL_VERBS)
        if self.keda_installed:
            self.resources[SCALED_OBJECTS] = kmock.ResourceInfo(
                kind="ScaledObject", singular="scaledobject", namespaced=True,
                shortnames={"so"}, subresources={"status"}, verbs=_ALL_VERBS)
        # kopf's peering CRDs (the chart installs them): leader election of operator replicas.
        self.resources[PEERINGS] = kmock.ResourceInfo(
            kind="KopfPeering", singular="kopfpeering", namespaced=True, verbs=_ALL_VERBS)
        self.resources[CLUSTER_PEERINGS] = kmock.ResourceInfo(
            kind="ClusterKopfPeering", singular="clusterkopfpeering", namespaced=False,
            verbs=_ALL_VERBS)
        crd = load_crd()
        names = crd["spec"]["names"]
        self.resources[DD] = kmock.ResourceInfo(
            kind=names["kind"], singular=names["singular"], namespaced=True,
            shortnames=set(names["shortNames"]), categories=set(names.get("categories", [])),
            subresources={"status", "scale"},
            verbs={"get", "list", "watch", "create", "update", "patch", "delete"})
        self._dd_schema = version_schema(crd)
        (version,) = crd["spec"]["versions"]
        self._dd_columns = version["additionalPrinterColumns"]

    def _current(self, request: kmock.Request) -> Mapping[str, Any] | None:
        key = (request.resource, request.namespace, request.name)
        if key in self.objects and not self.objects[key].deleted:
            return self.objects[key].raw
        return None

    def _check_dd(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        defaulted = apply_defaults(self._dd_schema, obj)
        problems = schema_errors(defaulted)
        if problems:
            raise kmock.KubernetesError(
                status=422, reason="Invalid",
                message=f"DiffusionDeployment is invalid: {'; '.join(problems)}")
        return defaulted

    def _record(self, request: kmock.Request) -> None:
        r = request.resource
        self.calls.append(Call(
            method=str(request.method.value if hasattr(request.method, "value") else request.method),
            path=request.url.path, action=None if request.action is None else str(request.action.value),
            group=None if r is None else r.group, plural=None if r is None else r.plural,
            namespace=request.namespace, name=request.name, subresource=request.subresource,
            params=tuple(sorted(request.params.items())),
            user_agent=request.headers.get("User-Agent", "")))

    def _admit(self, request: kmock.Request, obj: Mapping[str, Any]) -> None:
        problems = admission_problems(obj)
        if problems:
            name = (obj.get("metadata") or {}).get("name")
            raise kmock.KubernetesError(
                status=422, reason="Invalid",
                message=f"{obj.get('kind')} {name!r} is invalid: {'; '.join(problems)}")

    def _check_delete(self, request: kmock.Request) -> None:
        wanted = ((request.data or {}).get("preconditions") or {}).get("uid") \
            if isinstance(request.data, dict) else None
        current = self._current(request)
        if wanted and current is not None and current["metadata"].get("uid") != wanted:
            raise kmock.KubernetesError(
                status=409, reason="Conflict",
                message=f"Precondition failed: UID in precondition: {wanted}, UID in object "
                        f"meta: {current['metadata'].get('uid')}")

    async def _handle(self, request: kmock.Request) -> Any:
        self._record(request)
        if (request.resource == LWS and not self.lws_installed
                or request.resource == SCALED_OBJECTS and not self.keda_installed):
            raise kmock.KubernetesError(status=404, reason="NotFound",
                                        message="the server could not find the requested resource")
        data = request.data
        if request.action == kmock.action.DELETE:
            self._check_delete(request)
        if request.resource is not None and isinstance(data, dict):
            if request.action == kmock.action.CREATE:
                self._admit(request, data)
            if request.action == kmock.action.CREATE and request.resource == DD:
                data.update(self._check_dd(data))  # defaulted, as the server stores it
            meta = data.setdefault("metadata", {})
            if request.action == kmock.action.CREATE:
                if meta.get("generateName") and not meta.get("name"):  # kopf's Events use it
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("generation", 1)
                meta.setdefault("creationTimestamp", _now())
                if request.namespace:
                    meta.setdefault("namespace", request.namespace)
            if request.action == kmock.action.UPDATE:
                self._check_precondition(request, meta)
                self._on_update(request, data)
            if request.action in (kmock.action.CREATE, kmock.action.UPDATE):
                meta["resourceVersion"] = str(next(_resource_versions))
        return await super()._handle(request)

    def _check_precondition(self, request: kmock.Request, meta: Mapping[str, Any]) -> None:
        """A write that names a resourceVersion only applies to that version (409 otherwise)."""
        current = self._current(request)
        wanted = meta.get("resourceVersion")
        if wanted and current is not None and wanted != current["metadata"].get("resourceVersion"):
            raise kmock.KubernetesError(
                status=409, reason="Conflict",
                message=f"the object has been modified (resourceVersion {wanted} is stale)")

    def _on_update(self, request: kmock.Request, data: dict[str, Any]) -> None:
        current = self._current(request)
        if current is None:
            return
        if request.subresource == "status":
            # The status subresource ignores everything but status (as a real server does).
            for key in list(data):
                if key not in ("status", "metadata"):
                    del data[key]
            data["metadata"].clear()  # in place: the caller stamps a new resourceVersion on it
            return
        if "status" in data and request.resource == DD:
            del data["status"]  # the main resource ignores status when /status exists
        if request.subresource is None:
            self._admit(request, deep_merge(current, data))
        if "spec" in data or request.subresource == "scale":
            new_spec = deep_merge(current.get("spec") or {}, data.get("spec") or {})
            if request.resource == DD:
                self._check_dd({**current, "spec": new_spec})
            if new_spec != current.get("spec"):
                data["metadata"]["generation"] = int(current["metadata"].get("generation", 1)) + 1

    async def _serve_list(self, request: kmock.Request) -> Any:
        data = await super()._serve_list(request)
        data["items"] = [item for item in data["items"] if selected(item, request.params)]
        resource = request.resource
        info = self.resources[resource] if resource in self.resources else None  # noqa: SIM401 (no .get)
        kind = (info.kind if info and info.kind else resource.plural.capitalize()) + "List"
        api_version = f"{resource.group}/{resource.version}" if resource.group else resource.version
        listing = {"apiVersion": api_version, "kind": kind, **data}
        if resource == DD and "as=Table" in request.headers.get("Accept", ""):
            return self._table(listing["items"])
        return listing

    def _table(self, items: list[Mapping[str, Any]]) -> dict[str, Any]:
        """What a server answers `kubectl get` with: the CRD's printer columns, evaluated."""
        columns = [{"name": "Name", "type": "string", "format": "name"}] + [
            {"name": c["name"], "type": c["type"], "format": ""} for c in self._dd_columns]
        rows = []
        for item in items:
            cells: list[Any] = [item["metadata"]["name"]]
            for column in self._dd_columns:
                value = jsonpath(item, column["jsonPath"])
                if column["type"] == "date" and value:
                    value = "0s"  # an age; the emulator has no clock worth printing
                cells.append(value)
            rows.append({"cells": cells, "object": {"kind": "PartialObjectMetadata",
                                                    "apiVersion": "meta.k8s.io/v1",
                                                    "metadata": item["metadata"]}})
        return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {},
                "columnDefinitions": columns, "rows": rows}

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        """The server filters watch events by the request's selectors too."""
        async for item in super()._serve_watch(request):
            if isinstance(item, dict) and not selected(item.get("object") or {}, request.params):
                continue
            yield item

    async def _serve_version(self, request: kmock.Request) -> Any:
        data = await super()._serve_version(request)
        if request.resource.group == "":
            data["groupVersion"] = request.resource.version  # core is "v1", not "/v1"
        return data

    def _scale(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        meta = obj.get("metadata", {})
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace"),
                             "resourceVersion": meta.get("resourceVersion")},
                "spec": {"replicas": (obj.get("spec") or {}).get("replicas", 0)},
                "status": {"replicas": (obj.get("status") or {}).get("replicas", 0),
                           "selector": (obj.get("status") or {}).get("selector", "")}}

    async def _serve_fetch(self, request: kmock.Request) -> Any:
        obj = await super()._serve_fetch(request)
        return self._scale(obj) if request.subresource == "scale" else obj

    async def _serve_update(self, request: kmock.Request) -> Any:
        obj = await super()._serve_update(request)
        return self._scale(obj) if request.subresource == "scale" else obj


_FILTER = re.compile(r'^\[\?\(@\.(\w+)=="([^"]*)"\)\]')


def jsonpath(obj: Any, path: str) -> Any:
    """The subset of JSONPath printer columns use: `.a.b` and `[?(@.key=="value")]`."""
    rest = path
    while rest and obj is not None:
        match = _FILTER.match(rest)
        if match:
            key, want = match.groups()
            obj = next((x for x in obj or [] if isinstance(x, Mapping) and x.get(key) == want), None)
            rest = rest[match.end():]
            continue
        field = re.match(r"^\.(\w+)", rest)
        if field is None:
            raise ValueError(f"unsupported JSONPath {path!r} at {rest!r}")
        obj = obj.get(field.group(1)) if isinstance(obj, Mapping) else None
        rest = rest[field.end():]
    return obj


def write_kubeconfig(path: Path, server: str) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": server}}],
        "users": [{"name": "kmock", "user": {}}],
        "contexts": [{"name": "kmock",
                      "context": {"cluster": "kmock", "user": "kmock", "namespace": "default"}}],
    }))
    return path


async def eventually(predicate: Callable[[], Any], *, timeout: float = 10.0,
                     what: str = "condition") -> Any:
    """Poll ``predicate`` on the event loop until it returns a truthy value."""
    async def loop() -> Any:
        while True:
            value = predicate()
            if value:
                return value
            await asyncio.sleep(0.02)  # yield to the operator's tasks; no wall-clock assertion

    try:
        return await asyncio.wait_for(loop(), timeout)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


@contextlib.asynccontextmanager
async def running_operator(*, namespaces: tuple[str, ...] = ("default",),
                           clusterwide: bool = False,
                           timeout: float = 15.0) -> AsyncIterator[asyncio.Task[None]]:
    """Run the real kopf operator (ditserve.operator.handlers) until the block exits:
    watching ``namespaces``, or every namespace with ``clusterwide``."""
    import kopf

    import ditserve.operator.handlers  # noqa: F401  (registers the handlers)

    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(kopf.operator(
        standalone=True, clusterwide=clusterwide, namespaces=[] if clusterwide else list(namespaces),
        ready_flag=ready, stop_flag=stop))
    try:
        # kopf can hang forever on a startup error; never wait on it without a bound.
        await asyncio.wait_for(ready.wait(), timeout)
        yield task
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout)


async def http(method: str, url: str, body: Any = None,
               content_type: str = "application/json") -> tuple[int, Any]:
    """One raw API request (what kubectl would send), answering (status, decoded JSON)."""
    import aiohttp

    data = None if body is None else json.dumps(body)
    async with aiohttp.ClientSession() as session, session.request(
            method, url, data=data, headers={"Content-Type": content_type}) as resp:
        return resp.status, await resp.json(content_type=None)
