"""`ditserve-operator` as a real process: it logs in with $KUBECONFIG, serves its liveness
endpoint, reconciles, and exits cleanly on SIGTERM (what the chart's Deployment relies on)."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from k8s.k8s_emulator import DEPLOYMENTS, Emulator, eventually, http, write_kubeconfig
from ports import free_port  # type: ignore[import-not-found]

pytestmark = [pytest.mark.kmock(cls=Emulator)]


async def _healthy(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as session, session.get(url) as resp:
            return resp.status == 200
    except aiohttp.ClientError:
        return False


async def test_console_script_serves_liveness_reconciles_and_stops(kmock: Emulator,
                                                                  tmp_path: Path) -> None:
    config = write_kubeconfig(tmp_path / "kubeconfig", str(kmock.url))
    port = free_port()
    script = Path(sys.executable).parent / "ditserve-operator"
    log = (tmp_path / "operator.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        str(script), "--namespace", "default", "--liveness-port", str(port),
        env={"KUBECONFIG": str(config), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        stdout=log, stderr=log)

    async def scenario() -> None:
        try:
            while not await _healthy(f"http://127.0.0.1:{port}/healthz"):
                assert proc.returncode is None, "the operator exited early"
                await asyncio.sleep(0.1)
            body = {"apiVersion": "ditserve.io/v1alpha1", "kind": "DiffusionDeployment",
                    "metadata": {"name": "proc", "namespace": "default"},
                    "spec": {"model": {"hostPath": "/mnt/models/m"}}}
            status, answer = await http(
                "POST", f"{kmock.url}/apis/ditserve.io/v1alpha1/namespaces/default/"
                        "diffusiondeployments", body)
            assert status in (200, 201), answer
            key = (DEPLOYMENTS, "default", "proc")
            await eventually(lambda: key in kmock.objects, timeout=30, what="Deployment")
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        assert await proc.wait() == 0

    try:
        await asyncio.wait_for(scenario(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        log.close()
    text = (tmp_path / "operator.log").read_text()
    assert "Traceback" not in text, text[-3000:]


def test_kopf_settings_bound_watches_and_keep_state_in_annotations() -> None:
    import kopf

    from ditserve.operator.deployments import configure

    settings, memo = kopf.OperatorSettings(), kopf.Memo()
    configure(settings=settings, memo=memo)
    assert settings.watching.server_timeout and settings.watching.client_timeout
    assert settings.watching.client_timeout > settings.watching.server_timeout
    assert settings.peering.standalone and settings.scanning.disabled
    # Events are posted explicitly (Normal ones too); log lines never become Events.
    assert settings.posting.enabled and not settings.posting.loggers
    # status.kopf is undeclared in the CRD and would be pruned: state lives in annotations.
    assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)
    assert isinstance(settings.persistence.diffbase_storage, kopf.AnnotationsDiffBaseStorage)
    assert memo["policy"].engine_image == "ghcr.io/ditserve/ditserve:0.1.0"


def test_peering_elects_one_replica_by_random_priority(monkeypatch: Any) -> None:
    import kopf

    from ditserve.operator.deployments import PEERING_ENV, configure

    monkeypatch.setenv(PEERING_ENV, "ditserve-operator")
    priorities = set()
    for _ in range(2):
        settings, memo = kopf.OperatorSettings(), kopf.Memo()
        configure(settings=settings, memo=memo)
        assert not settings.peering.standalone and settings.peering.mandatory
        assert settings.peering.name == "ditserve-operator"
        priorities.add(settings.peering.priority)
    # Two replicas with one priority would both pause (kopf pauses on a tie).
    assert len(priorities) == 2
