"""DLO on CUDA (run on the device machine): copy stream, events, pinned slabs, bf16 equality."""

from __future__ import annotations

import copy

import pytest
import torch
from offload.support import build_flux, flux_inputs, holds_storage, run, steady_steps_without_sync  # type: ignore[import-not-found]
from torch import nn

from ditserve.engine.config import OffloadConfig
from ditserve.engine.offload import enable_offload

pytestmark = pytest.mark.gpu
DLO = OffloadConfig(enabled=True)


def test_stream_path_equals_resident_in_bf16() -> None:
    # A model loaded on the CPU, as the engine hands it over; the reference runs resident.
    model = build_flux(num_layers=3, num_single_layers=4, num_attention_heads=4,
                       joint_attention_dim=64, attention_head_dim=32, axes_dims_rope=(8, 12, 12),
                       pooled_projection_dim=64).to(torch.bfloat16)
    reference = copy.deepcopy(model).to("cuda")
    inputs = {k: v for k, v in flux_inputs(3, device="cuda", dtype=torch.bfloat16,
                                             tokens=256, text=32).items()}
    inputs["encoder_hidden_states"] = torch.randn(3, 32, 64, device="cuda", dtype=torch.bfloat16)
    inputs["pooled_projections"] = torch.randn(3, 64, device="cuda", dtype=torch.bfloat16)
    expected = run(reference, inputs)
    handle = enable_offload(model, DLO, device="cuda")
    try:
        report = handle.report()
        assert report["transfer"] == "cuda-copy-stream"
        assert report["backing"].startswith("pinned")
        if report["backing"] == "pinned-registered":
            assert report["pinned_host_bytes"] == report["host_bytes"] == report["streamed_bytes"]
        for _ in range(4):
            out = run(model, inputs)
            assert torch.equal(out, expected)
        torch.cuda.synchronize()
        rate = handle.report()  # the copy clock: every load timed, a plausible PCIe rate
        assert rate["h2d_timed_bytes"] == pytest.approx(rate["bytes_transferred"], rel=0.05)
        assert 0.1 < rate["h2d_gbps"] < 1000 and rate["h2d_gbps_recent"] is not None
        assert not any(holds_storage(p) for p in model.transformer_blocks.parameters())
        assert model.transformer_blocks[0].ff.net[2].weight.device.type == "cuda"
    finally:
        handle.disable()
    assert all(p.device.type == "cpu" and holds_storage(p)
               for p in model.single_transformer_blocks.parameters())


class Wide(nn.Module):
    """Big weights, little compute (copies dominate) - or a slow start (compute dominates)."""

    def __init__(self, width: int, sleep_cycles: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, width, bias=False)
        self.b = nn.Linear(width, width, bias=False)
        self.sleep_cycles = sleep_cycles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sleep_cycles:
            torch.cuda._sleep(self.sleep_cycles)  # delay this block's reads of its weights
        return x + 0.01 * self.b(torch.tanh(self.a(x)))


class Stack(nn.Module):
    def __init__(self, n: int, width: int, sleep_cycles: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Wide(width, sleep_cycles) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("slots", [2, 4])
@pytest.mark.parametrize(
    ("width", "sleep_cycles"),
    [(4096, 0), (1024, 2_000_000)],
    ids=["copy-bound (read-after-write)", "compute-bound (write-after-read)"],
)
def test_stream_ordering_holds_under_pressure(width: int, sleep_cycles: int, slots: int) -> None:
    # Without the ready wait, a block reads a half-copied slot; without the free wait, the
    # next copy overwrites a slot a slow block still reads. Either breaks equality. With more
    # slots the copies run several blocks ahead, so a wrong slot choice would show here too.
    model = Stack(7, width, sleep_cycles).to(torch.bfloat16)
    x = torch.randn(4, width, device="cuda", dtype=torch.bfloat16)
    expected = run(copy.deepcopy(model).to("cuda"), {"x": x})
    handle = enable_offload(model, OffloadConfig(enabled=True, slots=slots), device="cuda")
    try:
        outs = [run(model, {"x": x}) for _ in range(5)]  # queued back to back, no host sync
        torch.cuda.synchronize()
        assert all(torch.equal(o, expected) for o in outs)
    finally:
        handle.disable()


def test_steady_state_has_no_host_synchronization() -> None:
    model = Stack(5, 2048, 0).to(torch.bfloat16)
    x = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
    handle = enable_offload(model, DLO, device="cuda")
    try:
        steady_steps_without_sync(model, {"x": x})
        assert handle.report()["load_misses"] == 1
    finally:
        handle.disable()
