"""kmock's KubernetesEmulator, patched to behave enough like an API server for kopf and kubectl.

kmock 0.8 stores objects as plain JSON; a real API server also sets server-side metadata,
bumps ``generation`` on spec changes, names list kinds, serves core discovery under ``v1``,
filters lists by label selector, serves ``/scale``, and validates + defaults custom
resources against their CRD. This subclass adds exactly those (the DiffusionDeployment CRD
only), plus helpers to start kopf against it.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from k8s.crd_schema import apply_defaults, load_crd, schema_errors, version_schema

_resource_versions = itertools.count(1)

DD = kmock.resource("ditserve.io", "v1alpha1", "diffusiondeployments")
DEPLOYMENTS = kmock.resource("apps", "v1", "deployments")
CONFIGMAPS = kmock.resource("", "v1", "configmaps")
SERVICES = kmock.resource("", "v1", "services")
PODS = kmock.resource("", "v1", "pods")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _selected(labels: Mapping[str, str], selector: str) -> bool:
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


class Emulator(kmock.KubernetesEmulator):
    """An in-memory Kubernetes API that knows the DiffusionDeployment CRD."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.resources.load_bundled()
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

    async def _handle(self, request: kmock.Request) -> Any:
        data = request.data
        if request.resource is not None and isinstance(data, dict):
            if request.action == kmock.action.CREATE and request.resource == DD:
                data.update(self._check_dd(data))  # defaulted, as the server stores it
            meta = data.setdefault("metadata", {})
            if request.action == kmock.action.CREATE:
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
        if "spec" in data or request.subresource == "scale":
            new_spec = _deep_merge(current.get("spec") or {}, data.get("spec") or {})
            if request.resource == DD:
                self._check_dd({**current, "spec": new_spec})
            if new_spec != current.get("spec"):
                data["metadata"]["generation"] = int(current["metadata"].get("generation", 1)) + 1

    async def _serve_list(self, request: kmock.Request) -> Any:
        data = await super()._serve_list(request)
        selector = request.params.get("labelSelector")
        if selector:
            data["items"] = [item for item in data["items"]
                             if _selected(item.get("metadata", {}).get("labels") or {}, selector)]
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


def _deep_merge(base: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


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
                           timeout: float = 15.0) -> AsyncIterator[asyncio.Task[None]]:
    """Run the real kopf operator (ditserve.operator.handlers) until the block exits."""
    import kopf

    import ditserve.operator.handlers  # noqa: F401  (registers the handlers)

    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(kopf.operator(
        standalone=True, namespaces=list(namespaces), ready_flag=ready, stop_flag=stop))
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
