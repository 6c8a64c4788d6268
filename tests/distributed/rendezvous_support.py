"""A rendezvous for tests that spawn their own ranks, free of port races.

The test process hosts the store (the engine's ``host_store``: bound to a port the OS
picks as it binds) and hands the bound port to the ranks, which join it as clients (a store
object, as the engine's ranks join: see ``rendezvous_store``). Choosing a
free port first and letting rank 0 bind it later raced with parallel test workers and with
gloo's own ephemeral connections: a port taken in between failed the spawn.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist


def join_group(backend: str, rank: int, world: int, port: int, timeout_s: float = 120) -> None:
    """Join the default process group through the test process's store on ``port``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
