"""The node's cache status in Kubernetes: the daemon's side of the ``NodeCache`` object.

Owns what a node reports about its cache (``node_cache_status``: pure, from the store's
entries and the daemon's build jobs) and putting it in the node's cluster-scoped ``NodeCache``
object (``ditserve.io/v1alpha1``, named after the node, owned by the Node so it goes with it;
schema in crds/ditserve.io_nodecaches.yaml). ``NodeStatusReporter`` writes it when it changes
and at least every ``heartbeat_s``; the operator reads it (per-deployment summaries, node
labels for the engine pods' preferred affinity), and so can users: `kubectl get nodecaches`.

Rows: one per published entry (Ready, or Failed when its structure check found a problem) and
one per build that is running or failed. ``models``: one row per pulled model on disk (Ready,
with ``inUse`` while an engine leases it) and per pull that is downloading (with its bytes so far) or failed (with its reason). A Ready entry names the model path it was built from
when this daemon built or served it by path; the object itself remembers those paths across
daemon restarts (the store keys entries by content, not by path).

The API client is the standard library's urllib (cachectl never imports Kubernetes libraries):
in a pod it uses the service account's token, CA and $KUBERNETES_SERVICE_HOST/PORT.
Called by the daemon (``cachectl serve``): ``NodeStatusReporter.from_env(...)``, then
``start()`` / ``stop()``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from ditserve.cachectl.errors import NodeStatusError
from ditserve.cachectl.gc import EntryInfo
from ditserve.cachectl.logs import event

API = "/apis/ditserve.io/v1alpha1/nodecaches"
NODE_ENV = "NODE_NAME"  # set from the pod's spec.nodeName (Downward API)
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
MAX_ROWS = 256  # the CRD's maxItems
USER_AGENT = "ditserve-cachectl"  # names the daemon's requests in audit logs


class JobView(Protocol):
    """What the reporter reads of a daemon build job (``cachectl.builds.Job``)."""

    request: Any  # .model_dir, .dtype
    status: Any  # .value in building / ready / failed
    phase: str
    key: str | None
    error: str | None


class PullView(Protocol):
    """What the reporter reads of a daemon pull job (``cachectl.pull_jobs.PullJob``)."""

    uri: str
    status: Any  # .value in downloading / ready / failed
    phase: str
    key: str | None
    done_bytes: int
    total_bytes: int
    error: str | None
    reason: str | None


def model_rows(models: Iterable[EntryInfo], pulls: Iterable[PullView], *,
               previous: Mapping[str, Any] | None, now: str) -> list[dict[str, Any]]:
    """``status.models``: pulled models on disk, then running and failed pulls."""
    rows: list[dict[str, Any]] = []
    on_disk = set()
    for info in models:
        on_disk.add(info.key)
        row: dict[str, Any] = {"state": "Failed" if info.problem else "Ready",
                               "uri": info.uri or "", "key": info.key, "bytes": int(info.bytes)}
        row["inUse"] = info.in_use  # an engine serves from it (holds its lease)
        if info.problem:
            row["message"] = str(info.problem)[:1024]
        rows.append(row)
    for job in pulls:
        state = str(getattr(job.status, "value", job.status))
        if state == "ready" or (job.key and job.key in on_disk and state != "failed"):
            continue
        row = {"state": "Failed" if state == "failed" else "Downloading", "uri": job.uri,
               "doneBytes": int(job.done_bytes), "totalBytes": int(job.total_bytes),
               "message": str((f"{job.reason}: {job.error}" if state == "failed"
                               else job.phase) or "")[:1024]}
        if job.key:
            row["key"] = job.key
        rows.append(row)
    rows = sorted(rows, key=lambda r: (r["state"], r["uri"], r.get("key", "")))[:MAX_ROWS]
    old_rows = list((previous or {}).get("models") or [])
    for row in rows:
        row["since"] = next((str(o["since"]) for o in old_rows
                             if (o.get("uri"), o.get("state")) == (row["uri"], row["state"])
                             and o.get("since")), now)
    return rows


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def node_cache_status(entries: Iterable[EntryInfo], jobs: Iterable[JobView], *, root: str,
                      previous: Mapping[str, Any] | None, now: str) -> dict[str, Any]:
    """The ``status`` of this node's NodeCache (see the module doc). ``previous`` is the status
    last written, for model paths of entries and for when each row entered its state."""
    old_rows = list((previous or {}).get("entries") or [])
    model_of: dict[str, tuple[str, str]] = {
        r["key"]: (r["model"], r.get("dtype", "")) for r in old_rows
        if r.get("key") and r.get("model")}
    rows: list[dict[str, Any]] = []
    building: list[JobView] = []
    for job in jobs:
        state = str(getattr(job.status, "value", job.status))
        if state == "ready" and job.key:
            model_of[job.key] = (str(job.request.model_dir), job.request.dtype)
        elif state in ("building", "failed"):
            building.append(job)
    for info in entries:
        identity = info.identity or {}
        model, dtype = model_of.get(info.key, (None, str(identity.get("dtype") or "")))
        row: dict[str, Any] = {"state": "Failed" if info.problem else "Ready", "key": info.key,
                               "dtype": dtype, "bytes": int(info.bytes), "inUse": info.in_use}
        if model:
            row["model"] = model
        if info.problem:
            row["message"] = str(info.problem)[:1024]
        rows.append(row)
    for job in building:
        failed = str(getattr(job.status, "value", job.status)) == "failed"
        row = {"state": "Failed" if failed else "Building", "model": str(job.request.model_dir),
               "dtype": job.request.dtype,
               "message": str((job.error if failed else job.phase) or "")[:1024]}
        if job.key:
            row["key"] = job.key
        rows.append(row)
    rows = sorted(rows, key=lambda r: (r["state"], r.get("model", ""), r.get("key", "")))
    for row in rows[:MAX_ROWS]:
        row["since"] = _since(row, old_rows, now)
    counts = {s: sum(1 for r in rows if r["state"] == s) for s in ("Ready", "Building", "Failed")}
    return {"root": root, "ready": counts["Ready"], "building": counts["Building"],
            "failed": counts["Failed"], "entries": rows[:MAX_ROWS]}


def _since(row: Mapping[str, Any], old_rows: list[Mapping[str, Any]], now: str) -> str:
    for old in old_rows:
        same = (old.get("key") == row.get("key") if row.get("key") and old.get("key")
                else (old.get("model"), old.get("dtype")) == (row.get("model"), row.get("dtype")))
        if same and old.get("state") == row["state"] and old.get("since"):
            return str(old["since"])
    return now


class KubeApi:
    """The three requests the reporter needs, over urllib (blocking; call from a thread)."""

    def __init__(self, server: str, *, token_path: str | None = None,
                 ca_path: str | None = None, timeout_s: float = 15.0) -> None:
        self.server = server.rstrip("/")
        self._token_path = token_path
        self._timeout = timeout_s
        self._ssl = ssl.create_default_context(cafile=ca_path) if ca_path else None

    @classmethod
    def in_cluster(cls) -> KubeApi | None:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get(
            "KUBERNETES_SERVICE_PORT", "443")
        if not host or not os.path.exists(f"{SA_DIR}/token"):
            return None
        host = f"[{host}]" if ":" in host else host
        return cls(f"https://{host}:{port}", token_path=f"{SA_DIR}/token",
                   ca_path=f"{SA_DIR}/ca.crt")

    def request(self, method: str, path: str, body: Any = None,
                content_type: str = "application/json") -> dict[str, Any] | None:
        """The decoded answer; None for 404; NodeStatusError with the server's message else."""
        headers = {"Accept": "application/json", "User-Agent": USER_AGENT}
        if self._token_path:
            with open(self._token_path) as f:  # rotated on disk by the kubelet: read each time
                headers["Authorization"] = f"Bearer {f.read().strip()}"
        data = None
        if body is not None:
            data, headers["Content-Type"] = json.dumps(body).encode(), content_type
        req = urllib.request.Request(self.server + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self._timeout, context=self._ssl) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            said = e.read().decode(errors="replace")
            with contextlib.suppress(ValueError):  # a Status object names the problem
                said = json.loads(said).get("message", said)
            raise NodeStatusError(f"{method} {path}: {e.code} {e.reason}: {said}") from e
        except (urllib.error.URLError, OSError) as e:
            raise NodeStatusError(f"{method} {path}: cannot reach the API server: {e}") from e
        return json.loads(text) if text else {}


