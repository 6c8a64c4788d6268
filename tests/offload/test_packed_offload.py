"""Lossless packed streaming (``compress="lossless"``) on the CPU: outputs bit-identical to
plain bf16 DLO, packed host bytes reported, other dtype regions raw, weights given back exactly."""

from __future__ import annotations

import pytest
import torch
from offload.support import build_flux, flux_inputs, run  # type: ignore[import-not-found]
from torch import nn

from ditserve.engine.config import OffloadConfig
from ditserve.engine.errors import OffloadError
from ditserve.engine.formats.packed_layout import layout_for
from ditserve.engine.offload import enable_offload

PLAIN = OffloadConfig(enabled=True)
PACKED = OffloadConfig(enabled=True, compress="lossless")


def wide_flux() -> nn.Module:
    """bf16 Flux, 3 + 2 blocks of width 128: blocks large enough (~0.3-0.6M values) that the
    8 stripes' tile padding stays small, so the packed size shows the format's ratio."""
    return build_flux(attention_head_dim=64, num_attention_heads=2,
                      axes_dims_rope=(16, 24, 24)).to(torch.bfloat16)


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("slots", [2, 3])
def test_packed_dlo_is_bit_identical_to_bf16_dlo(slots: int) -> None:
    model = wide_flux()
    inputs = flux_inputs(2, dtype=torch.bfloat16)
    resident = run(model, inputs)
    plain = enable_offload(model, OffloadConfig(enabled=True, slots=slots), "cpu")
    want = [run(model, inputs) for _ in range(3)]  # cold, then warm steps
    plain_report = plain.report()
    plain.disable()
    handle = enable_offload(model, OffloadConfig(enabled=True, slots=slots,
                                                 compress="lossless"), "cpu")
    try:
        got = [run(model, inputs) for _ in range(3)]
        report = handle.report()
    finally:
        handle.disable()
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert torch.equal(got[0], resident)
    # The same plan and the same traffic in slot terms; fewer host bytes behind it.
    assert report["streamed_bytes"] == plain_report["streamed_bytes"]
    assert report["bytes_transferred"] == plain_report["bytes_transferred"]
    assert report["compress"] == "lossless" and report["backing"] == "pageable-packed"
    assert report["transfer"] == "sync-copy+decode"
    assert report["packed_raw_bytes"] == report["streamed_bytes"]  # every block region is bf16
    assert report["host_bytes"] == report["packed_host_bytes"]
    assert 0.75 < report["packed_ratio"] < 0.8
    assert report["packed_host_bytes"] < 0.8 * plain_report["host_bytes"]
    assert plain_report["compress"] == "none" and plain_report["device_staging_bytes"] == 0


def test_packed_host_bytes_are_the_layouts_of_the_blocks() -> None:
    model = wide_flux()
    handle = enable_offload(model, PACKED, "cpu")
    try:
        report = handle.snapshot()
        sources = handle.plan.streamed_blocks
        packed = report.host.packed
        assert packed is not None and packed.stripes == 8
        # Each block's packed run holds its padded bf16 region; escapes are rare.
        runs = [layout_for(b.regions[0].numel, (0,) * 8) for b in sources]
        assert packed.raw_bytes == sum(r.raw_nbytes for r in runs)
        assert packed.packed_bytes >= sum(r.nbytes for r in runs)  # escape sections on top
        assert packed.escapes < 1e-3 * packed.raw_bytes
        # One staging buffer per slot, each the size of the largest packed run.
        assert report.transfer.device_staging_bytes % report.slots == 0
        assert report.transfer.device_staging_bytes // report.slots >= max(r.nbytes for r in runs)
    finally:
        handle.disable()


def test_disable_gives_back_the_exact_weights_and_enable_again() -> None:
    model = wide_flux()
    inputs = flux_inputs(1, dtype=torch.bfloat16)
    before, want = state(model), run(model, inputs)
    handle = enable_offload(model, PACKED, "cpu")
    run(model, inputs)
    handle.disable()
    after = state(model)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k].view(torch.uint8) if before[k].dtype == torch.bfloat16
                           else before[k], after[k].view(torch.uint8)
                           if after[k].dtype == torch.bfloat16 else after[k]) for k in before)
    assert all(p.device.type == "cpu" for p in model.transformer_blocks.parameters())
    handle = enable_offload(model, PACKED, "cpu")
    try:
        assert torch.equal(run(model, inputs), want)
    finally:
        handle.disable()


class MixedBlock(nn.Module):
    """bf16 linears beside fp32 tensors: the fp32 region must stream raw, next to the packed."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width, dtype=torch.bfloat16)
        self.down = nn.Linear(4 * width, width, dtype=torch.bfloat16)
        self.gain = nn.Parameter(torch.rand(width) + 0.5)  # fp32
        self.register_buffer("shift", torch.randn(width))  # fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(torch.relu(self.up(x))).float()
        return (x.float() + y * self.gain + self.shift).to(x.dtype)


class MixedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.blocks = nn.ModuleList(MixedBlock(96) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_other_dtype_regions_stream_raw_beside_the_packed_one() -> None:
    model = MixedStack()
    inputs = {"x": torch.randn(3, 96, dtype=torch.bfloat16)}
    resident = run(model, inputs)
    handle = enable_offload(model, PACKED, "cpu")
    try:
        outs = [run(model, inputs) for _ in range(2)]
        report = handle.report()
    finally:
        handle.disable()
    assert all(torch.equal(o, resident) for o in outs)
    fp32_region = 2 * 512  # gain and shift: 384 bytes each, every tensor 256-byte aligned
    blocks = report["streamed_blocks"]
    assert report["host_bytes"] == report["packed_host_bytes"] + blocks * fp32_region
    assert report["streamed_bytes"] == report["packed_raw_bytes"] + blocks * fp32_region


def test_a_dit_without_bf16_weights_is_refused_and_left_unchanged() -> None:
    model = build_flux()  # fp32
    inputs = flux_inputs(1)
    want = run(model, inputs)
    with pytest.raises(OffloadError, match="bfloat16"):
        enable_offload(model, PACKED, "cpu")
    assert torch.equal(run(model, inputs), want)


def test_packing_is_refused_with_allgather_groups_that_do_not_divide_the_stripes() -> None:
    from ditserve.engine.config import format_problems

    assert format_problems(PACKED, group_size=2) == []
    assert format_problems(PACKED, group_size=4) == []
    (problem,) = format_problems(PACKED, group_size=3)
    assert "8 stripes" in problem and "group of 3" in problem
