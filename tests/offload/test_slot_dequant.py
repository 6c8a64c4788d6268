"""GGUF layers dequantized into the slots (``dequant="slot"``) on the CPU: outputs bit-identical
to the compute-side dequantization under DLO (and resident), slots reported with their decoded
region, the layers given back their own dequantization at disable, the option's rules."""

from __future__ import annotations

import gguf
import pytest
import torch
from offload.support import build_flux, flux_inputs, run  # type: ignore[import-not-found]
from torch import nn

from ditserve.engine.config import OffloadConfig
from ditserve.engine.config.rules import format_problems
from ditserve.engine.errors import OffloadError
from ditserve.engine.formats.gguf_linear import GGUFBlockLinear
from ditserve.engine.formats.gguf_quant import quantize
from ditserve.engine.offload import enable_offload
from ditserve.engine.placement.memory_estimates import dit_decoded_bytes
from ditserve.engine.weights.dit_file import gguf_quant

SLOT = OffloadConfig(enabled=True, dequant="slot")


def gguf_flux(qtype: str) -> nn.Module:
    """bf16 Flux (3 + 2 blocks, width 256: every block linear's rows hold whole Q4_K blocks)
    whose block linears are ``GGUFBlockLinear`` over ``qtype`` bytes, as a GGUF file loads."""
    model = build_flux(attention_head_dim=128, num_attention_heads=2,
                       axes_dims_rope=(32, 48, 48)).to(torch.bfloat16)
    quant = gguf_quant(gguf.GGMLQuantizationType[qtype])
    for blocks in (model.transformer_blocks, model.single_transformer_blocks):
        for name, layer in list(blocks.named_modules()):
            if not isinstance(layer, nn.Linear):
                continue
            parent_name, _, child = name.rpartition(".")
            parent = blocks.get_submodule(parent_name)
            data = quantize(layer.weight.detach().float().numpy(), qtype)
            setattr(parent, child, GGUFBlockLinear(
                layer.in_features, layer.out_features, weight_q=torch.from_numpy(data),
                quant=quant, bias=layer.bias, compute_dtype=torch.bfloat16))
    return model


def gguf_layers(model: nn.Module) -> list[GGUFBlockLinear]:
    return [m for m in model.modules() if isinstance(m, GGUFBlockLinear)]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("slots", [2, 3])
def test_slot_dequant_is_bit_identical_to_compute_dequant(qtype: str, slots: int) -> None:
    model = gguf_flux(qtype)
    inputs = flux_inputs(2, dtype=torch.bfloat16)
    resident = run(model, inputs)
    plain = enable_offload(model, OffloadConfig(enabled=True, slots=slots), "cpu")
    want = [run(model, inputs) for _ in range(3)]  # cold, then warm steps
    plain_report = plain.report()
    plain.disable()
    handle = enable_offload(model, OffloadConfig(enabled=True, slots=slots, dequant="slot"),
                            "cpu")
    try:
        assert all(m.decoded_weight is not None for m in gguf_layers(model))
        got = [run(model, inputs) for _ in range(3)]
        report = handle.report()
    finally:
        handle.disable()
    assert all((g - w).abs().max().item() == 0.0 for g, w in zip(got, want, strict=True))
    assert torch.equal(got[0], resident)
    # The same stored bytes stream; each slot also holds the largest block's bf16 weights.
    assert report["streamed_bytes"] == plain_report["streamed_bytes"]
    assert report["bytes_transferred"] == plain_report["bytes_transferred"]
    assert report["host_bytes"] == plain_report["host_bytes"]
    assert report["dequant"] == "slot" and plain_report["dequant"] == "compute"
    assert report["transfer"] == "sync-copy+decode"
    largest = max(sum(m.out_features * m.in_features for m in gguf_layers(block)) * 2
                  for block in [*model.transformer_blocks, *model.single_transformer_blocks])
    assert report["decoded_slot_bytes"] >= largest
    # The engine's budget planner counts the same decoded region per slot.
    assert dit_decoded_bytes(model, None) == report["decoded_slot_bytes"]
    assert report["slot_bytes"] == plain_report["slot_bytes"] + report["decoded_slot_bytes"]
    assert plain_report["decoded_slot_bytes"] == 0


