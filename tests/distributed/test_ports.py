"""Free ports for servers the benchmarks and tests start: below the ephemeral range, by block."""

from __future__ import annotations

import socket

import pytest

from ditserve.engine.distributed import ports


def test_ports_come_from_below_the_ephemeral_range_in_the_block_asked_for(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 32768)
    for block in (0, 3, 12):
        port = ports.free_port(block=block)
        low = ports.PORTS_FROM + (block % 12) * 1000  # 12 blocks of 1000 fit below 32768
        assert low <= port < low + 1000
    assert ports.PORTS_FROM <= ports.free_port() < 32768


def test_a_port_something_listens_on_is_never_given(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        held = taken.getsockname()[1]
        # a "block" of one port, the one held: nothing to give there but the kernel's pick
        monkeypatch.setattr(ports, "PORTS_FROM", held)
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: held + 1)
        port = ports.free_port(block_size=1)
        assert port != held


@pytest.mark.parametrize("low", [1024, 20500])
def test_without_room_below_the_range_the_kernel_picks(monkeypatch, low: int) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: low)
    port = ports.free_port(block=2)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # free: it binds
