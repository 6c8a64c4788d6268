"""cachectl's node status writer: what a node reports (pure, from a real store and real build
jobs) and the NodeCache object it keeps in the emulator, within the chart's RBAC for it."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from cachectl_support import make_identity, synthetic_tensors
from k8s.chart import template
from k8s.k8s_emulator import NODECACHES, Emulator, http
from k8s.rbac_check import Authorizer

from ditserve.cachectl.builds import Job, JobStatus
from ditserve.cachectl.model_build import ModelRequest
from ditserve.cachectl.node_status import KubeApi, NodeStatusReporter, node_cache_status
from ditserve.cachectl.store import CacheStore

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:10:00Z"


def _job(model: Path, status: JobStatus, *, key: str | None = None, phase: str = "queued",
         error: str | None = None) -> Job:
    job = Job(recipe_key="r" + model.name, request=ModelRequest(model, "bfloat16"))
    job.status, job.key, job.phase, job.error = status, key, phase, error
    return job


@pytest.fixture()
def cache(tmp_path: Path) -> tuple[CacheStore, str, dict[str, Path]]:
    store = CacheStore(tmp_path / "cache")
    entry = store.publish(make_identity(1, dtype="bfloat16"), synthetic_tensors(1))
    models = {name: tmp_path / "models" / name for name in ("flux", "wan", "qwen")}
    for path in models.values():
        path.mkdir(parents=True)
    return store, entry.key, models


def test_rows_for_entries_running_and_failed_builds(
        cache: tuple[CacheStore, str, dict[str, Path]]) -> None:
    store, key, models = cache
    jobs = [_job(models["flux"], JobStatus.READY, key=key, phase="published"),
            _job(models["wan"], JobStatus.BUILDING, phase="writing"),
            _job(models["qwen"], JobStatus.FAILED, error="no space left on device")]
    status = node_cache_status(store.list(), jobs, root="/var/cache/ditserve", previous=None, now=T0)
    assert (status["ready"], status["building"], status["failed"]) == (1, 1, 1)
    rows = {r["state"]: r for r in status["entries"]}
    assert rows["Ready"] == {"state": "Ready", "key": key, "model": str(models["flux"]),
                             "dtype": "bfloat16", "bytes": store.list()[0].bytes, "inUse": False,
                             "since": T0}
    assert rows["Building"]["model"] == str(models["wan"]) and rows["Building"]["message"] == "writing"
    assert rows["Failed"]["message"] == "no space left on device"

    # After a daemon restart (no jobs), the entry keeps its model path and its `since`.
    again = node_cache_status(store.list(), [], root="/var/cache/ditserve", previous=status, now=T1)
    assert again["entries"] == [rows["Ready"]]


@pytest.mark.kmock(cls=Emulator)
async def test_reporter_keeps_the_nodes_nodecache_within_its_rbac(
        kmock: Emulator, cache: tuple[CacheStore, str, dict[str, Path]], tmp_path: Path) -> None:
    store, key, models = cache
    status, node = await http("POST", f"{kmock.url}/api/v1/nodes",
                              {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gpu-1"}})
    assert status in (200, 201), node
    jobs: list[Job] = [_job(models["flux"], JobStatus.READY, key=key)]
    reporter = NodeStatusReporter(KubeApi(str(kmock.url)), node="gpu-1", root="/var/cache/ditserve",
                                  entries=store.list, jobs=lambda: jobs,
                                  logger=logging.getLogger("test"))
    assert await asyncio.to_thread(reporter.report_once)
    obj: Any = kmock.objects[NODECACHES, None, "gpu-1"].raw
    assert obj["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": "gpu-1", "uid": node["metadata"]["uid"]}]
    assert obj["status"]["ready"] == 1 and obj["status"]["heartbeatTime"]
    assert obj["status"]["entries"][0]["model"] == str(models["flux"])

    assert not await asyncio.to_thread(reporter.report_once)  # nothing new, no heartbeat due
    jobs.append(_job(models["wan"], JobStatus.BUILDING, phase="hashing"))
    assert await asyncio.to_thread(reporter.report_once)
    assert kmock.objects[NODECACHES, None, "gpu-1"].raw["status"]["building"] == 1

    # A restarted daemon reads its object back: the model path of the entry survives.
    fresh = NodeStatusReporter(KubeApi(str(kmock.url)), node="gpu-1", root="/var/cache/ditserve",
                               entries=store.list, jobs=list, logger=logging.getLogger("test"))
    assert await asyncio.to_thread(fresh.report_once)
    (row,) = kmock.objects[NODECACHES, None, "gpu-1"].raw["status"]["entries"]
    assert row["model"] == str(models["flux"]) and row["key"] == key

    daemon_calls = [c for c in kmock.calls if c.user_agent == "ditserve-cachectl"]
    assert {(c.method, c.subresource) for c in daemon_calls} >= {("POST", None), ("PATCH", "status")}
    rbac = Authorizer(template(tmp_path), service_account="rel-ditserve-cachectl",
                      namespace="ditserve-system")
    assert rbac.refused(daemon_calls, cluster_scoped={"nodecaches", "nodes"}) == []


def test_no_reporter_outside_a_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    assert NodeStatusReporter.from_env(root="/r", entries=list, jobs=list,
                                       logger=logging.getLogger("test")) is None
