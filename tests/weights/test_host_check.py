"""The host-memory check of a load under offload (engine/weights/host_check.py), through
``load_weights`` on the tiny model, with the host's facts replaced by fakes: a checkpoint on
tmpfs is mapped with an automatic pin limit instead of copied (it was copied before: issue
46's OOM), and a load that does not fit is refused before anything is read."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from ditserve.engine.config import OffloadConfig
from ditserve.engine.errors import HostMemoryError
from ditserve.engine.offload.host.weight_plan import BackingKind, HostWeightPlan
from ditserve.engine.runner.assembly import with_auto_pin_limit
from ditserve.engine.weights import host_check, loader
from ditserve.engine.weights.host_fit import GIB, HostMemory
from ditserve.engine.weights.load import load_weights


def fake_host(monkeypatch: pytest.MonkeyPatch, model_dir: Path, *, fstype: str,
              available: int) -> None:
    """Every file of ``model_dir`` on a ``fstype`` mount; ``available`` bytes free."""
    dev = os.stat((model_dir / "transformer").resolve()).st_dev
    mounts = f"25 24 {os.major(dev)}:{os.minor(dev)} / /m rw - {fstype} {fstype} rw\n"
    monkeypatch.setattr(host_check, "read_mountinfo", lambda: mounts)
    monkeypatch.setattr(host_check, "read_host_memory", lambda: HostMemory(available))
    monkeypatch.delenv(host_check.CHECK_ENV, raising=False)


def test_a_tmpfs_checkpoint_streams_registered_from_its_mapping(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_host(monkeypatch, tiny_model_dir, fstype="tmpfs", available=64 * GIB)
    loaded = load_weights(tiny_model_dir, dtype="float32", offload=OffloadConfig(enabled=True),
                          streams_from_mapping=True)
    plan = loaded.host_plan
    assert plan is not None
    try:
        assert plan.kind is BackingKind.CHECKPOINT_MMAP and plan.skipped_materialization
        assert plan.auto_pin_limit_bytes >= plan.coverage.bound_bytes > 0
        assert "tmpfs" in plan.reason
        assert plan.describe()["auto_pin_limit_bytes"] == plan.auto_pin_limit_bytes
    finally:
        plan.close()


def test_a_disk_checkpoint_that_fits_is_still_copied(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_host(monkeypatch, tiny_model_dir, fstype="ext4", available=64 * GIB)
    loaded = load_weights(tiny_model_dir, dtype="float32", offload=OffloadConfig(enabled=True),
                          streams_from_mapping=True)
    assert loaded.host_plan is not None and loaded.host_plan.kind is BackingKind.ORDINARY
    assert "private pinned copy (fits" in loaded.host_plan.reason


def test_a_load_that_does_not_fit_is_refused_before_reading(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_host(monkeypatch, tiny_model_dir, fstype="tmpfs", available=0)

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the refusal comes before any weight is read")

    monkeypatch.setattr(loader, "load_dit", never)
    monkeypatch.setattr(loader, "load_components", never)
    with pytest.raises(HostMemoryError) as refused:
        load_weights(tiny_model_dir, dtype="float32",
                     offload=OffloadConfig(enabled=True, checkpoint_mmap="off",
                                           components="dit"),
                     streams_from_mapping=True)
    message = str(refused.value)
    assert "0.0 MiB is available" in message and "--dlo-checkpoint-mmap auto" in message
    assert host_check.CHECK_ENV in message


def test_warn_mode_logs_the_refusal_and_loads(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    fake_host(monkeypatch, tiny_model_dir, fstype="tmpfs", available=0)
    monkeypatch.setenv(host_check.CHECK_ENV, "warn")
    with caplog.at_level(logging.WARNING, logger=host_check.__name__):
        loaded = load_weights(tiny_model_dir, dtype="float32",
                              offload=OffloadConfig(enabled=True, checkpoint_mmap="off"),
                              streams_from_mapping=True)
    assert loaded.host_plan is not None and loaded.host_plan.kind is BackingKind.ORDINARY
    assert "refusing to start" in caplog.text


def test_the_automatic_pin_limit_reaches_the_offload_options() -> None:
    options = OffloadConfig(enabled=True)
    plain = HostWeightPlan.ordinary("private")
    assert with_auto_pin_limit(options, plain) is options
    assert with_auto_pin_limit(options, None) is options

    class Mapped:
        auto_pin_limit_bytes = 3 * GIB

    auto = with_auto_pin_limit(options, Mapped())  # type: ignore[arg-type]
    assert auto.pin_limit_gib == 3.0
    chosen = OffloadConfig(enabled=True, pin_limit_gib=1.0)
    assert with_auto_pin_limit(chosen, Mapped()).pin_limit_gib == 1.0  # type: ignore[arg-type]


def test_require_room_refuses_a_pinned_copy_that_does_not_fit(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(host_check.CHECK_ENV, raising=False)
    tight = HostMemory(40 * GIB)
    host_check.require_room(30 * GIB, what="pinned encoders", memory=tight)  # 30 + 3.75 fits
    with pytest.raises(HostMemoryError, match=r"pinned encoders would commit 45.0 GiB.*"
                                              r"40.0 GiB is available.*--dlo-components dit"):
        host_check.require_room(45 * GIB, what="pinned encoders", memory=tight,
                                remedies=("--dlo-components dit",))
    monkeypatch.setenv(host_check.CHECK_ENV, "warn")
    with caplog.at_level(logging.WARNING, logger=host_check.__name__):
        host_check.require_room(45 * GIB, what="pinned encoders", memory=tight)
    assert "refusing to start" in caplog.text
    monkeypatch.setenv(host_check.CHECK_ENV, "sometimes")
    with pytest.raises(ValueError, match="refuse, warn, off"):
        host_check.require_room(GIB, what="x", memory=tight)


def test_a_refused_mapping_falls_back_to_a_private_copy_only_if_that_fits(
        tiny_model_dir: Path) -> None:
    from ditserve.engine.weights.backing_choice import prepare_dit
    from ditserve.engine.weights.host_fit import DitBacking, HostFit

    planned = HostFit(dit=DitBacking.MAPPED_REGISTERED, pin_limit_bytes=GIB, auto_pin=True,
                      reason="checkpoint on tmpfs", holdings=(), memory=HostMemory(0),
                      private_fits=False)
    # The tiny checkpoint is float32: served in bfloat16, the preflight refuses the mapping.
    with pytest.raises(HostMemoryError, match="mapping was refused.*dtype"):
        prepare_dit(tiny_model_dir, dtype="bfloat16", offload=OffloadConfig(enabled=True),
                    streams_from_mapping=True, host_fit=planned)


def test_processes_on_this_host_come_from_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert host_check.local_processes() == 1
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert host_check.local_processes() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # 2 of the 4 ranks on this host
    assert host_check.local_processes() == 2
