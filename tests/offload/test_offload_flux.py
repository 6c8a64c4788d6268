"""DLO on a tiny diffusers Flux transformer (CPU, fp32): offloaded forward == resident forward."""

from __future__ import annotations

import pytest
import torch
from offload.support import build_flux, flux_inputs, holds_storage, run  # type: ignore[import-not-found]

from ditserve.engine.config import OffloadConfig
from ditserve.engine.offload import enable_offload

DLO = OffloadConfig(enabled=True)


def streamed_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [*model.get_submodule("transformer_blocks").children(),
            *model.get_submodule("single_transformer_blocks").children()]


@pytest.mark.parametrize("batch", [1, 3])
def test_offloaded_equals_resident(batch: int) -> None:
    model = build_flux()
    inputs = flux_inputs(batch)
    expected = run(model, inputs)
    handle = enable_offload(model, DLO, device="cpu")
    try:
        for _ in range(3):  # first step (cold), then warm steps from the circular prefetch
            assert torch.equal(run(model, inputs), expected)
    finally:
        handle.disable()


def test_batch_rows_match_single_rows() -> None:
    # Two requests' rows (e.g. CFG's cond/uncond) in one streamed forward == each alone.
    model = build_flux()
    a, b = flux_inputs(1, seed=5), flux_inputs(1, seed=6)
    alone = [run(model, a), run(model, b)]
    both = {k: torch.cat([a[k], b[k]]) if k not in ("img_ids", "txt_ids", "return_dict") else a[k]
            for k in a}
    handle = enable_offload(model, DLO, device="cpu")
    try:
        out = run(model, both)
    finally:
        handle.disable()
    torch.testing.assert_close(out, torch.cat(alone), rtol=1e-5, atol=1e-6)


def test_weights_cross_once_per_step_even_batched() -> None:
    model = build_flux()
    handle = enable_offload(model, DLO, device="cpu")
    try:
        streamed = handle.report()["streamed_bytes"]
        run(model, flux_inputs(1))  # cold step: block 0 loads on demand (one miss)
        for batch in (1, 4):
            before = handle.report()["bytes_transferred"]
            run(model, flux_inputs(batch))
            assert handle.report()["bytes_transferred"] - before == streamed
        assert handle.report()["load_misses"] == 1
    finally:
        handle.disable()


def test_at_most_two_blocks_hold_storage_during_a_forward() -> None:
    model = build_flux(num_layers=3, num_single_layers=4)
    blocks = streamed_modules(model)
    handle = enable_offload(model, DLO, device="cpu")
    seen: list[int] = []

    def count(module: torch.nn.Module, args: tuple) -> None:
        real = [any(holds_storage(t) for t in b.parameters()) for b in blocks]
        assert real[blocks.index(module)], "the running block must hold its weights"
        seen.append(sum(real))

    probes = [b.register_forward_pre_hook(count) for b in blocks]  # run after the DLO hooks
    try:
        run(model, flux_inputs(2))
        run(model, flux_inputs(2))
    finally:
        for p in probes:
            p.remove()
    assert len(seen) == 2 * len(blocks) and max(seen) <= 2
    # Between forwards every streamed block is a placeholder of the right shape.
    for block in blocks:
        for t in block.parameters():
            assert not holds_storage(t) and t.device.type == "cpu"
    handle.disable()


def test_parameter_objects_survive_enable_and_disable() -> None:
    model = build_flux()
    before = {name: id(p) for name, p in model.named_parameters()}
    values = {name: p.detach().clone() for name, p in model.named_parameters()}
    handle = enable_offload(model, DLO, device="cpu")
    run(model, flux_inputs(1))
    handle.disable()
    assert {name: id(p) for name, p in model.named_parameters()} == before
    for name, p in model.named_parameters():
        assert holds_storage(p) and torch.equal(p.detach(), values[name]), name


def test_enable_disable_enable() -> None:
    model = build_flux()
    inputs = flux_inputs(2)
    expected = run(model, inputs)
    for config in (DLO, OffloadConfig(enabled=True, resident_layers=2), DLO):
        handle = enable_offload(model, config, device="cpu")
        assert torch.equal(run(model, inputs), expected)
        handle.disable()
        assert torch.equal(run(model, inputs), expected)  # ordinary tensors again
        assert handle.report()["active"] is False
    handle.disable()  # idempotent


@pytest.mark.parametrize(("layers", "single", "slots"),
                         [(1, 0, 2), (1, 1, 2), (2, 1, 2), (4, 3, 2), (3, 4, 4)])
def test_block_counts_including_odd_and_one(layers: int, single: int, slots: int) -> None:
    # (3, 4, 4): a real Flux structure streamed through more than two slots.
    model = build_flux(num_layers=layers, num_single_layers=single)
    inputs = flux_inputs(2)
    expected = run(model, inputs)
    handle = enable_offload(model, OffloadConfig(enabled=True, slots=slots), device="cpu")
    try:
        for _ in range(3):
            assert torch.equal(run(model, inputs), expected)
        assert handle.report()["streamed_blocks"] == layers + single
    finally:
        handle.disable()


def test_resident_leading_layers() -> None:
    model = build_flux(num_layers=3, num_single_layers=2)
    inputs = flux_inputs(2)
    expected = run(model, inputs)
    handle = enable_offload(model, OffloadConfig(enabled=True, resident_layers=3), device="cpu")
    try:
        report = handle.report()
        assert report["resident_block_names"] == [
            "transformer_blocks.0", "transformer_blocks.1", "transformer_blocks.2"]
        assert report["streamed_blocks"] == 2
        assert torch.equal(run(model, inputs), expected)
        assert all(holds_storage(p) for p in model.transformer_blocks.parameters())
        assert not any(holds_storage(p) for p in model.single_transformer_blocks.parameters())
    finally:
        handle.disable()


def test_hbm_budget_keeps_part_of_the_model_resident() -> None:
    model = build_flux(num_layers=2, num_single_layers=6)
    inputs = flux_inputs(1)
    expected = run(model, inputs)
    probe = enable_offload(model, DLO, device="cpu")
    full = probe.report()
    probe.disable()
    largest = full["slot_bytes"]
    budget = full["resident_module_bytes"] + 2 * largest + full["streamed_bytes"] // 2
    config = OffloadConfig(enabled=True, hbm_budget_gib=budget / 1024**3)
    handle = enable_offload(model, config, device="cpu", activation_reserve_bytes=0)
    try:
        report = handle.report()
        assert report["residency"] == "hbm_budget"
        assert 0 < report["resident_blocks"] < report["blocks"]
        assert report["streamed_bytes"] < full["streamed_bytes"]
        assert torch.equal(run(model, inputs), expected)
    finally:
        handle.disable()


def test_report_is_json_and_describes_the_cpu_path() -> None:
    import json

    model = build_flux()
    handle = enable_offload(model, DLO, device="cpu")
    try:
        run(model, flux_inputs(1))
        report = json.loads(json.dumps(handle.report()))
    finally:
        handle.disable()
    assert report["transfer"] == "sync-copy" and report["backing"] == "pageable"
    assert report["streamed_blocks"] == 5 and report["resident_blocks"] == 0
    assert report["host_bytes"] == report["streamed_bytes"]
    assert report["slots"] == 2 and report["slot_bytes"] > 0
    assert report["bytes_transferred"] >= report["streamed_bytes"]
