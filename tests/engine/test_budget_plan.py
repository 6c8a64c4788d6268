"""The whole-pipeline HBM planner (engine.placement.budget_plan), pure: what a budget buys, in
order (streamed minimum, resident DiT blocks, resident encoders, whole decode), the refusal
naming the smallest budget, and how many same-shape decodes one VAE call takes."""

from __future__ import annotations

import dataclasses

import pytest

from ditserve.engine.errors import ConfigError
from ditserve.engine.placement.budget_plan import (
    GIB,
    MIB,
    PARKED,
    STREAMED,
    BudgetError,
    BudgetInputs,
    decode_batch,
    least_encoders,
    plan_budget,
    slack_bytes,
)

# Flux-like shapes: 19 double blocks of 680 MB, 38 single blocks of 283 MB.
INPUTS = BudgetInputs(
    dit_fixed=120 * MIB, dit_blocks=(680 * MIB,) * 19 + (283 * MIB,) * 38, slots=2,
    encoders=(("text_encoder", 235 * MIB), ("text_encoder_2", 9 * GIB)), parkable=True,
    encode_activations=400 * MIB, vae=160 * MIB, decode_whole=3 * GIB,
    decode_tiled=700 * MIB, denoise_activations=2 * GIB, prompt_cache=GIB)


def fits(plan) -> bool:  # type: ignore[no-untyped-def]
    return plan.predicted_peak + slack_bytes(plan.predicted_peak) <= plan.budget


def test_smallest_budget_is_met_and_one_byte_less_is_refused_with_it() -> None:
    with pytest.raises(BudgetError) as refused:
        plan_budget(INPUTS, 4 * GIB)
    minimum = refused.value.minimum_bytes
    # Streamed minimum: resident modules, two slots of the largest block, VAE, prompt
    # cache; the largest phase is the encode (the parked encoders visit), then slack.
    peak = 120 * MIB + 2 * 680 * MIB + 160 * MIB + GIB + 9 * GIB + 235 * MIB + 400 * MIB
    assert minimum == peak + slack_bytes(peak)
    assert isinstance(refused.value, ConfigError)  # reaches the operator like other errors
    message = str(refused.value)
    assert "--dlo-hbm-budget-gib (4.00 GiB) cannot hold the pipeline" in message
    assert f"smallest budget it can run in is {-(-minimum * 100 // GIB) / 100:.2f} GiB" in message
    assert "encode phase" in message
    plan = plan_budget(INPUTS, minimum)
    assert plan.resident_blocks == () and not plan.encoders_resident
    # The parked encoders' visit sets the peak: a whole decode fits beneath it for free.
    assert not plan.decode_tiled
    assert fits(plan) and plan.minimum == minimum
    with pytest.raises(BudgetError):
        plan_budget(INPUTS, minimum - 1)


