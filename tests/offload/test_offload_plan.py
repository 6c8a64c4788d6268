"""The pure offload plan: flat layouts, slot sizes, and residency choices."""

from __future__ import annotations

import pytest

from ditserve.engine.errors import OffloadError
from ditserve.engine.offload.plan import (
    ALIGN_BYTES,
    TensorSpec,
    budget_residency,
    build_plan,
    layout_block,
    slot_layout,
)


def spec(name: str, shape: tuple[int, ...], dtype: str = "f32", itemsize: int = 4) -> TensorSpec:
    return TensorSpec(name, dtype, itemsize, shape)


def test_layout_packs_per_dtype_regions_aligned() -> None:
    block = layout_block(0, "b0", [spec("w", (3, 5)), spec("h", (7,), "f16", 2), spec("b", (5,))])
    assert [r.dtype for r in block.regions] == ["f32", "f16"]
    offsets = {t.name: t.offset for t in block.tensors}
    assert offsets["w"] == 0
    assert offsets["b"] * 4 % ALIGN_BYTES == 0 and offsets["b"] >= 15
    assert offsets["h"] == 0  # first of its own region
    for r in block.regions:
        assert r.host_offset % ALIGN_BYTES == 0 and r.nbytes % ALIGN_BYTES == 0
    assert block.payload_bytes == (15 + 5) * 4 + 7 * 2
    assert block.nbytes == sum(r.nbytes for r in block.regions)


def test_shard_multiple_pads_each_region() -> None:
    block = layout_block(0, "b", [spec("w", (1000,))], shard_multiple=3)
    (region,) = block.regions
    assert region.numel % 3 == 0 and (region.numel // 3) % (ALIGN_BYTES // 4) == 0


def test_slot_fits_the_largest_region_of_each_dtype() -> None:
    a = layout_block(0, "a", [spec("w", (4096,)), spec("h", (64,), "f16", 2)])
    b = layout_block(1, "b", [spec("w", (1024,)), spec("h", (8192,), "f16", 2)])
    slot = slot_layout([a, b])
    assert dict((d, n) for d, _, n in slot.regions) == {"f32": 4096, "f16": 8192}
    assert slot.nbytes >= max(a.nbytes, b.nbytes)


def blocks(*sizes: int) -> list[tuple[str, list[TensorSpec]]]:
    return [(f"b{i}", [spec("w", (n,))]) for i, n in enumerate(sizes)]


def test_resident_layers_keep_the_leading_blocks() -> None:
    plan = build_plan(blocks(64, 64, 64, 64, 64), resident_layers=2)
    assert plan.residency.resident == (0, 1)
    assert plan.streamed == (2, 3, 4)
    assert plan.streamed_bytes == 3 * 256


def test_too_many_resident_layers_is_rejected() -> None:
    with pytest.raises(OffloadError, match="exceeds the model's 3 blocks"):
        build_plan(blocks(64, 64, 64), resident_layers=4)


def test_both_residency_options_are_rejected() -> None:
    with pytest.raises(OffloadError, match="set only one"):
        build_plan(blocks(64, 64), resident_layers=1, hbm_budget_bytes=10**9)


def test_budget_spreads_resident_blocks_and_respects_the_budget() -> None:
    sizes = [1000] * 10
    r = budget_residency(sizes, budget_bytes=2000 + 5000, fixed_bytes=0, activation_reserve_bytes=0)
    assert len(r.resident) == 5
    # Spread along the order, not a leading run: no two resident blocks are adjacent.
    assert all(b - a >= 2 for a, b in zip(r.resident, r.resident[1:], strict=False))


def test_budget_counts_fixed_modules_reserve_and_two_slots() -> None:
    sizes = [1000, 3000, 1000, 3000, 1000]
    r = budget_residency(sizes, budget_bytes=100 + 50 + 6000 + 4000, fixed_bytes=100,
                         activation_reserve_bytes=50)
    kept = sum(sizes[i] for i in r.resident)
    assert 3000 <= kept <= 4000


def test_budget_large_enough_keeps_everything() -> None:
    r = budget_residency([10, 20, 30], budget_bytes=10**6, fixed_bytes=0, activation_reserve_bytes=0)
    assert r.resident == (0, 1, 2)


def test_budget_below_the_minimum_says_what_it_needs() -> None:
    with pytest.raises(OffloadError, match="below the .* GiB needed .* raise the budget"):
        budget_residency([1 << 30, 1 << 30], budget_bytes=1 << 30, fixed_bytes=0,
                         activation_reserve_bytes=0)


def test_budget_on_flux_sizes_keeps_the_largest_blocks_spread_among_them() -> None:
    # Flux: 19 double blocks (680 MB) then 38 single blocks (283 MB), bf16. The doubles are the
    # copy-bound ones near the balance point (docs/offload.md): they are kept first.
    sizes = [679_662_592] * 19 + [283_181_056] * 38
    gib = 1024**3
    fixed, reserve = 128_249_984, 2 * gib

    def kept(budget_gib: float) -> tuple[list[int], list[int], int]:
        r = budget_residency(sizes, budget_bytes=int(budget_gib * gib), fixed_bytes=fixed,
                             activation_reserve_bytes=reserve)
        available = int(budget_gib * gib) - fixed - reserve - 2 * max(sizes)
        assert sum(sizes[i] for i in r.resident) <= available
        return ([i for i in r.resident if i < 19], [i for i in r.resident if i >= 19],
                available)

    doubles, singles, available = kept(7.4)  # room for 6 doubles
    assert len(doubles) == available // sizes[0] == 6 and singles == []
    assert all(b - a >= 3 for a, b in zip(doubles, doubles[1:], strict=False))  # spread
    doubles, singles, available = kept(11.08)  # half the model: 12 doubles, then what is left
    assert len(doubles) == 12
    assert available - sizes[-1] < sum(sizes[i] for i in doubles + singles) <= available
    doubles, singles, _ = kept(20.0)  # every double, then singles spread among theirs
    assert len(doubles) == 19 and 0 < len(singles) < 38
    assert max(b - a for a, b in zip(singles, singles[1:], strict=False)) <= 3


def test_blocks_within_a_tenth_of_each_other_are_one_kind() -> None:
    # Quantized blocks vary a little in size (a few layers in another type): they are spread
    # as one kind, not kept largest-first in a run.
    sizes = [1000, 990, 1000, 995, 1000, 985, 400, 400]
    r = budget_residency(sizes, budget_bytes=2 * 1000 + 3000, fixed_bytes=0,
                         activation_reserve_bytes=0)
    assert r.resident == (1, 3, 5)  # every other one of the kind, not the three largest


