"""CopyClock on faked CUDA events: spans are harvested in stream order without waiting, the
achieved rate is bytes over copy time, events are reused, and the report appears in the
offload report only where copies are timed (CUDA paths; not the CPU path)."""

from __future__ import annotations

from typing import Any

import torch

from ditserve.engine.offload.movement.copy_clock import CopyClock
from ditserve.engine.offload.movement.copy_stream import SyncTransfer


class FakeStream:
    """A stream whose clock the test moves; events record the time they are reached."""

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.done_until = -1.0  # events recorded at or before this time have completed


class FakeEvent:
    created = 0

    def __init__(self) -> None:
        FakeEvent.created += 1
        self.stream: FakeStream | None = None
        self.at = 0.0

    def record(self, stream: FakeStream) -> None:
        self.stream, self.at = stream, stream.now_ms

    def query(self) -> bool:
        assert self.stream is not None
        return self.at <= self.stream.done_until

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "timing an event that has not completed"
        return end.at - self.at


def copy(clock: CopyClock, stream: FakeStream, ms: float, nbytes: int) -> None:
    started = clock.start(stream)
    stream.now_ms += ms
    clock.stop(stream, started, nbytes)


def test_rate_is_bytes_over_copy_time_and_only_finished_spans_count() -> None:
    stream, clock = FakeStream(), CopyClock(make_event=FakeEvent)
    assert clock.report()["h2d_gbps"] is None  # nothing timed yet
    copy(clock, stream, 10.0, 550_000_000)  # 55 GB/s
    stream.now_ms += 5.0  # the copy stream waits for a free slot: not copy time
    copy(clock, stream, 20.0, 500_000_000)  # 25 GB/s, still running
    stream.done_until = 10.0  # only the first span finished
    report = clock.report()
    assert report["h2d_timed_bytes"] == 550_000_000
    assert report["h2d_gbps"] == 55.0 and report["h2d_gbps_recent"] == 55.0
    stream.done_until = stream.now_ms
    report = clock.report()
    assert report["h2d_timed_bytes"] == 1_050_000_000
    assert report["h2d_copy_seconds"] == 0.03  # the 5 ms wait is left out
    assert report["h2d_gbps"] == 35.0


def test_harvest_stops_at_the_first_unfinished_span() -> None:
    stream, clock = FakeStream(), CopyClock(make_event=FakeEvent)
    for _ in range(3):
        copy(clock, stream, 1.0, 1_000_000)
    stream.done_until = 1.5  # the second span (1..2 ms) is still running
    assert clock.report()["h2d_timed_bytes"] == 1_000_000


def test_recent_rate_covers_the_last_window_of_loads() -> None:
    stream, clock = FakeStream(), CopyClock(window=2, make_event=FakeEvent)
    copy(clock, stream, 10.0, 100_000_000)  # 10 GB/s, falls out of the window
    copy(clock, stream, 10.0, 500_000_000)  # 50 GB/s
    copy(clock, stream, 10.0, 500_000_000)  # 50 GB/s
    stream.done_until = stream.now_ms
    report = clock.report()
    assert report["h2d_gbps_recent"] == 50.0
    assert report["h2d_gbps"] == round(1_100_000_000 / 30.0 / 1e6, 2)


def test_events_of_harvested_spans_are_reused() -> None:
    stream, clock = FakeStream(), CopyClock(make_event=FakeEvent)
    FakeEvent.created = 0
    for _ in range(100):
        copy(clock, stream, 1.0, 1)
        stream.done_until = stream.now_ms  # every span finishes before the next load
    # Each stop harvests its own span, so one pair of events (plus the pair in flight) serves
    # every load instead of 200 new events.
    assert FakeEvent.created <= 4


def test_cpu_path_reports_no_rate() -> None:
    assert SyncTransfer(torch.device("cpu")).clock is None


def test_offload_report_carries_the_rate_where_copies_are_timed() -> None:
    from ditserve.engine.offload.movement.transfer import TransferReport

    timed = CopyClock(make_event=FakeEvent).rate()
    report = offload_report(TransferReport("cuda-copy-stream", "private-slabs", copy_rate=timed))
    assert {k for k in report if k.startswith("h2d_")} == {
        "h2d_timed_bytes", "h2d_copy_seconds", "h2d_gbps", "h2d_gbps_recent"}
    cpu = offload_report(SyncTransfer(torch.device("cpu")).report())
    assert {k for k in cpu if k.startswith("h2d_")} == set()


def offload_report(transfer: Any) -> dict[str, Any]:
    """The JSON offload report of a one-block plan moved by ``transfer``."""
    from ditserve.engine.offload.host.backing import BackingReport
    from ditserve.engine.offload.report import OffloadReport, Traffic

    return OffloadReport(
        active=True, device="cpu", blocks=1, streamed_blocks=1, resident_block_names=(),
        residency="none", hbm_budget_bytes=None, activation_reserve_bytes=None,
        streamed_bytes=256, resident_block_bytes=0, resident_module_bytes=0, slot_bytes=256,
        slots=2, host=BackingReport("pageable", 256, 0), transfer=transfer,
        traffic=Traffic(0, 0, 0),
    ).to_json()
