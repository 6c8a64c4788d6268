"""The backing, transfer path and fallback reason are visible in /metrics (and /ready's report)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ditserve.engine.loop.lifecycle import EnginePhase
from ditserve.engine.loop.results import EngineStats
from ditserve.engine.server.metrics import ServingMetrics


def engine_with(report: dict[str, Any]) -> Any:
    """Just what the metrics read of an engine (engine.loop.client.EngineClient)."""
    return SimpleNamespace(phase=EnginePhase.READY, offload_report=lambda: report,
                           pipeline_report=lambda: None, adapter_stats=lambda: {},
                           start_report=lambda: None,
                           stats=lambda: EngineStats(running=0, waiting=0, steps_run=0,
                                                     rows_run=0, requests_finished=0))


def test_metrics_name_the_mapped_backing_and_path() -> None:
    report = {"backing_kind": "runtime_cache", "transfer_path": "registered",
              "fallback_reason": None, "pinned_host_bytes": 8192, "bytes_transferred": 0}
    text = ServingMetrics(lambda: engine_with(report)).render().decode()
    assert ('ditserve:offload_host_backing_info{backing_kind="runtime_cache",'
            'fallback_reason="",transfer_path="registered"} 1.0') in text
    assert "ditserve:offload_pinned_host_bytes 8192.0" in text


def test_metrics_carry_the_fallback_reason() -> None:
    report = {"backing_kind": "ordinary", "transfer_path": "private-slabs",
              "backing_reason": "checkpoint mmap refused: dtype mismatch", "fallback_reason": None,
              "pinned_host_bytes": 0, "bytes_transferred": 0}
    text = ServingMetrics(lambda: engine_with(report)).render().decode()
    assert 'fallback_reason="checkpoint mmap refused: dtype mismatch"' in text