def test_disable_gives_the_layers_back_their_own_dequantization() -> None:
    model = gguf_flux("Q8_0")
    inputs = flux_inputs(1, dtype=torch.bfloat16)
    want = run(model, inputs)
    handle = enable_offload(model, SLOT, "cpu")
    run(model, inputs)
    handle.disable()
    assert all(m.decoded_weight is None for m in gguf_layers(model))
    assert torch.equal(run(model, inputs), want)
    again = enable_offload(model, SLOT, "cpu")  # and enable again
    try:
        assert torch.equal(run(model, inputs), want)
    finally:
        again.disable()


def test_resident_blocks_keep_compute_dequant_and_the_budget_pays_for_decoded_regions() -> None:
    model = gguf_flux("Q4_K")
    inputs = flux_inputs(1, dtype=torch.bfloat16)
    want = run(model, inputs)
    handle = enable_offload(model, OffloadConfig(enabled=True, dequant="slot",
                                                 resident_layers=2), "cpu")
    try:
        resident = [m for b in model.transformer_blocks[:2] for m in gguf_layers(b)]
        assert all(m.decoded_weight is None for m in resident)
        assert torch.equal(run(model, inputs), want)
    finally:
        handle.disable()
    # An HBM budget that holds the slots' layout but not their decoded regions is refused.
    plain = enable_offload(model, OffloadConfig(enabled=True), "cpu")
    r = plain.report()
    plain.disable()
    fixed = r["resident_module_bytes"]
    largest = r["slot_bytes"]  # every block streamed: the largest block's layout
    budget = (fixed + 2 * largest + 1024) / 2**30
    ok = enable_offload(model, OffloadConfig(enabled=True, hbm_budget_gib=budget), "cpu",
                        activation_reserve_bytes=0)
    ok.disable()
    with pytest.raises(OffloadError, match="slots"):
        enable_offload(model, OffloadConfig(enabled=True, dequant="slot", hbm_budget_gib=budget),
                       "cpu", activation_reserve_bytes=0)


def test_a_dit_without_gguf_layers_is_refused_and_left_unchanged() -> None:
    model = build_flux().to(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(OffloadError, match="no streamed block holds one"):
        enable_offload(model, SLOT, "cpu")
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    handle = enable_offload(model, OffloadConfig(enabled=True), "cpu")  # nothing left behind
    handle.disable()


def test_slot_dequant_rules() -> None:
    assert format_problems(SLOT) == []
    assert any("needs offload.enabled" in p
               for p in format_problems(OffloadConfig(dequant="slot")))
    assert any("do not combine" in p for p in format_problems(
        OffloadConfig(enabled=True, dequant="slot", compress="lossless")))
    assert any("FP8" in p for p in format_problems(SLOT, quantization="fp8"))
    assert any("rank-local" in p for p in format_problems(SLOT, group_size=2))
    assert any("must be one of" in p
               for p in format_problems(OffloadConfig(enabled=True, dequant="x")))  # type: ignore[arg-type]


def test_every_block_resident_needs_no_decoded_region() -> None:
    model = gguf_flux("Q8_0")
    inputs = flux_inputs(1, dtype=torch.bfloat16)
    want = run(model, inputs)
    handle = enable_offload(model, OffloadConfig(enabled=True, dequant="slot",
                                                 resident_layers=5), "cpu")
    try:
        assert torch.equal(run(model, inputs), want)
        report = handle.report()
    finally:
        handle.disable()
    assert report["streamed_blocks"] == 0 and report["decoded_slot_bytes"] == 0
