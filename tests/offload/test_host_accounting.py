"""Host-memory accounting of a live offload (engine.offload.accounting), on a CPU: a mapped
checkpoint is streamed from without a private copy, the private backing holds the streamed
bytes once, pinned bytes stay within 1.02x the streamed bytes, and broken promises are named
and logged."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest

from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig
from ditserve.engine.makers.tiny_model import init_tiny
from ditserve.engine.offload.accounting import PINNED_LIMIT, host_accounting
from ditserve.engine.runner.model_runner import ModelRunner


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny(tmp_path_factory.mktemp("acct") / "tiny")


def _runner(model: Path, mmap: str) -> ModelRunner:
    return ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cpu", dtype="float32",
                                                    offload=OffloadConfig(enabled=True,
                                                                          checkpoint_mmap=mmap))),
                       model_dir=model)


def test_mapped_checkpoint_is_streamed_from_not_copied(tiny_dir: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    with caplog.at_level(logging.INFO, logger="ditserve.engine.offload.backend"):
        runner = _runner(tiny_dir, "auto")
    try:
        report = runner.offload.snapshot()
        accounting = host_accounting(report)
    finally:
        runner.close()
    assert accounting.ok, accounting.problems
    assert report.host_plan["backing_kind"] == "checkpoint_mmap"
    # Every streamed byte is a view of the mapping: no private copy of the blocks.
    assert accounting.private_bytes == 0
    assert 0 < accounting.mapped_bytes <= accounting.streamed_bytes
    assert accounting.pinned_bytes <= PINNED_LIMIT * accounting.streamed_bytes
    assert "host memory:" in caplog.text and "shared file mapping" in caplog.text


def test_private_backing_holds_the_streamed_bytes_once(tiny_dir: Path) -> None:
    runner = _runner(tiny_dir, "off")
    try:
        accounting = host_accounting(runner.offload.snapshot())
    finally:
        runner.close()
    assert accounting.ok and accounting.mapped_bytes == 0
    assert accounting.private_bytes == accounting.streamed_bytes


def test_broken_promises_are_named(tiny_dir: Path) -> None:
    runner = _runner(tiny_dir, "auto")
    try:
        report = runner.offload.snapshot()
    finally:
        runner.close()
    copied = replace(report, host_plan={**report.host_plan, "skipped_materialization": False})
    assert any("also materialized" in p for p in host_accounting(copied).problems)
    partial = replace(report, host_plan={**report.host_plan, "bound_tensors": 1})
    assert any("private copies" in p for p in host_accounting(partial).problems)
    overpinned = replace(report, host=replace(report.host,
                                              pinned_bytes=2 * report.streamed_bytes))
    found = host_accounting(overpinned)
    assert not found.ok and found.pinned_ratio == pytest.approx(2.0, rel=0.01)
    assert any("exceed 1.02x" in p for p in found.problems)