class NodeStatusReporter:
    """Keeps this node's NodeCache object up to date from the store and the build jobs."""

    def __init__(self, api: KubeApi, *, node: str, root: str,
                 entries: Callable[[], Iterable[EntryInfo]], jobs: Callable[[], Iterable[JobView]],
                 logger: logging.Logger, models: Callable[[], Iterable[Any]] = list,
                 pulls: Callable[[], Iterable[PullView]] = list, interval_s: float = 15.0,
                 heartbeat_s: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.api, self.node, self.root = api, node, root
        self._entries, self._jobs, self.logger = entries, jobs, logger
        self._models, self._pulls = models, pulls
        self.interval_s, self.heartbeat_s, self._clock = interval_s, heartbeat_s, clock
        self._last: dict[str, Any] | None = None  # the status last written
        self._last_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_env(cls, *, root: str, entries: Callable[[], Iterable[EntryInfo]],
                 jobs: Callable[[], Iterable[JobView]], logger: logging.Logger,
                 models: Callable[[], Iterable[Any]] = list,
                 pulls: Callable[[], Iterable[PullView]] = list) -> NodeStatusReporter | None:
        """A reporter for the node in $NODE_NAME when running in a pod; None otherwise."""
        node, api = os.environ.get(NODE_ENV), KubeApi.in_cluster()
        if not node or api is None:
            return None
        return cls(api, node=node, root=root, entries=entries, jobs=jobs, logger=logger,
                   models=models, pulls=pulls)

    def _path(self, subresource: str = "") -> str:
        return f"{API}/{self.node}" + (f"/{subresource}" if subresource else "")

    def _ensure_object(self) -> dict[str, Any]:
        current = self.api.request("GET", self._path())
        if current is not None:
            return current
        meta: dict[str, Any] = {"name": self.node, "labels": {
            "app.kubernetes.io/part-of": "ditserve", "app.kubernetes.io/managed-by": "cachectl"}}
        node = self.api.request("GET", f"/api/v1/nodes/{self.node}")
        if node is not None:  # owned by its Node: deleted with it
            meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": self.node,
                                        "uid": node["metadata"]["uid"]}]
        body = {"apiVersion": "ditserve.io/v1alpha1", "kind": "NodeCache", "metadata": meta}
        return self.api.request("POST", API, body) or body

    def report_once(self, *, force: bool = False) -> bool:
        """Write the status if it changed or a heartbeat is due; whether it wrote."""
        if self._last is None:
            self._last = dict(self._ensure_object().get("status") or {})
            force = True
        now = _now()
        status = node_cache_status(self._entries(), self._jobs(), root=self.root,
                                   previous=self._last, now=now)
        models = model_rows(self._models(), self._pulls(), previous=self._last, now=now)
        if models or self._last.get("models"):
            status["models"] = models
            status["downloading"] = sum(1 for r in models if r["state"] == "Downloading")
        unchanged = {k: v for k, v in self._last.items() if k != "heartbeatTime"} == status
        if unchanged and not force and self._clock() - self._last_at < self.heartbeat_s:
            return False
        status["heartbeatTime"] = _now()
        self.api.request("PATCH", self._path("status"), {"status": status},
                         "application/merge-patch+json")
        self._last, self._last_at = status, self._clock()
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.report_once():
                    event(self.logger, "node_status_written", node=self.node)
            except Exception as e:  # a flaky API must never take the cache daemon down
                self._last = None if isinstance(e, NodeStatusError) else self._last
                event(self.logger, "node_status_failed", logging.WARNING, node=self.node,
                      error=str(e))
            self._stop.wait(self.interval_s)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="cachectl-node-status",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)
