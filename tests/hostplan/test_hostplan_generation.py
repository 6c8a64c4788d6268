"""Whole generations on mapped backings: checkpoint mmap and runtime cache == ordinary, exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig
from ditserve.engine.errors import OffloadError
from ditserve.engine.request import SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner

REQUESTS = {
    "plain": SamplingParams(prompt="a red fox", num_inference_steps=3, seed=11),
    "cfg": SamplingParams(prompt="a castle", negative_prompt="blurry", true_cfg_scale=3.0,
                          num_inference_steps=2, seed=13),
}
ARRIVALS = {0: [("plain", REQUESTS["plain"])], 1: [("cfg", REQUESTS["cfg"])]}


def runner(model_dir: Path, **offload: object) -> ModelRunner:
    config = EngineConfig(model=str(model_dir), device="cpu",
                          offload=OffloadConfig(enabled=True, **offload))  # type: ignore[arg-type]
    return ModelRunner(RunnerConfig.of(config), model_dir=model_dir)


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
    # Slots follow the file's tensor order, so back-to-back tensors load with one copy (the
    # tiny model's 128-byte biases break runs at the slot's 256-byte alignment; Flux's sizes
    # are all multiples of 256 bytes, one copy per block).
    assert report["streamed_blocks"] <= report["mapped_copies_per_pass"]
    assert report["mapped_copies_per_pass"] < report["mapped_tensors_per_pass"]
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
    assert report["mapped_copies_per_pass"] < report["mapped_tensors_per_pass"]
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


def test_copy_runs_merge_only_when_contiguous_in_the_slot_and_the_file() -> None:
    from types import SimpleNamespace

    from ditserve.engine.offload.host.mapped import CopyRun
    from ditserve.engine.offload.host.weight_plan import TensorBinding

    raw = torch.arange(64, dtype=torch.uint8)  # a fake mapped file

    def binding(offset: int, nbytes: int) -> TensorBinding:
        return TensorBinding(name="t", file=Path("f"), key="t", offset=offset, nbytes=nbytes,
                             dtype="F32", shape=(nbytes // 4,))

    def view(offset: int, nbytes: int) -> torch.Tensor:
        return raw[offset : offset + nbytes].view(torch.float32)

    run = CopyRun(0, 2, binding(0, 8), view(0, 8))
    assert run.continues(2, binding(8, 8))
    run.add(2, binding(8, 8), view(8, 8))
    assert not run.continues(6, binding(16, 8))  # a gap in the slot region
    assert not run.continues(4, binding(20, 8))  # a gap in the file
    parts = run.parts({"f": SimpleNamespace(raw=raw)})
    assert len(parts) == 1 and parts[0][0] == 0
    assert torch.equal(parts[0][1], raw[0:16].view(torch.float32))
    # Without a whole-file view, each tensor stays its own part, at its own slot offset.
    assert [(o, t.numel()) for o, t in run.parts({})] == [(0, 2), (2, 2)]


def test_flux_aligned_blocks_load_with_one_copy_each(tiny_model_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Real Flux tensors are all multiples of 256 bytes, so a block's tensors sit back to back in
    # its slot exactly as in the file: one copy per block instead of one per tensor.
    import shutil

    from diffusers import FluxTransformer2DModel

    from ditserve.engine.offload import enable_offload
    from ditserve.engine.weights.backing_choice import prepare_dit

    model = tmp_path / "aligned"
    shutil.copytree(tiny_model_dir, model)
    shutil.rmtree(model / "transformer")
    torch.manual_seed(0)
    FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=64,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        axes_dims_rope=(16, 24, 24), guidance_embeds=True,
    ).save_pretrained(model / "transformer")
    config = OffloadConfig(enabled=True)
    dit, plan = prepare_dit(model, dtype="float32", offload=config)
    handle = enable_offload(dit, config, device=torch.device("cpu"), host_plan=plan)
    try:
        report = handle.report()
        assert report["backing_kind"] == "checkpoint_mmap"
        assert report["mapped_copies_per_pass"] == report["streamed_blocks"] == 5
        assert report["mapped_tensors_per_pass"] > 100
    finally:
        handle.disable()
