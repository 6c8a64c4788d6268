"""The prompt cache's counters and the pipeline plan reach /metrics (Prometheus)."""

from __future__ import annotations

from server.fake_engine import FakeEngine  # type: ignore[import-not-found]

from ditserve.engine.server.metrics import ServingMetrics

REPORT = {
    "plan": [{"name": "text_encoder", "bytes": 10, "lives": "parked in host (pinned)",
              "device_bytes": 0, "transient_bytes": 10}],
    "predicted_weight_peak_bytes": 10,
    "prompt_cache": {"hits": 7, "misses": 3, "entries": 3, "bytes": 4096, "max_entries": 256,
                     "max_bytes": 1 << 30},
    "encode": {"passes": 2, "prompts": 5, "ahead": 3},
    "memory": {"predicted_peak_bytes": 3 << 30, "budget_bytes": 4 << 30},
}


def sample(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name + " "))
    return float(line.split()[-1])


def test_prompt_cache_counters_are_exported() -> None:
    engine = FakeEngine(pipeline=REPORT)
    text = ServingMetrics(lambda: engine).render().decode()
    assert sample(text, "ditserve:prompt_cache_hits_total") == 7
    assert sample(text, "ditserve:prompt_cache_misses_total") == 3
    assert sample(text, "ditserve:prompt_cache_bytes") == 4096
    assert sample(text, "ditserve:encoder_passes_total") == 2
    assert sample(text, "ditserve:encoder_prompts_ahead_total") == 3
    assert sample(text, "ditserve:hbm_predicted_peak_bytes") == 3 << 30
    assert sample(text, "ditserve:hbm_budget_bytes") == 4 << 30


def test_counters_are_zero_before_the_engine_reports() -> None:
    text = ServingMetrics(lambda: FakeEngine()).render().decode()
    assert sample(text, "ditserve:prompt_cache_hits_total") == 0
    assert sample(text, "ditserve:prompt_cache_misses_total") == 0
