"""Fixtures of the cachectl tests: a store on a tmp dir, child-process cleanup, and one
tiny diffusers model per session (built in code, never downloaded)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from cachectl_support import Child

from ditserve.cachectl.store import CacheStore


@pytest.fixture
def store(tmp_path: Path) -> CacheStore:
    return CacheStore(tmp_path / "cache", shard_bytes=64 * 1024)


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for c in started:
        if c.proc.poll() is None:
            c.kill9()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ditserve.engine.makers.tiny_model import init_tiny

    return init_tiny(tmp_path_factory.mktemp("models") / "tiny-flux")
