"""Ports for the servers the tests start (`ditserve serve`, redis-server, the operator's probe).

``free_port`` of the engine picks them below the ephemeral range (where no outgoing connection
or gloo listener of a parallel test can take one before the server binds it); each xdist
worker keeps to a block of its own, so two workers never pick the same port at once.
"""

from __future__ import annotations

import os

from ditserve.engine.distributed import ports


def _worker_index() -> int:
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(name[2:]) if name[:2] == "gw" and name[2:].isdigit() else 0


def free_port() -> int:
    """A port of 127.0.0.1 nothing listens on, from this test worker's block."""
    return ports.free_port(block=_worker_index())
