"""Registration planning and the all-or-nothing sequence, against a fake registrar."""

from __future__ import annotations

import pytest
import torch

from ditserve.engine.config import OffloadConfig
from ditserve.engine.errors import OffloadError
from ditserve.engine.offload.host.mapped import MappedBacking
from ditserve.engine.offload.host.memory import PageableMemory
from ditserve.engine.offload.host.registration import (
    HostRange,
    RegistrationRefused,
    SourceRange,
    plan_ranges,
    register_ranges,
)
from ditserve.engine.offload.movement.copy_stream import SyncTransfer
from ditserve.engine.offload.movement.mapped import make_mapped_transfer
from ditserve.engine.weights.backing_choice import checkpoint_dit
from ditserve.engine.weights.loader import DIT_COMPONENT, dit_class

P = 4096


class FakeRegistrar:
    """Records every call; refuses the ``fail_at``-th register (0-based) or any unregister."""

    def __init__(self, fail_at: int | None = None, fail_unregister: bool = False,
                 journal: list[tuple[str, int]] | None = None) -> None:
        self.calls: list[tuple[str, int]] = journal if journal is not None else []
        self.fail_at = fail_at
        self.fail_unregister = fail_unregister
        self.registered = 0

    def register(self, address: int, nbytes: int) -> None:
        if self.registered == self.fail_at:
            self.calls.append(("refused", address))
            raise RegistrationRefused("injected failure")
        self.registered += 1
        self.calls.append(("register", address))

    def unregister(self, address: int) -> None:
        if self.fail_unregister:
            raise RegistrationRefused("injected unregister failure")
        self.calls.append(("unregister", address))


def test_ranges_are_grouped_by_file_page_aligned_and_coalesced() -> None:
    ranges = plan_ranges([
        SourceRange("b", 100, 10),  # inside page 0 of b
        SourceRange("a", P + 8, 2 * P),  # pages 1..3 of a
        SourceRange("a", 10 * P, P),  # page 10, apart
        SourceRange("a", 3 * P + 1, 10),  # overlaps the end of the first a range
        SourceRange("a", 4 * P, 100),  # touches: coalesced
        SourceRange("a", 0, 0),  # empty: ignored
    ])
    assert ranges == [HostRange("a", P, 4 * P), HostRange("a", 10 * P, P), HostRange("b", 0, P)]
    assert all(r.start % P == 0 and r.nbytes % P == 0 for r in ranges)


def three_ranges() -> list[HostRange]:
    return [HostRange("a", 0, P), HostRange("a", 4 * P, P), HostRange("b", 0, 2 * P)]


ADDRESSES = {"a": 1 << 20, "b": 1 << 24}


def test_budget_is_checked_before_any_registration() -> None:
    fake = FakeRegistrar()
    with pytest.raises(RegistrationRefused, match="exceeds the pin limit"):
        register_ranges(three_ranges(), addresses=ADDRESSES, budget_bytes=4 * P - 1,
                        registrar=fake)
    assert fake.calls == []


def test_success_registers_every_range_in_order() -> None:
    fake = FakeRegistrar()
    reg = register_ranges(three_ranges(), addresses=ADDRESSES, budget_bytes=4 * P,
                          registrar=fake)
    assert [c for c, _ in fake.calls] == ["register"] * 3
    assert [a for _, a in fake.calls] == [1 << 20, (1 << 20) + 4 * P, 1 << 24]
    assert reg.nbytes == 4 * P
    reg.unregister_all()
    assert [a for c, a in fake.calls if c == "unregister"] == [1 << 24, (1 << 20) + 4 * P, 1 << 20]


def test_a_refused_range_rolls_back_the_registered_ones_newest_first() -> None:
    fake = FakeRegistrar(fail_at=2)
    with pytest.raises(RegistrationRefused, match="injected failure"):
        register_ranges(three_ranges(), addresses=ADDRESSES, budget_bytes=1 << 30,
                        registrar=fake)
    assert fake.calls == [("register", 1 << 20), ("register", (1 << 20) + 4 * P),
                          ("refused", 1 << 24),
                          ("unregister", (1 << 20) + 4 * P), ("unregister", 1 << 20)]


def test_failed_verification_rolls_back_everything() -> None:
    fake = FakeRegistrar()
    with pytest.raises(RegistrationRefused, match="do not report pinned"):
        register_ranges(three_ranges(), addresses=ADDRESSES, budget_bytes=1 << 30,
                        registrar=fake, verify=lambda: "2 of 9 source tensors do not report pinned")
    assert [c for c, _ in fake.calls] == ["register"] * 3 + ["unregister"] * 3


