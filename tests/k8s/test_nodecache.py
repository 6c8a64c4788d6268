"""nodecache: NodeCache objects read into node labels and a deployment's summary (pure)."""

from __future__ import annotations

from typing import Any

from ditserve.operator.nodecache import (
    cache_label_key,
    node_label_patch,
    preferred_cached_node_term,
    summarize,
)

NOW = "2026-01-01T01:00:00Z"
FRESH, OLD = "2026-01-01T00:58:00Z", "2026-01-01T00:30:00Z"
FLUX = "/mnt/models/flux"


def nodecache(node: str, *entries: dict[str, Any], beat: str = FRESH) -> dict[str, Any]:
    return {"metadata": {"name": node}, "status": {"heartbeatTime": beat, "entries": list(entries)}}


def entry(state: str, model: str | None = FLUX, dtype: str = "bfloat16", **kw: Any) -> dict:
    row = {"state": state, "dtype": dtype, **kw}
    if model is not None:
        row["model"] = model
    return row


def test_label_keys_are_valid_and_distinct_per_model_and_dtype() -> None:
    key = cache_label_key(FLUX, "bfloat16")
    prefix, name = key.split("/")
    assert prefix == "cache.ditserve.io" and len(name) <= 63 and name.startswith("m-")
    assert key != cache_label_key(FLUX, "float16") != cache_label_key("/mnt/models/wan", "bfloat16")
    term = preferred_cached_node_term(FLUX, "bfloat16")
    assert term["preference"]["matchExpressions"][0]["key"] == key


def test_label_patch_adds_ready_models_and_removes_the_rest_only_under_its_prefix() -> None:
    ready, gone = cache_label_key(FLUX, "bfloat16"), cache_label_key("/old", "bfloat16")
    node = {"metadata": {"labels": {"kubernetes.io/hostname": "a", gone: "Ready"}}}
    nc = nodecache("a", entry("Ready"), entry("Building", model="/new"), entry("Ready", model=None))
    assert node_label_patch(node, nc) == {"metadata": {"labels": {ready: "Ready", gone: None}}}
    labelled = {"metadata": {"labels": {"kubernetes.io/hostname": "a", ready: "Ready"}}}
    assert node_label_patch(labelled, nc) is None  # nothing to do: no write
    assert node_label_patch(labelled, None) == {"metadata": {"labels": {ready: None}}}


def test_summary_per_node_best_state_and_stale_daemons() -> None:
    caches = [
        nodecache("a", entry("Ready", key="k" * 64), entry("Failed", message="disk full")),
        nodecache("b", entry("Building", message="writing")),
        nodecache("c", entry("Failed", message="no space left on device")),
        nodecache("d", entry("Ready"), beat=OLD),
        nodecache("e", entry("Ready", dtype="float16")),  # another dtype: not this deployment's
        nodecache("f"),
    ]
    summary = summarize(caches, model=FLUX, dtype="bfloat16", now=NOW)
    assert (summary["readyNodes"], summary["buildingNodes"], summary["failedNodes"],
            summary["unknownNodes"]) == (1, 1, 1, 1)
    assert summary["nodes"] == [
        {"name": "a", "state": "Ready"},
        {"name": "b", "state": "Building", "message": "writing"},
        {"name": "c", "state": "Failed", "message": "no space left on device"},
        {"name": "d", "state": "Unknown",
         "message": "its cachectl daemon has not reported recently"},
    ]
    assert summarize([], model=FLUX, dtype="bfloat16", now=NOW)["nodes"] == []
