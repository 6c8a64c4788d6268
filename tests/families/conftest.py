"""Tiny models of every family, built once per session, and runners over them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ditserve.engine.config import RunnerConfig

VIDEO_VARIANTS = ("wan", "wan2.2", "wan2.2-ti2v")


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """family_dir(variant) -> the directory of that tiny model (built on first use)."""
    from ditserve.engine.makers.tiny_model import init_tiny

    root = tmp_path_factory.mktemp("family-models")
    built: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in built:
            built[variant] = init_tiny(root / variant, family=variant)
        return built[variant]

    return get


@pytest.fixture(scope="session")
def family_runner(family_dir: Callable[[str], Path]) -> Callable[..., Any]:
    """family_runner(variant) -> a resident CPU ModelRunner on that tiny model (shared)."""
    from ditserve.engine.config import EngineConfig
    from ditserve.engine.runner.model_runner import ModelRunner

    runners: dict[str, Any] = {}

    def get(variant: str) -> Any:
        if variant not in runners:
            model = family_dir(variant)
            config = RunnerConfig.of(EngineConfig(model=str(model), device="cpu"))
            runners[variant] = ModelRunner(config, model_dir=model)
        return runners[variant]

    return get


@pytest.fixture(scope="session")
def family_offload_runner(family_dir: Callable[[str], Path]) -> Iterator[Callable[..., Any]]:
    """family_offload_runner(variant) -> a CPU ModelRunner streaming that tiny model's blocks
    (DLO), built once and shared as family_runner's are; closed when the session ends."""
    from ditserve.engine.config import EngineConfig, OffloadConfig
    from ditserve.engine.runner.model_runner import ModelRunner

    runners: dict[str, Any] = {}

    def get(variant: str) -> Any:
        if variant not in runners:
            model = family_dir(variant)
            config = RunnerConfig.of(EngineConfig(model=str(model), device="cpu",
                                                  offload=OffloadConfig(enabled=True)))
            runners[variant] = ModelRunner(config, model_dir=model)
        return runners[variant]

    yield get
    for runner in runners.values():
        runner.close()
