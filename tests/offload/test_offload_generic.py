"""DLO beyond Flux: the generic block rule, mixed sizes and dtypes, and every refusal."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from offload.support import build_flux, flux_inputs, holds_storage, run  # type: ignore[import-not-found]
from torch import nn

from ditserve.engine.config import OffloadConfig
from ditserve.engine.errors import OffloadError
from ditserve.engine.offload import enable_offload
from ditserve.engine.offload import hooks as offload_hooks

DLO = OffloadConfig(enabled=True)


class Block(nn.Module):
    """A residual block whose width, dtype mix and buffers vary per instance."""

    def __init__(self, width: int, hidden: int, half_gate: bool) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width, bias=False)
        gate_dtype = torch.float64 if half_gate else torch.float32
        self.gate = nn.Parameter(torch.randn(width, dtype=gate_dtype))
        self.register_buffer("shift", torch.randn(width))
        self.register_buffer("scratch", torch.zeros(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(torch.relu(self.up(x))) * self.gate.to(x.dtype) + self.shift
        return x + y + self.scratch


class ToyDiT(nn.Module):
    """Blocks of very different sizes in one list, resident embed/head around them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(
            Block(16, h, half_gate=i % 2 == 1) for i, h in enumerate([64, 8, 256, 16, 32])
        )
        self.scale = nn.Parameter(torch.ones(16))  # the root's own parameter stays resident
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h * self.scale)


def test_heterogeneous_blocks_and_dtypes_match_resident() -> None:
    model = ToyDiT().eval()
    x = torch.randn(3, 8)
    with torch.inference_mode():
        expected = model(x)
    handle = enable_offload(model, DLO, device="cpu")
    try:
        report = handle.report()
        assert report["streamed_blocks"] == 5
        # A slot fits the largest block (hidden 256: ~34 KB), not the whole model (~54 KB).
        largest = (16 * 256 * 2 + 256 + 2 * 16) * 4
        assert largest <= report["slot_bytes"] < largest + 4 * 256 < report["streamed_bytes"]
        for _ in range(3):
            with torch.inference_mode():
                assert torch.equal(model(x), expected)
        assert holds_storage(model.scale) and holds_storage(model.head.weight)
        assert not holds_storage(model.get_parameter("blocks.2.up.weight"))
        assert model.get_parameter("blocks.2.up.weight").shape == (256, 16)
        assert model.get_parameter("blocks.1.gate").dtype == torch.float64
    finally:
        handle.disable()
    with torch.inference_mode():
        assert torch.equal(model(x), expected)


def test_generic_rule_finds_sd3_blocks() -> None:
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    model: Any = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8,
        num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
        pooled_projection_dim=64, out_channels=4,
    )
    model.eval()
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(2, 4, 8, 8, generator=g),
                  encoder_hidden_states=torch.randn(2, 5, 32, generator=g),
                  pooled_projections=torch.randn(2, 64, generator=g),
                  timestep=torch.tensor([3.0, 500.0]), return_dict=False)
    expected = run(model, inputs)
    handle = enable_offload(model, DLO, device="cpu")
    try:
        assert handle.report()["streamed_blocks"] == 3
        assert torch.equal(run(model, inputs), expected)
    finally:
        handle.disable()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (OffloadConfig(enabled=False), "offload.enabled is false"),
        (OffloadConfig(enabled=True, resident_layers=-1), "resident_layers must be an integer"),
        (OffloadConfig(enabled=True, hbm_budget_gib=-1.0), "hbm_budget_gib must be a number"),
        (OffloadConfig(enabled=True, resident_layers=1, hbm_budget_gib=4.0), "set only one"),
        (OffloadConfig(enabled=True, runtime_cache=True), "act on the loader's HostWeightPlan"),
        (OffloadConfig(enabled=True, pin_limit_gib=1.0), "act on the loader's HostWeightPlan"),
        (OffloadConfig(enabled=True, checkpoint_mmap="sometimes"), "checkpoint_mmap must be"),
        (OffloadConfig(enabled=True, resident_layers=9), "exceeds the model's 5 blocks"),
        (OffloadConfig(enabled=True, hbm_budget_gib=1e-6), "raise the budget"),
    ],
)
def test_rejected_options_say_how_to_fix(config: OffloadConfig, message: str) -> None:
    model = build_flux()
    expected = run(model, flux_inputs(1))
    with pytest.raises(OffloadError, match=message):
        enable_offload(model, config, device="cpu")
    assert torch.equal(run(model, flux_inputs(1)), expected)  # untouched


