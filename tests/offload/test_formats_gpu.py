"""Host weight formats on CUDA (run on the device machine): packed streaming bit-identical to
plain bf16 DLO with pinned packed slabs, the decode stream ordered under pressure and free of
host syncs, the GPU encoder's bytes equal to the CPU's; FP8 DLO equal to resident FP8 with
``torch._scaled_mm``, and compiled (inductor) FP8 blocks."""

from __future__ import annotations

import copy

import pytest
import torch
from offload.support import build_flux, flux_inputs, run, steady_steps_without_sync  # type: ignore[import-not-found]
from offload.test_offload_gpu import Stack  # type: ignore[import-not-found]

from ditserve.engine.config import OffloadConfig
from ditserve.engine.formats.fp8_select import FP8Rule, quantize_fp8
from ditserve.engine.offload import enable_offload
from ditserve.engine.offload.builders import block_tensors
from ditserve.engine.offload.host.memory import PageableMemory
from ditserve.engine.offload.host.packed_slabs import PackedBacking
from ditserve.engine.offload.plan import TensorSpec, build_plan

pytestmark = pytest.mark.gpu
PLAIN = OffloadConfig(enabled=True)
PACKED = OffloadConfig(enabled=True, compress="lossless")


def flux_bf16() -> torch.nn.Module:
    return build_flux(num_layers=3, num_single_layers=4, num_attention_heads=4,
                      joint_attention_dim=64, attention_head_dim=32, axes_dims_rope=(8, 12, 12),
                      pooled_projection_dim=64).to(torch.bfloat16)


def flux_cuda_inputs() -> dict:  # type: ignore[type-arg]
    inputs = flux_inputs(3, device="cuda", dtype=torch.bfloat16, tokens=256, text=32)
    g = torch.Generator(device="cuda").manual_seed(5)
    inputs["encoder_hidden_states"] = torch.randn(3, 32, 64, device="cuda", dtype=torch.bfloat16,
                                                  generator=g)
    inputs["pooled_projections"] = torch.randn(3, 64, device="cuda", dtype=torch.bfloat16,
                                               generator=g)
    return inputs


def test_packed_stream_path_is_bit_identical_to_plain_dlo() -> None:
    model, inputs = flux_bf16(), flux_cuda_inputs()
    handle = enable_offload(model, PLAIN, device="cuda")
    want = [run(model, inputs) for _ in range(3)]
    handle.disable()
    handle = enable_offload(model, PACKED, device="cuda")
    try:
        report = handle.report()
        got = [run(model, inputs) for _ in range(4)]
        torch.cuda.synchronize()
        after = handle.report()
    finally:
        handle.disable()
    assert all(torch.equal(g, want[min(i, 2)]) for i, g in enumerate(got))
    assert report["transfer"] == "cuda-copy-stream+decode"
    assert report["backing"].startswith("pinned") and report["backing"].endswith("-packed")
    if report["backing"] == "pinned-registered-packed":
        assert report["pinned_host_bytes"] == report["host_bytes"] == report["packed_host_bytes"]
    # The copy clock times the packed bytes: what crosses PCIe is ~0.75 of the slot bytes.
    passes = after["bytes_transferred"] / report["streamed_bytes"]  # in slot (bf16) bytes
    assert after["h2d_timed_bytes"] < 0.8 * after["bytes_transferred"]
    assert after["h2d_timed_bytes"] == pytest.approx(passes * report["host_bytes"], rel=0.05)


def test_gpu_encoder_packs_the_same_bytes_as_the_cpu_encoder() -> None:
    model = flux_bf16()
    blocks = list(model.transformer_blocks) + list(model.single_transformer_blocks)  # type: ignore[arg-type]
    named = [block_tensors(b) for b in blocks]
    plan = build_plan([(f"b{i}", [TensorSpec(n, t.dtype, t.element_size(), tuple(t.shape))
                                   for n, t in ts]) for i, ts in enumerate(named)])
    backings = [PackedBacking(PageableMemory(), encode_device=torch.device(d))
                for d in ("cpu", "cuda")]
    for backing in backings:
        for layout, ts in zip(plan.blocks, named, strict=True):
            backing.add(layout, [t for _, t in ts])
    for index in range(len(plan.blocks)):
        cpu, gpu = (b.regions(index)[torch.bfloat16] for b in backings)
        assert cpu.layout == gpu.layout and torch.equal(cpu.data, gpu.data)  # type: ignore[union-attr]
    for backing in backings:
        backing.close()


@pytest.mark.parametrize("slots", [2, 4])
@pytest.mark.parametrize(
    ("width", "sleep_cycles"),
    [(4096, 0), (1024, 2_000_000)],
    ids=["copy-bound (read-after-write)", "compute-bound (write-after-read)"],
)
def test_decode_stream_ordering_holds_under_pressure(width: int, sleep_cycles: int,
                                                     slots: int) -> None:
    # Without the decode stream's wait for the copy, a decode reads half-copied staging;
    # without compute's wait for the decode, a block reads a half-decoded slot; without the
    # copy's wait for the release, a copy overwrites staging a decode (or a slow block's slot)
    # still reads. Any of them breaks equality.
    model = Stack(7, width, sleep_cycles).to(torch.bfloat16)
    x = torch.randn(4, width, device="cuda", dtype=torch.bfloat16)
    expected = run(copy.deepcopy(model).to("cuda"), {"x": x})
    handle = enable_offload(model, OffloadConfig(enabled=True, slots=slots, compress="lossless"),
                            device="cuda")
    try:
        outs = [run(model, {"x": x}) for _ in range(5)]  # queued back to back, no host sync
        torch.cuda.synchronize()
        assert all(torch.equal(o, expected) for o in outs)
    finally:
        handle.disable()


def test_packed_steady_state_has_no_host_synchronization() -> None:
    model = Stack(5, 2048, 0).to(torch.bfloat16)
    x = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
    handle = enable_offload(model, PACKED, device="cuda")
    try:
        steady_steps_without_sync(model, {"x": x})
        assert handle.report()["load_misses"] == 1
    finally:
        handle.disable()


def test_fp8_dlo_equals_resident_fp8_with_scaled_mm() -> None:
    model = flux_bf16()
    quantize_fp8(model)
    inputs = flux_cuda_inputs()
    resident = copy.deepcopy(model).to("cuda")
    expected = run(resident, inputs)
    handle = enable_offload(model, PLAIN, device="cuda")
    try:
        outs = [run(model, inputs) for _ in range(3)]
        torch.cuda.synchronize()
        report = handle.report()
    finally:
        handle.disable()
    assert all(torch.equal(o, expected) for o in outs)
    assert report["pinned_host_bytes"] <= 1.02 * report["streamed_bytes"]


def test_compiled_fp8_blocks_match_eager_fp8() -> None:
    from ditserve.engine.runner.compiled_blocks import compile_repeated_blocks

    model = flux_bf16().to("cuda")
    quantize_fp8(model, FP8Rule())
    inputs = flux_cuda_inputs()
    eager = run(model, inputs)
    compile_repeated_blocks(model, "inductor")
    compiled = run(model, inputs)
    # Fusion changes the rounding of the activation quantization's intermediates only.
    rel = (compiled.float() - eager.float()).norm() / eager.float().norm()
    assert rel < 0.02
