"""Fixtures of the Kubernetes tests: tool lookup (helm, kubectl) and kopf log hygiene."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator

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


@pytest.fixture()
def no_operator_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fail a test whose operator logged an error (a handler crashed or an API call failed)."""
    caplog.set_level(logging.INFO)
    yield
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
