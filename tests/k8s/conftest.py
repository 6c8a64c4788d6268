"""Fixtures of the Kubernetes tests: tool lookup (helm, kubectl), kopf log hygiene, the
emulator's kubeconfig, and the default chart rendered once per session."""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # kmock 0.8 loads its bundled resources with a deprecated importlib API.
    config.addinivalue_line("filterwarnings", "ignore:read_binary is deprecated:DeprecationWarning")


def require_tool(name: str) -> str:
    """The path of a CLI tool; skipped locally when missing, a failure in CI (CI=true)."""
    path = shutil.which(name)
    if path:
        return path
    message = f"{name} not found on PATH (run `make install` or scripts/get-helm.sh)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def _errors(caplog: pytest.LogCaptureFixture, expected: list[str]) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR
            and not any(re.search(p, r.getMessage()) for p in expected)]


@pytest.fixture()
def no_operator_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fail a test whose operator logged an error (a handler crashed or an API call failed)."""
    caplog.set_level(logging.INFO)
    yield
    assert not _errors(caplog, [])


@pytest.fixture()
def operator_errors_only(caplog: pytest.LogCaptureFixture) -> Iterator[Callable[[str], None]]:
    """Like no_operator_errors, but the test names the errors it provokes (regexes)."""
    caplog.set_level(logging.INFO)
    expected: list[str] = []
    yield expected.append
    assert not _errors(caplog, expected)


@pytest.fixture()
def kubeconfig(kmock: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from k8s.k8s_emulator import write_kubeconfig

    path = write_kubeconfig(tmp_path / "kubeconfig", str(kmock.url))
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.setenv("DITSERVE_ENGINE_IMAGE", "registry.test/ditserve:e2e")
    return path


@pytest.fixture(scope="session")
def default_chart(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The chart's objects with default values (release "rel" in ditserve-system)."""
    from k8s.chart import template

    return template(tmp_path_factory.mktemp("chart"))


@pytest.fixture()
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Failed syncs are retried after RETRY_DELAY_S; a test cannot wait the production 30 s."""
    import ditserve.operator.deployments as handlers

    monkeypatch.setattr(handlers, "RETRY_DELAY_S", 0.5)


@pytest.fixture()
def operator_calls_within_rbac(kmock: Any, default_chart: list[dict[str, Any]]) -> Iterator[None]:
    """Every API call the operator makes in a test is allowed by the chart's default RBAC."""
    from k8s.e2e_support import refused_operator_calls

    yield
    assert refused_operator_calls(kmock, default_chart) == []
