"""GGUF slot dequantization on CUDA (run on the device machine): the decode stream's outputs
bit-identical to the compute-side dequantization under DLO, in every slot count, steps
queued back to back; a steady state with no host synchronization; and the fused Q8_0 and
Q4_K kernels leaving every DLO output as diffusers' dequantizers give it."""

from __future__ import annotations

import pytest
import torch
from offload.support import flux_inputs, run, steady_steps_without_sync  # type: ignore[import-not-found]
from offload.test_slot_dequant import gguf_flux  # type: ignore[import-not-found]

from ditserve.engine.config import OffloadConfig
from ditserve.engine.formats import gguf_fused
from ditserve.engine.offload import enable_offload

pytestmark = pytest.mark.gpu


def cuda_inputs() -> dict:  # type: ignore[type-arg]
    return flux_inputs(2, device="cuda", dtype=torch.bfloat16, tokens=256, text=32)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("slots", [2, 4])
def test_slot_dequant_equals_compute_dequant_on_cuda(qtype: str, slots: int) -> None:
    model, inputs = gguf_flux(qtype), cuda_inputs()
    handle = enable_offload(model, OffloadConfig(enabled=True, slots=slots), device="cuda")
    try:
        want = [run(model, inputs) for _ in range(3)]
    finally:
        handle.disable()
    handle = enable_offload(model, OffloadConfig(enabled=True, slots=slots, dequant="slot"),
                            device="cuda")
    try:
        got = [run(model, inputs) for _ in range(4)]  # queued back to back, no host sync
        torch.cuda.synchronize()
        report = handle.report()
    finally:
        handle.disable()
    assert all((g - want[min(i, 2)]).abs().max().item() == 0.0 for i, g in enumerate(got))
    assert report["dequant"] == "slot" and report["transfer"] == "cuda-copy-stream+decode"
    assert report["decoded_slot_bytes"] > 0


@pytest.mark.parametrize(("qtype", "fused"), [("Q4_K", True), ("Q4_K", False), ("Q8_0", True)])
def test_slot_dequant_steady_state_has_no_host_synchronization(
        qtype: str, fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Fused (Q8_0, Q4_K): the Triton kernels' launches must not sync. Unfused (Q4_K with the
    # kernels off): diffusers' dequantizer makes constant tensors from lists at every call (a
    # synchronizing copy); the codec's DeviceConstants must serve them from its cache.
    monkeypatch.setattr(gguf_fused, "FUSED", fused)
    model, inputs = gguf_flux(qtype), cuda_inputs()
    handle = enable_offload(model, OffloadConfig(enabled=True, dequant="slot"), device="cuda")
    try:
        steady_steps_without_sync(model, inputs)
        assert handle.report()["load_misses"] == 1
    finally:
        handle.disable()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("dequant", ["compute", "slot"])
def test_fused_kernel_changes_no_dlo_output(qtype: str, dequant: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # Q8_0 and Q4_K on CUDA dequantize with formats.gguf_triton's kernels; with them switched
    # off the same steps run diffusers' dequantizer and cast: the outputs must not move a bit.
    from ditserve.engine.formats import gguf_triton

    launches = []
    kernel = f"dequantize_{qtype.lower()}_cuda"
    launch = getattr(gguf_triton, kernel)
    monkeypatch.setattr(gguf_triton, kernel,
                        lambda *a, **k: launches.append(1) or launch(*a, **k))
    model, inputs = gguf_flux(qtype), cuda_inputs()

    def steps() -> list[torch.Tensor]:
        config = OffloadConfig(enabled=True, slots=2, dequant=dequant)  # type: ignore[arg-type]
        handle = enable_offload(model, config, device="cuda")
        try:
            out = [run(model, inputs) for _ in range(3)]
            torch.cuda.synchronize()
        finally:
            handle.disable()
        return out

    fused = steps()
    assert launches  # the kernel ran
    monkeypatch.setattr(gguf_fused, "FUSED", False)
    launches.clear()
    plain = steps()
    assert not launches
    assert all(torch.equal(f, p) for f, p in zip(fused, plain, strict=True))
