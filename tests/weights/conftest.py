"""Shared tiny models of the checkpoint-file tests (built once per session, on first use)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_variant_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """tiny_variant_dir(variant) -> the directory of that tiny model (``init_tiny``)."""
    from ditserve.engine.makers.tiny_model import init_tiny

    root = tmp_path_factory.mktemp("variants")
    built: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in built:
            built[variant] = init_tiny(root / variant, family=variant)
        return built[variant]

    return get
