"""Ports for the servers the tests start (`ditserve serve`, redis-server, the operator's probe).

A port found by binding port 0 comes from the kernel's ephemeral range, the range every
outgoing connection and every gloo listener also draws from: with test files running in
parallel, a port chosen and let go could be taken by one of those before the server binds
it. These come from below the ephemeral range instead, a block of their own per xdist worker,
so only a listener still running can hold one - and the bind check skips those.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

BASE = 20000
BLOCK = 1000


def _worker_index() -> int:
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(name[2:]) if name[:2] == "gw" and name[2:].isdigit() else 0


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A port of 127.0.0.1 nothing listens on, outside the ephemeral range where it can be."""
    blocks = max(1, (_ephemeral_low() - BASE) // BLOCK)
    low = BASE + (_worker_index() % blocks) * BLOCK
    if low + BLOCK <= _ephemeral_low():
        for port in random.sample(range(low, low + BLOCK), BLOCK):
            if _bindable(port):
                return port
    with socket.socket() as sock:  # an unusual port range: the kernel's choice
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
