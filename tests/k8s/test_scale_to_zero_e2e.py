"""spec.autoscaling.scaleToZero through the running operator (the emulator): the ScaledObject is
created in place of the HPA, turning it off brings the HPA back and deletes the ScaledObject,
and a cluster without KEDA gets a condition that says to install it. (The render tests in
test_scale_to_zero.py never sent the ScaledObject to an API server, and the operator could not:
it had no path for the kind.)"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from k8s.e2e_support import cond, create_dd, dd_url, merge_patch, obj
from k8s.k8s_emulator import (
    DD,
    DEPLOYMENTS,
    HPAS,
    SCALED_OBJECTS,
    Emulator,
    eventually,
    running_operator,
)

pytestmark = [pytest.mark.kmock(cls=Emulator),
              pytest.mark.usefixtures("quick_retries", "operator_calls_within_rbac")]
TEST_TIMEOUT_S = 60
SPEC: dict[str, Any] = {"model": {"hostPath": "/mnt/models/tiny", "sizeGiB": 2}}
PLAIN = {"enabled": True, "minReplicas": 1, "maxReplicas": 4}
FROM_ZERO = {"enabled": True, "minReplicas": 0, "maxReplicas": 4,
             "scaleToZero": {"enabled": True,
                             "prometheusAddress": "http://prometheus-operated.monitoring:9090"}}




def _run(scenario: Callable[[], Any]) -> Any:
    return asyncio.wait_for(scenario(), TEST_TIMEOUT_S)


async def test_scale_to_zero_creates_a_scaled_object_and_turning_it_off_restores_the_hpa(
        kmock: Emulator, kubeconfig: Path, no_operator_errors: None) -> None:
    async def scenario() -> None:
        async with running_operator():
            await create_dd(kmock, "flux", {**SPEC, "autoscaling": FROM_ZERO})
            so = await eventually(lambda: obj(kmock, SCALED_OBJECTS, "flux"), what="ScaledObject")
            assert so["spec"]["minReplicaCount"] == 0
            assert so["spec"]["scaleTargetRef"]["kind"] == "DiffusionDeployment"
            assert obj(kmock, DEPLOYMENTS, "flux") is not None
            assert obj(kmock, HPAS, "flux") is None

            # A merge patch: null removes scaleToZero (an object would be merged into it).
            await merge_patch(dd_url(kmock, "flux"),
                              {"spec": {"autoscaling": {**PLAIN, "scaleToZero": None}}})
            await eventually(lambda: obj(kmock, HPAS, "flux"), what="HPA")
            await eventually(lambda: obj(kmock, SCALED_OBJECTS, "flux") is None,
                             what="ScaledObject deleted")

    await _run(scenario)


class EmulatorWithoutKEDA(Emulator):
    keda_installed = False


@pytest.mark.kmock(cls=EmulatorWithoutKEDA)
async def test_without_keda_the_condition_says_to_install_it(
        kmock: Emulator, kubeconfig: Path, operator_errors_only: Callable[[str], None]) -> None:
    operator_errors_only(r"failed temporarily: ChildApplyFailed")

    async def scenario() -> None:
        async with running_operator():
            await create_dd(kmock, "flux", {**SPEC, "autoscaling": FROM_ZERO})
            await eventually(lambda: (cond(obj(kmock, DD, "flux"), "Ready") or {}).get("reason")
                             == "ChildApplyFailed", what="Ready=ChildApplyFailed")
            message = cond(obj(kmock, DD, "flux"), "Ready")["message"]  # type: ignore[index]
            assert "the KEDA API is not installed" in message

    await _run(scenario)
