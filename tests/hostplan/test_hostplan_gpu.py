"""Mapped backings on CUDA (device machine): real registration of a read-only mapping,
sources report pinned, output equals resident; staging; injected failures roll back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from offload.support import build_flux, flux_inputs, run  # type: ignore[import-not-found]

from ditserve.engine.config import OffloadConfig, RunnerConfig
from ditserve.engine.offload import enable_offload
from ditserve.engine.offload.host import mapped as mapped_backing
from ditserve.engine.offload.host.registration import CudaRegistrar, RegistrationRefused
from ditserve.engine.weights.backing_choice import checkpoint_dit
from ditserve.engine.weights.loader import DIT_COMPONENT, dit_class

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bf16 DiT checkpoint in two safetensors shards (the serving dtype: no cast)."""
    root = tmp_path_factory.mktemp("bf16-dit")
    model = build_flux(num_layers=3, num_single_layers=4, num_attention_heads=4,
                       joint_attention_dim=64, attention_head_dim=32, axes_dims_rope=(8, 12, 12),
                       pooled_projection_dim=64).to(BF16)
    model.save_pretrained(root / DIT_COMPONENT, max_shard_size="4MB")
    assert len(list((root / DIT_COMPONENT).glob("*.safetensors"))) >= 2
    return root


@pytest.fixture(scope="module")
def case(model_dir: Path):  # type: ignore[no-untyped-def]
    reference = dit_class().from_pretrained(model_dir, subfolder=DIT_COMPONENT, dtype=BF16)
    reference = reference.eval().to("cuda")
    inputs = flux_inputs(2, device="cuda", dtype=BF16, tokens=256, text=32)
    inputs["encoder_hidden_states"] = torch.randn(2, 32, 64, device="cuda", dtype=BF16)
    inputs["pooled_projections"] = torch.randn(2, 64, device="cuda", dtype=BF16)
    return inputs, run(reference, inputs)


def mapped(model_dir: Path):  # type: ignore[no-untyped-def]
    model, plan = checkpoint_dit(model_dir, dtype="bfloat16", model_cls=dit_class(),
                                 component=DIT_COMPONENT)
    assert model is not None, plan.reason
    streamed = [p.data for blocks in (model.transformer_blocks, model.single_transformer_blocks)
                for p in blocks.parameters()]
    return model, plan, streamed


def check_outputs(model, case) -> None:  # type: ignore[no-untyped-def]
    inputs, expected = case
    outs = [run(model, inputs) for _ in range(3)]  # queued back to back
    torch.cuda.synchronize()
    assert all(torch.equal(o, expected) for o in outs)


def test_registered_read_only_mapping_is_pinned_and_equals_resident(model_dir, case) -> None:  # type: ignore[no-untyped-def]
    model, plan, streamed = mapped(model_dir)
    assert not any(v.is_pinned() for v in streamed)
    handle = enable_offload(model, OffloadConfig(enabled=True, pin_limit_gib=1.0), "cuda",
                            host_plan=plan)
    try:
        r = handle.report()
        assert (r["transfer_path"], r["fallback_reason"]) == ("registered", None)
        assert r["backing"] == "checkpoint_mmap-registered"
        assert r["registered_bytes"] >= r["streamed_bytes"] and r["registered_ranges"] >= 2
        assert all(v.is_pinned() for v in streamed)
        check_outputs(model, case)
    finally:
        handle.disable()
    assert not any(v.is_pinned() for v in streamed)  # teardown unregistered every range


def test_staging_path_equals_resident(model_dir, case) -> None:  # type: ignore[no-untyped-def]
    model, plan, streamed = mapped(model_dir)
    handle = enable_offload(model, OffloadConfig(enabled=True), "cuda", host_plan=plan)
    try:
        r = handle.report()
        assert (r["transfer_path"], r["fallback_reason"]) == ("staging", None)
        assert r["pinned_host_bytes"] >= 2 * r["slot_bytes"]  # the two staging slots only
        assert r["pinned_host_bytes"] < r["streamed_bytes"]
        assert not any(v.is_pinned() for v in streamed)
        check_outputs(model, case)
    finally:
        handle.disable()


