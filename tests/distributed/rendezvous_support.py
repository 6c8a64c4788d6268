"""A rendezvous for tests that spawn their own ranks.

The test process hosts the store (the engine's ``host_store``: bound to a port the OS picks
as it binds) and hands the bound port to the ranks, which join it as clients (a store object,
as the engine's ranks join: see ``rendezvous_store``). No port is chosen first and bound
later, so nothing running beside the test can take it in between.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist


def join_group(backend: str, rank: int, world: int, port: int, timeout_s: float = 120) -> None:
    """Join the default process group through the test process's store on ``port``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
