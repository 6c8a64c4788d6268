"""Free ports for servers a caller is about to start (benchmarks' and tests' own servers).

Kept apart from ``rendezvous`` so that a benchmark driving servers picks ports without
importing torch.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

PORTS_FROM = 20000  # free_port's ports start here, below any usual ephemeral range


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(block: int | None = None, block_size: int = 1000) -> int:
    """A port of 127.0.0.1 nothing listens on now, for a server the caller starts next (a
    benchmark's or a test's). Where the caller starts the listener itself,
    ``rendezvous.host_store`` leaves no window at all.

    Ports come from below the kernel's ephemeral range where there is room: a port found by
    binding port 0 is one every outgoing connection (and every gloo listener) may be given
    too, in the seconds before the server binds it. block: keep to the block-th run of
    ``block_size`` ports from ``PORTS_FROM`` (callers running side by side, e.g. test workers,
    each take their own)."""
    top = _ephemeral_low()
    blocks = (top - PORTS_FROM) // block_size
    if blocks > 0:
        low, high = PORTS_FROM, top
        if block is not None:
            low = PORTS_FROM + (block % blocks) * block_size
            high = low + block_size
        for port in random.sample(range(low, high), high - low):
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no room: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
