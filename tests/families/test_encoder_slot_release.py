"""Streamed text encoders give their device slots back between passes
(``enable_offload(release_slots=True)``, ``engine.offload.movement.slot_release``): outputs stay
bit-identical, the slot storages are empty between passes and held during them, and the
planner counts released slots in the encode phase only (``budget_plan.streamed_slots``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import pytest
import torch
from offload.test_offload_generic import ToyDiT  # type: ignore[import-not-found]
from torch import nn

from ditserve.engine.config import OffloadConfig, ParallelConfig, ResolvedOffload
from ditserve.engine.errors import OffloadError
from ditserve.engine.makers.builders import build_tiny
from ditserve.engine.offload import OffloadHandle, enable_offload
from ditserve.engine.offload.movement.copy_stream import SyncTransfer
from ditserve.engine.offload.movement.slot_release import SlotRelease
from ditserve.engine.placement.budget_plan import (
    GIB,
    MIB,
    PARKED,
    STREAMED,
    BudgetInputs,
    plan_budget,
)
from ditserve.engine.placement.encoder_streaming import StreamedEncoders
from ditserve.engine.placement.memory_estimates import (
    streamed_encoder_bytes,
    streamed_encoder_slot_bytes,
)

DLO = OffloadConfig(enabled=True)


def slot_storage_bytes(handle: OffloadHandle) -> list[int]:
    """The bytes each slot buffer's storage holds now (0: given back)."""
    return [t.untyped_storage().nbytes() for slot in handle.probe().block_slots
            for t in slot.values()]


class OrderingTransfer(SyncTransfer):
    """A CPU transfer that records its waits and releases with the slots' storage bytes."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        super().__init__(torch.device("cpu"))
        self.buffers = buffers
        self.calls: list[tuple[str, int, int]] = []

    def wait_ready(self, slot: int) -> None:
        self.calls.append(("wait_ready", slot, self.buffers[slot].untyped_storage().nbytes()))

    def release(self, slot: int) -> None:
        self.calls.append(("release", slot, self.buffers[slot].untyped_storage().nbytes()))


def test_views_into_a_slot_stay_valid_across_release_and_restore() -> None:
    slots: list[dict[Hashable, torch.Tensor]] = [
        {torch.float32: torch.zeros(64), torch.float64: torch.zeros(8, dtype=torch.float64)}
        for _ in range(2)]
    weight = nn.Parameter(torch.empty(0))
    weight.data = slots[1][torch.float32][16:48].view(4, 8)  # as the hooks point a block
    transfer = OrderingTransfer([slot[torch.float32] for slot in slots])
    release = SlotRelease(slots, transfer)
    assert release.allocated and release.nbytes == 2 * (64 * 4 + 8 * 8)

    release.release()
    release.release()  # idempotent
    assert not release.allocated and release.releases == 1
    assert all(t.untyped_storage().nbytes() == 0 for s in slots for t in s.values())
    # Every slot's last load was waited for while its memory was still held.
    assert transfer.calls == [("wait_ready", 0, 256), ("wait_ready", 1, 256)]

    transfer.calls.clear()
    release.restore()
    release.restore()  # idempotent
    assert release.allocated
    assert [t.untyped_storage().nbytes() for s in slots for t in s.values()] == [256, 64] * 2
    # Loads into the restored slots are ordered after the compute queued so far.
    assert transfer.calls == [("release", 0, 256), ("release", 1, 256)]
    # Same storage object: the Parameter's view reads what lands in the slot now.
    slots[1][torch.float32].copy_(torch.arange(64, dtype=torch.float32))
    assert torch.equal(weight, torch.arange(16, 48, dtype=torch.float32).view(4, 8))
    assert weight.untyped_storage().data_ptr() == slots[1][torch.float32].data_ptr()


def test_released_slots_give_identical_outputs_and_are_empty_between_passes() -> None:
    x = torch.randn(3, 8)
    outputs = {}
    for release in (False, True):
        model = ToyDiT().eval()  # seeded: the same weights both times
        handle = enable_offload(model, DLO, device="cpu", release_slots=release)
        seen: list[tuple[bool, list[int]]] = []
        model.blocks[2].register_forward_hook(
            lambda *_, h=handle, seen=seen: seen.append((h.report()["slots_allocated"],
                                                         slot_storage_bytes(h))))
        try:
            report = handle.report()
            assert report["slots_released_between_passes"] is release
            # Released from enable on: nothing held before the first pass either.
            assert report["slots_allocated"] is not release
            got = []
            for _ in range(4):
                with torch.inference_mode():
                    got.append(model(x))
                between = slot_storage_bytes(handle)
                assert all(n == 0 for n in between) if release else all(n > 0 for n in between)
                assert handle.report()["slots_allocated"] is not release
            # During each pass the slots were held, at their full size.
            assert len(seen) == 4
            assert all(held and all(n > 0 for n in sizes) for held, sizes in seen)
            outputs[release] = got
            if release:  # every pass starts cold: one miss each, nothing prefetched across
                assert handle.report()["load_misses"] == 4
                assert handle.report()["block_loads"] == 4 * 5
        finally:
            handle.disable()
    for kept, released in zip(outputs[False], outputs[True], strict=True):
        assert torch.equal(kept, released)


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h


class Headed(nn.Module):
    """An encoder whose pipeline calls ``.model`` and never its head (FLUX.2's Mistral3)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.model = Inner()
        self.lm_head = nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(ids))