def test_every_budget_above_the_minimum_fits_and_buys_blocks_first() -> None:
    minimum = plan_budget(INPUTS, 200 * GIB).minimum
    previous = -1
    for budget in range(minimum, 60 * GIB, GIB // 2):
        plan = plan_budget(INPUTS, budget)
        assert fits(plan), budget
        assert len(plan.resident_blocks) >= previous
        previous = len(plan.resident_blocks)
    assert previous == len(INPUTS.dit_blocks)


def test_a_large_budget_keeps_everything_resident_and_decodes_whole() -> None:
    plan = plan_budget(INPUTS, 80 * GIB)
    assert len(plan.resident_blocks) == len(INPUTS.dit_blocks)
    assert plan.held["dit slots"] == 0  # nothing streams, so no slot is needed
    assert plan.encoders_resident and not plan.decode_tiled
    assert plan.decode_room >= INPUTS.decode_whole
    assert plan.predicted_peak == sum(plan.held.values()) + 3 * GIB  # the whole decode
    assert plan.to_json()["encoders"] == "resident"


def test_resident_blocks_are_spread_along_the_order() -> None:
    plan = plan_budget(INPUTS, 25 * GIB)
    kept = plan.resident_blocks
    assert 0 < len(kept) < len(INPUTS.dit_blocks)
    assert kept != tuple(range(len(kept)))  # not a leading run: copies keep overlapping


def test_tiling_modes_change_the_minimum() -> None:
    auto = plan_budget(INPUTS, 200 * GIB).minimum
    off = dataclasses.replace(INPUTS, vae_tiling="off", encoders=(("t5", 100 * MIB),))
    small = dataclasses.replace(INPUTS, encoders=(("t5", 100 * MIB),))
    # With a small encoder the decode is the largest phase: whole decode costs more.
    assert plan_budget(off, 200 * GIB).minimum > plan_budget(small, 200 * GIB).minimum
    on = dataclasses.replace(INPUTS, vae_tiling="on")
    assert plan_budget(on, 200 * GIB).decode_tiled
    assert plan_budget(on, 200 * GIB).minimum == auto
    untileable = dataclasses.replace(small, decode_tiled=None)
    assert not plan_budget(untileable, 200 * GIB).decode_tiled


def test_encoders_that_may_not_park_are_held_in_the_minimum() -> None:
    resident = dataclasses.replace(INPUTS, parkable=False)
    plan = plan_budget(resident, plan_budget(resident, 200 * GIB).minimum)
    assert plan.encoders_resident and plan.held["encoders"] == 9 * GIB + 235 * MIB
    assert plan.phases["encode"] == 400 * MIB


def test_auto_budget_is_named_in_the_refusal() -> None:
    with pytest.raises(BudgetError, match="the free HBM of the device"):
        plan_budget(INPUTS, GIB, auto=True)


def test_decode_batch_counts_same_shape_requests_per_call() -> None:
    # Whole decodes while k of them fit the room; tiled and sliced when one does not.
    assert decode_batch(10 * GIB, rows=1, whole_per_row=3 * GIB, tiled_per_row=GIB,
                        tiling="auto", limit=8) == (3, False)
    assert decode_batch(2 * GIB, rows=1, whole_per_row=3 * GIB, tiled_per_row=GIB,
                        tiling="auto", limit=8) == (8, True)
    assert decode_batch(2 * GIB, rows=1, whole_per_row=3 * GIB, tiled_per_row=GIB,
                        tiling="off", limit=8) == (1, False)
    assert decode_batch(10 * GIB, rows=2, whole_per_row=3 * GIB, tiled_per_row=None,
                        tiling="auto", limit=1) == (1, False)


def test_a_streamable_encoder_streams_when_that_lowers_the_minimum() -> None:
    # T5-XXL streamed: its embedding (263 MB) and two slots of its 386 MB layers stay on the
    # device instead of all 9 GiB visiting for each encode.
    streaming = dataclasses.replace(INPUTS, streamable=(("text_encoder_2", 1035 * MIB),))
    parked_minimum = plan_budget(INPUTS, 200 * GIB).minimum
    with pytest.raises(BudgetError, match="encoders text_encoder parked, text_encoder_2 streamed"):
        plan_budget(streaming, 4 * GIB)
    plan = plan_budget(streaming, plan_budget(streaming, 200 * GIB).minimum)
    assert plan.encoders == {"text_encoder": PARKED, "text_encoder_2": STREAMED}
    assert plan.minimum < parked_minimum / 2  # 6.0 against 12.8 GiB
    assert plan.held["encoders"] == 1035 * MIB and fits(plan)
    assert plan.phases["encode"] == 400 * MIB + 235 * MIB  # CLIP still visits, parked
    assert plan.to_json()["encoders"] == "text_encoder parked, text_encoder_2 streamed"


def test_without_a_budget_the_lowest_peak_placement_streams_large_encoders() -> None:
    # T5-XXL streamed holds 2 x 386 MB + its 263 MB embedding; CLIP-L parked visits whole
    # (235 MB beside a 400 MB encode pass stays under the 2 GiB denoise phase: free).
    flux = dataclasses.replace(INPUTS, streamable=(("text_encoder", 150 * MIB),
                                                   ("text_encoder_2", 2 * 386 * MIB + 263 * MIB)))
    assert least_encoders(flux, tiled=True) == {"text_encoder": "parked",
                                                "text_encoder_2": "streamed"}
    # Nothing streamable: parked.
    assert set(least_encoders(INPUTS, tiled=True).values()) == {"parked"}
    # Encoders that may not leave the device (--dlo-components dit) stay resident.
    pinned = dataclasses.replace(flux, parkable=False)
    assert set(least_encoders(pinned, tiled=True).values()) == {"resident"}


def test_decoded_slot_regions_are_held_with_the_slots() -> None:
    # --dlo-dequant slot: each slot also holds the largest block's dequantized weights.
    extra = 640 * MIB
    slotted = dataclasses.replace(INPUTS, slot_extra=extra)
    minimum = plan_budget(INPUTS, 200 * GIB).minimum
    plan = plan_budget(slotted, 200 * GIB)
    assert plan.minimum - minimum >= 2 * extra - 2 * MIB  # the slack grows with the peak
    streamed = plan_budget(slotted, plan.minimum)
    assert streamed.held["dit slots"] == 2 * (680 * MIB + extra)
    assert fits(streamed)
    with pytest.raises(BudgetError):
        plan_budget(slotted, minimum)
    # Every budget above the minimum still fits, blocks bought as the budget grows.
    for budget in range(plan.minimum, 40 * GIB, 2 * GIB):
        assert fits(plan_budget(slotted, budget)), budget