def test_model_without_block_list_is_rejected() -> None:
    with pytest.raises(OffloadError, match="no block list to stream"):
        enable_offload(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), DLO, device="cpu")


def test_weights_shared_across_blocks_are_rejected() -> None:
    model = ToyDiT()
    model.blocks[3].shift = model.blocks[1].shift  # tie a buffer across two blocks
    with pytest.raises(OffloadError, match="own its weights"):
        enable_offload(model, DLO, device="cpu")
    model = ToyDiT()
    model.head.weight = model.get_parameter("blocks.0.up.weight")  # used by a resident module
    with pytest.raises(OffloadError, match="untie them"):
        enable_offload(model, DLO, device="cpu")


def test_enabling_twice_is_rejected_until_disabled() -> None:
    model = build_flux()
    handle = enable_offload(model, DLO, device="cpu")
    with pytest.raises(OffloadError, match="already enabled"):
        enable_offload(model, DLO, device="cpu")
    handle.disable()
    enable_offload(model, DLO, device="cpu").disable()


def test_failure_late_in_enable_leaves_the_model_as_it_was(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    model = build_flux()
    inputs = flux_inputs(2)
    expected = run(model, inputs)
    params = {n: p.data_ptr() for n, p in model.named_parameters()}

    def broken_attach(self, root=None) -> None:  # type: ignore[no-untyped-def]
        raise RuntimeError("injected failure")

    monkeypatch.setattr(offload_hooks.BlockStreamer, "attach", broken_attach)
    with pytest.raises(OffloadError, match="failed and was undone: RuntimeError: injected"):
        enable_offload(model, DLO, device="cpu")
    monkeypatch.undo()
    for n, p in model.named_parameters():
        assert p.data_ptr() == params[n], n  # the very same storage is back
    assert torch.equal(run(model, inputs), expected)
    handle = enable_offload(model, DLO, device="cpu")  # and a later enable works
    assert torch.equal(run(model, inputs), expected)
    handle.disable()


def test_out_of_order_block_calls_stay_correct() -> None:
    # A caller that runs blocks in another order (or aborts mid-forward) only costs loads.
    model = ToyDiT().eval()
    x = torch.randn(2, 16)
    with torch.inference_mode():
        expected = [block(x) for block in model.blocks]
    handle = enable_offload(model, DLO, device="cpu")
    try:
        with torch.inference_mode():
            for i in (3, 0, 4, 4, 1, 2):
                assert torch.equal(model.blocks[i](x), expected[i])
        assert handle.report()["load_misses"] >= 3
    finally:
        handle.disable()


def test_snapshot_is_the_typed_report_and_probe_shows_the_slots() -> None:
    model = ToyDiT().eval()
    handle = enable_offload(model, OffloadConfig(enabled=True, slots=3), device="cpu")
    try:
        with torch.inference_mode():
            model(torch.randn(2, 8))
        snap = handle.snapshot()
        assert snap.to_json() == handle.report()
        assert (snap.streamed_blocks, snap.slots, snap.group_size) == (5, 3, 1)
        assert snap.transfer.name == "sync-copy" and snap.transfer.copy_rate is None
        assert snap.host.backing == "pageable" and snap.host.host_bytes == snap.streamed_bytes
        assert snap.traffic.block_loads >= 5 and snap.traffic.passes == 1  # one forward
        probe = handle.probe()
        assert probe.copy_stream is None and probe.comm_stream is None  # synchronous copies
        assert probe.shard_regions == () and probe.shard_slots == ()  # rank-local
        assert len(probe.block_slots) == 3
        assert all(sum(t.numel() * t.element_size() for t in slot.values()) == snap.slot_bytes
                   for slot in probe.block_slots)
    finally:
        handle.disable()
    assert handle.probe().block_slots == ()  # freed
