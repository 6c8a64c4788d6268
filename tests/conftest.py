"""Suite-wide pytest setup: offline hub settings and the `gpu` marker's skip rule."""

from __future__ import annotations

import os

import pytest

from ditserve.engine.config import RunnerConfig

# Nothing in the suite may reach a model hub; fail fast instead of hanging on the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any("gpu" in item.keywords for item in items):
        return
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A tiny random-weight Flux pipeline directory, built once per test session."""
    from ditserve.engine.makers.tiny_model import init_tiny

    return init_tiny(tmp_path_factory.mktemp("models") / "tiny-flux")


@pytest.fixture(scope="session")
def tiny_runner(tiny_model_dir):  # type: ignore[no-untyped-def]
    """A CPU ModelRunner on the tiny model (drive it with tests/engine/driver.py)."""
    from ditserve.engine.config import EngineConfig
    from ditserve.engine.runner.model_runner import ModelRunner

    return ModelRunner(RunnerConfig.of(EngineConfig(model=str(tiny_model_dir), device="cpu")),
                       model_dir=tiny_model_dir)