def test_a_pass_through_the_inner_model_gives_the_slots_back() -> None:
    encoder = Headed().eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        expected = encoder.model(ids)
    handle = enable_offload(encoder, DLO, device="cpu", release_slots=True)
    try:
        for passes in range(1, 4):
            with torch.inference_mode():
                assert torch.equal(encoder.model(ids), expected)
            assert handle.passes == passes
            assert not handle.report()["slots_allocated"]
        with torch.inference_mode():  # the whole model: one pass, not two
            encoder(ids)
        assert handle.passes == 4 and not handle.report()["slots_allocated"]
    finally:
        handle.disable()


def test_streamed_encoders_release_their_slots_and_say_so() -> None:
    pipe = build_tiny("flux2", seed=0)
    encoder = pipe.text_encoder.eval()
    ids = torch.randint(0, int(encoder.get_input_embeddings().num_embeddings), (2, 9),
                        generator=torch.Generator().manual_seed(1))

    def hidden() -> torch.Tensor:
        with torch.inference_mode():  # what FLUX.2 calls: the model without its head
            out = encoder.model(input_ids=ids, attention_mask=torch.ones_like(ids),
                                output_hidden_states=True)
        return torch.stack([h.clone() for h in out.hidden_states])

    resident = hidden()
    offload = ResolvedOffload.of(DLO, parallel=ParallelConfig())
    streamed = StreamedEncoders({"text_encoder": encoder}, device=torch.device("cpu"),
                                offload=offload, vision=True)
    try:
        facts = streamed["text_encoder"]
        report = facts.handle.report()
        assert report["slots_released_between_passes"]
        assert facts.slot_bytes == report["slots"] * report["slot_bytes"] > 0
        assert facts.slot_bytes < facts.device_bytes  # its norms stay on the device
        assert "given back between encodes" in facts.lives()
        # The planner's estimate is the runtime's slots, to the byte.
        assert streamed_encoder_slot_bytes(encoder) == facts.slot_bytes
        for _ in range(2):
            assert torch.equal(hidden(), resident)
            assert not facts.handle.report()["slots_allocated"]
    finally:
        streamed.close()


def test_a_group_is_refused_with_released_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    import ditserve.engine.offload.backend as backend

    # A group of two without processes behind it: the request is refused before it is used.
    monkeypatch.setattr(backend, "_group_size", lambda group: 2)
    model = ToyDiT()
    with pytest.raises(OffloadError, match="drop release_slots or the group"):
        enable_offload(model, DLO, device="cpu", group=object(), release_slots=True)
    assert all(p.device.type == "cpu" and p.numel() for p in model.parameters())  # untouched


# Flux-like shapes (tests/engine/test_budget_plan.py's): T5-XXL streamed holds its 263 MB of
# modules outside the layers and two 386 MB layer slots; CLIP-L parks.
T5_SLOTS = 2 * 386 * MIB
INPUTS = BudgetInputs(
    dit_fixed=120 * MIB, dit_blocks=(680 * MIB,) * 19 + (283 * MIB,) * 38, slots=2,
    encoders=(("text_encoder", 235 * MIB), ("text_encoder_2", 9 * GIB)), parkable=True,
    encode_activations=400 * MIB, vae=160 * MIB, decode_whole=3 * GIB,
    decode_tiled=700 * MIB, denoise_activations=2 * GIB, prompt_cache=GIB,
    streamable=(("text_encoder_2", 263 * MIB + T5_SLOTS),))


def test_released_slots_count_in_the_encode_phase_only() -> None:
    released = dataclasses.replace(INPUTS, streamed_slots=(("text_encoder_2", T5_SLOTS),))
    kept = plan_budget(INPUTS, 200 * GIB)
    given = plan_budget(released, 200 * GIB)
    # Under a large budget both keep every encoder resident: no slots anywhere.
    assert kept.encoders_resident and given.encoders_resident
    assert given.predicted_peak == kept.predicted_peak
    least = plan_budget(released, given.minimum)
    assert least.encoders == {"text_encoder": PARKED, "text_encoder_2": STREAMED}
    assert least.held["encoders"] == 263 * MIB  # not the slots
    assert least.phases["encode"] == 400 * MIB + 235 * MIB + T5_SLOTS  # CLIP visits; T5's slots
    assert least.phases["denoise"] == 2 * GIB and least.phases["decode"] <= 3 * GIB
    # The denoise phase is the largest: the minimum drops by the slots.
    assert kept.minimum - given.minimum >= T5_SLOTS - 2 * MIB  # the slack shrinks with it
    holding = plan_budget(INPUTS, kept.minimum)
    assert holding.held["encoders"] == 263 * MIB + T5_SLOTS
    assert holding.phases["encode"] == 400 * MIB + 235 * MIB


def test_a_parked_encoders_slots_are_not_counted() -> None:
    # Streaming slots that cost more than the encoder is worth parking: it parks, and its
    # slots appear nowhere (held or encode phase).
    small = dataclasses.replace(
        INPUTS, encoders=(("text_encoder", 235 * MIB), ("text_encoder_2", 300 * MIB)),
        streamable=(("text_encoder_2", 2 * GIB),), streamed_slots=(("text_encoder_2", GIB),),
        parkable=True)
    plan = plan_budget(small, plan_budget(small, 200 * GIB).minimum)
    assert plan.encoders["text_encoder_2"] == PARKED
    assert plan.held["encoders"] == 0
    assert plan.phases["encode"] == 400 * MIB + 235 * MIB + 300 * MIB


def test_the_estimate_splits_an_encoders_device_bytes() -> None:
    pipe = build_tiny("flux", seed=0)
    for name in ("text_encoder", "text_encoder_2"):
        encoder = getattr(pipe, name)
        held, slots = streamed_encoder_bytes(encoder), streamed_encoder_slot_bytes(encoder)
        assert held is not None and slots is not None and 0 < slots < held