def test_a_failed_rollback_aborts_startup() -> None:
    fake = FakeRegistrar(fail_at=1, fail_unregister=True)
    with pytest.raises(OffloadError, match="restart the process"):
        register_ranges(three_ranges(), addresses=ADDRESSES, budget_bytes=1 << 30,
                        registrar=fake)


@pytest.fixture()
def mapped(tiny_model_dir):  # type: ignore[no-untyped-def]
    """A checkpoint-mapped tiny DiT, its plan's storage (all blocks added), and the plan."""
    from ditserve.engine.offload.discovery import discover
    from ditserve.engine.offload.plan import TensorSpec, build_plan

    model, plan = checkpoint_dit(tiny_model_dir, dtype="float32", model_cls=dit_class(),
                                 component=DIT_COMPONENT)
    assert model is not None
    blocks = discover(model).blocks
    specs = [(n, [TensorSpec(tn, t.dtype, t.element_size(), tuple(t.shape))
                  for tn, t in list(m.named_parameters()) + list(m.named_buffers())])
             for n, m in blocks]
    layout = build_plan(specs, resident_layers=0, hbm_budget_bytes=None,
                        resident_module_bytes=0, activation_reserve_bytes=0)
    storage = MappedBacking(plan)
    for index, (_, m) in enumerate(blocks):
        storage.add(layout.blocks[index], [t for _, t in list(m.named_parameters())])
    return storage, layout, plan


def test_registered_path_with_fake_registrar_then_teardown_order(mapped) -> None:  # type: ignore[no-untyped-def]
    storage, layout, plan = mapped
    journal: list[tuple[str, int]] = []
    fake = FakeRegistrar(journal=journal)
    closed = plan.close

    def close_and_record() -> None:
        journal.append(("close-mappings", 0))
        closed()

    plan.close = close_and_record  # type: ignore[method-assign]
    transfer = make_mapped_transfer(SyncTransfer(torch.device("cpu")), storage, layout.slot,
                                    pin_limit_gib=1.0, memory=PageableMemory(), registrar=fake,
                                    verify=lambda: None)
    held = storage.report().mapped
    assert held is not None
    assert transfer.report().path == "registered" and held.fallback_reason is None
    # Keys sort by name in the file: the resident time_text_embed.* tensors lie between the
    # two block lists, so the streamed tensors form two page-aligned runs.
    assert held.registered_ranges == 2
    assert held.registered_bytes >= storage.nbytes
    assert held.registered_bytes % 4096 == 0
    # A direct load puts every tensor where the slot layout says.
    slot = {dt: torch.zeros(n, dtype=dt) for dt, _, n in layout.slot.regions}  # type: ignore[call-overload]
    block = layout.blocks[0]
    regions = storage.regions(0)
    transfer.load(transfer.prepare([(slot[r.dtype][: r.numel], regions[r.dtype])
                                    for r in block.regions], 0), 0)
    for p, view in zip(block.tensors, storage.tensor_views(0), strict=True):
        assert torch.equal(slot[p.dtype][p.offset : p.offset + p.numel].view(p.shape), view)
    transfer.close()  # the handle's teardown order: the transfer, then the backing
    storage.close()
    assert [c for c, _ in journal] == ["register"] * 2 + ["unregister"] * 2 + ["close-mappings"]


def test_refused_registration_keeps_staging_with_the_reason(mapped) -> None:  # type: ignore[no-untyped-def]
    storage, layout, plan = mapped
    fake = FakeRegistrar(fail_at=0)
    transfer = make_mapped_transfer(SyncTransfer(torch.device("cpu")), storage, layout.slot,
                                    pin_limit_gib=1.0, memory=PageableMemory(), registrar=fake)
    assert transfer.report().path == "staging"
    assert storage.fallback_reason == "registration refused: injected failure"
    assert transfer.report().pinned_bytes + storage.report().pinned_bytes == 0
    transfer.close()
    storage.close()


def test_budget_too_small_keeps_staging_without_touching_the_registrar(mapped) -> None:  # type: ignore[no-untyped-def]
    storage, layout, _ = mapped
    fake = FakeRegistrar()
    transfer = make_mapped_transfer(SyncTransfer(torch.device("cpu")), storage, layout.slot,
                                    pin_limit_gib=1e-9, memory=PageableMemory(), registrar=fake)
    assert transfer.report().path == "staging"
    assert "exceeds the pin limit" in str(storage.fallback_reason)
    assert fake.calls == []
    transfer.close()
    storage.close()


def test_offload_config_accepts_pin_limit_only_with_a_plan() -> None:
    from ditserve.engine.offload import enable_offload

    with pytest.raises(OffloadError, match="HostWeightPlan"):
        enable_offload(torch.nn.Linear(2, 2), OffloadConfig(enabled=True, pin_limit_gib=1.0), "cpu")
