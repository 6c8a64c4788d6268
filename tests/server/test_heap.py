"""The serving process's collector: startup's objects frozen out of its scans once the engine is
ready, thawed on stop; collections timed, and the long ones logged at DEBUG."""

from __future__ import annotations

import gc
import logging
import re
from collections.abc import Iterator

import httpx
import pytest
from server.conftest import ServerProcess

from ditserve.engine.server.heap import GcPauses, freeze_startup_heap, thaw_heap


@pytest.fixture
def thawed() -> Iterator[None]:
    thaw_heap()
    yield
    thaw_heap()  # this test process starts engines after this one: nothing stays frozen


def test_freezing_moves_the_live_heap_out_of_collections_and_thawing_gives_it_back(
        thawed: None) -> None:
    assert gc.get_freeze_count() == 0
    frozen = freeze_startup_heap()
    # torch and the test's own modules at least (threads of earlier tests may free a few
    # frozen objects meanwhile: the count only falls)
    assert frozen >= gc.get_freeze_count() > 1000
    thaw_heap()
    assert gc.get_freeze_count() == 0


def test_every_collection_is_timed_and_a_long_one_logged_at_debug(
        caplog: pytest.LogCaptureFixture) -> None:
    ticks = iter(float(i) for i in range(100))  # each pass seems to take a second
    pauses = GcPauses(clock=lambda: next(ticks), logged_s=0.5).install()
    try:
        with caplog.at_level(logging.DEBUG, logger="ditserve.engine.server.heap"):
            gc.collect(2)
    finally:
        pauses.remove()
    assert pauses.collections[2] == 1 and pauses.seconds[2] == 1.0
    messages = [r.getMessage() for r in caplog.records]
    assert any(re.fullmatch(r"garbage collection of generation 2 took 1000\.0 ms "
                            r"\(\d+ collected, \d+ objects frozen out of its scans\)", m)
               for m in messages), messages
    before = list(pauses.collections)
    gc.collect(2)  # removed: no longer counted
    assert pauses.collections == before


def test_short_collections_are_counted_but_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    pauses = GcPauses(logged_s=3600.0).install()
    try:
        with caplog.at_level(logging.DEBUG, logger="ditserve.engine.server.heap"):
            gc.collect(0)
    finally:
        pauses.remove()
    assert pauses.collections[0] == 1 and not caplog.records


def test_a_ready_server_has_frozen_its_startup_heap(server: ServerProcess) -> None:
    server.wait_ready()
    match = re.search(r"froze (\d+) objects of the startup heap", server.log_text())
    assert match is not None and int(match.group(1)) > 10_000, server.log_text()[-2000:]


def test_totals_are_copies_of_the_counts_per_generation() -> None:
    ticks = iter(float(i) for i in range(100))
    pauses = GcPauses(clock=lambda: next(ticks)).install()
    try:
        gc.collect(1)
    finally:
        pauses.remove()
    seconds, passes = pauses.totals()
    assert (seconds, passes) == ([0.0, 1.0, 0.0], [0, 1, 0])
    seconds[1] = 9.0  # the caller's copy
    assert pauses.seconds[1] == 1.0


def test_the_server_exports_its_collections_by_generation(server: ServerProcess,
                                                          metric) -> None:  # type: ignore[no-untyped-def]
    server.wait_ready()
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    # The freeze's own full collection ran after the collector was installed.
    assert metric(text, 'ditserve:gc_collections_total{generation="2"}') >= 1
    assert metric(text, 'ditserve:gc_pause_seconds_total{generation="2"}') > 0
    assert metric(text, 'ditserve:gc_collections_total{generation="0"}') >= 0
