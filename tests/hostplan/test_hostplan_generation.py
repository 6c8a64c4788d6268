"""Whole generations on mapped backings: checkpoint mmap and runtime cache == ordinary, exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, OffloadConfig
from ditserve.engine.errors import OffloadError
from ditserve.engine.model_runner import ModelRunner
from ditserve.engine.request import SamplingParams

REQUESTS = {
    "plain": SamplingParams(prompt="a red fox", num_inference_steps=3, seed=11),
    "cfg": SamplingParams(prompt="a castle", negative_prompt="blurry", true_cfg_scale=3.0,
                          num_inference_steps=2, seed=13),
}
ARRIVALS = {0: [("plain", REQUESTS["plain"])], 1: [("cfg", REQUESTS["cfg"])]}


def runner(model_dir: Path, **offload: object) -> ModelRunner:
    config = EngineConfig(model=str(model_dir), device="cpu",
                          offload=OffloadConfig(enabled=True, **offload))  # type: ignore[arg-type]
    return ModelRunner(config, model_dir=model_dir)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):  # type: ignore[no-untyped-def]
    ordinary = runner(tiny_model_dir, checkpoint_mmap="off")
    assert ordinary.offload_report()["backing_kind"] == "ordinary"
    want, sizes = drive(ordinary, ARRIVALS, max_num_seqs=2)
    ordinary.close()
    return want, sizes


def check_same(r: ModelRunner, reference) -> None:  # type: ignore[no-untyped-def]
    want, sizes = reference
    try:
        got, got_sizes = drive(r, ARRIVALS, max_num_seqs=2)
    finally:
        r.close()
    assert got_sizes == sizes
    for rid in want:
        assert torch.equal(got[rid], want[rid]), rid


def test_checkpoint_mmap_generation_equals_ordinary(tiny_model_dir, reference) -> None:  # type: ignore[no-untyped-def]
    r = runner(tiny_model_dir)  # --dlo-checkpoint-mmap auto is the default
    report = r.offload_report()
    assert report["backing_kind"] == "checkpoint_mmap"
    assert report["transfer_path"] == "staging" and report["fallback_reason"] is None
    assert report["skipped_materialization"] is True
    assert report["bound_tensors"] == report["expected_tensors"] > 0
    check_same(r, reference)


def test_runtime_cache_build_then_hit_equals_ordinary(tiny_model_dir, reference, tmp_path) -> None:  # type: ignore[no-untyped-def]
    cache = tmp_path / "cache"
    first = runner(tiny_model_dir, runtime_cache=True, cache_root=str(cache))
    report = first.offload_report()
    assert report["backing_kind"] == "runtime_cache"
    assert "built after an ordinary load" in report["backing_reason"]
    assert report["skipped_materialization"] is False
    check_same(first, reference)

    # A second engine maps the published entry without loading the model (recipe hit).
    second = runner(tiny_model_dir, runtime_cache=True, cache_root=str(cache))
    report = second.offload_report()
    assert report["backing_kind"] == "runtime_cache"
    assert "DiT load skipped" in report["backing_reason"]
    assert report["skipped_materialization"] is True
    check_same(second, reference)


def test_unusable_cache_root_falls_back_to_ordinary_with_reason(tiny_model_dir, reference, tmp_path) -> None:  # type: ignore[no-untyped-def]
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    r = runner(tiny_model_dir, runtime_cache=True, cache_root=str(not_a_dir / "cache"))
    report = r.offload_report()
    assert report["backing_kind"] == "ordinary"
    assert report["backing_reason"].startswith("runtime cache unavailable")
    check_same(r, reference)


def test_pin_limit_without_cuda_keeps_staging_and_says_why(tiny_model_dir, reference) -> None:  # type: ignore[no-untyped-def]
    r = runner(tiny_model_dir, pin_limit_gib=1.0)
    report = r.offload_report()
    assert report["transfer_path"] == "staging"
    assert "needs a CUDA device" in report["fallback_reason"]
    check_same(r, reference)


def test_unconsumed_plan_that_skipped_the_load_is_a_startup_error(tiny_model_dir, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import ditserve.engine.offload as offload_pkg
    from ditserve.engine.offload import backend

    real = backend.enable_offload

    def forgetful(model, config, device, *, host_plan=None, **kwargs):  # type: ignore[no-untyped-def]
        return real(model, config, device, host_plan=None, **kwargs)  # drops the plan

    monkeypatch.setattr(offload_pkg, "enable_offload", forgetful)
    with pytest.raises(OffloadError, match="no offload backend consumed the plan"):
        runner(tiny_model_dir)