class FailsSecond(CudaRegistrar):
    """Registers the first range for real, refuses the second."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def register(self, address: int, nbytes: int) -> None:
        self.count += 1
        if self.count == 2:
            raise RegistrationRefused("injected failure")
        super().register(address, nbytes)


def test_injected_failure_rolls_back_every_range_and_keeps_staging(model_dir, case, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(mapped_backing, "CudaRegistrar", FailsSecond)
    model, plan, streamed = mapped(model_dir)
    handle = enable_offload(model, OffloadConfig(enabled=True, pin_limit_gib=1.0), "cuda",
                            host_plan=plan)
    try:
        r = handle.report()
        assert r["transfer_path"] == "staging"
        assert r["fallback_reason"] == "registration refused: injected failure"
        assert not any(v.is_pinned() for v in streamed)  # the first range was unregistered
        check_outputs(model, case)
    finally:
        handle.disable()


def test_engine_runtime_cache_registered_generation_equals_resident(tiny_model_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from engine.driver import drive  # type: ignore[import-not-found]

    from ditserve.engine.config import EngineConfig
    from ditserve.engine.request import SamplingParams
    from ditserve.engine.runner.model_runner import ModelRunner

    params = SamplingParams(prompt="a red fox", num_inference_steps=3, seed=11)
    resident = ModelRunner(RunnerConfig.of(EngineConfig(model=str(tiny_model_dir), device="cuda")),
                           model_dir=tiny_model_dir)
    want, _ = drive(resident, {0: [("a", params)]}, max_num_seqs=1)
    offload = OffloadConfig(enabled=True, runtime_cache=True, cache_root=str(tmp_path / "c"),
                            pin_limit_gib=1.0)
    config = RunnerConfig.of(EngineConfig(model=str(tiny_model_dir), device="cuda",
                                          offload=offload))
    runner = ModelRunner(config, model_dir=tiny_model_dir)
    try:
        r = runner.offload_report()
        assert (r["backing_kind"], r["transfer_path"]) == ("runtime_cache", "registered")
        got, _ = drive(runner, {0: [("a", params)]}, max_num_seqs=1)
        assert torch.equal(got["a"], want["a"])
    finally:
        runner.close()


def test_engine_registers_a_tmpfs_checkpoint_without_a_pin_limit(tiny_model_dir, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Issue 46: ``auto`` on CUDA maps a checkpoint it finds on tmpfs and registers it under an
    automatic pin limit (before, it copied it into private pinned memory beside its pages)."""
    import os

    from engine.driver import drive  # type: ignore[import-not-found]

    from ditserve.engine.config import EngineConfig
    from ditserve.engine.request import SamplingParams
    from ditserve.engine.runner.model_runner import ModelRunner
    from ditserve.engine.weights import host_check
    from ditserve.engine.weights.host_fit import GIB, HostMemory

    dev = os.stat((tiny_model_dir / DIT_COMPONENT).resolve()).st_dev
    mounts = f"25 24 {os.major(dev)}:{os.minor(dev)} / /m rw - tmpfs tmpfs rw\n"
    monkeypatch.setattr(host_check, "read_mountinfo", lambda: mounts)
    monkeypatch.setattr(host_check, "read_host_memory", lambda: HostMemory(64 * GIB))
    monkeypatch.delenv(host_check.CHECK_ENV, raising=False)
    params = SamplingParams(prompt="a red fox", num_inference_steps=3, seed=11)
    resident = ModelRunner(RunnerConfig.of(EngineConfig(model=str(tiny_model_dir), device="cuda")),
                           model_dir=tiny_model_dir)
    want, _ = drive(resident, {0: [("a", params)]}, max_num_seqs=1)
    runner = ModelRunner(RunnerConfig.of(EngineConfig(model=str(tiny_model_dir), device="cuda",
                                      offload=OffloadConfig(enabled=True))),
                         model_dir=tiny_model_dir)
    try:
        r = runner.offload_report()
        assert (r["backing_kind"], r["transfer_path"]) == ("checkpoint_mmap", "registered")
        assert "tmpfs" in r["backing_reason"] and r["auto_pin_limit_bytes"] > 0
        got, _ = drive(runner, {0: [("a", params)]}, max_num_seqs=1)
        assert torch.equal(got["a"], want["a"])
    finally:
        runner.close()
