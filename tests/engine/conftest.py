"""Fixtures for engine tests: a CPU model runner on the tiny model."""

from __future__ import annotations

import pytest

from ditserve.engine.config import EngineConfig
from ditserve.engine.model_runner import ModelRunner


@pytest.fixture(scope="session")
def tiny_runner(tiny_model_dir) -> ModelRunner:  # type: ignore[no-untyped-def]
    config = EngineConfig(model=str(tiny_model_dir), device="cpu")
    return ModelRunner(config, model_dir=tiny_model_dir)
