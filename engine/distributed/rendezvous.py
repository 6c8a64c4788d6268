"""Rendezvous and process groups for the multi-process engine.

A replica's processes find each other through the usual torch.distributed environment
(MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK). Locally the engine spawns its own
workers and sets these itself; in a Kubernetes pod the operator sets them. Groups (the
``Topology`` names their members): the *weight group* (NCCL on GPUs, gloo on CPU) for DLO's
all_gather of weight shards, the *sequence group* of this process's DP rank for Ulysses'
all-to-alls (its own communicator even when it has the weight group's members: one
communicator's collectives run in issue order on one stream, so a block's all-to-all would
queue behind the next block's prefetch gather), and per worker a gloo *pair group* {0, r}
that carries the control messages between rank 0 and that worker (``protocol.Link``), so
control traffic never queues behind weight traffic. The groups' timeout bounds how long a
dead or hung peer can stall a collective (an all-to-all or a gather) or the engine.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ditserve.engine.distributed.topology import Ranks, Topology
from ditserve.engine.errors import ConfigError

DEFAULT_TIMEOUT_S = 600.0
TIMEOUT_ENV = "DITSERVE_WORKER_TIMEOUT_S"


def worker_timeout_s() -> float:
    """Seconds a collective may wait for a peer (model loading included): env or default."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError as e:
        raise ConfigError(f"{TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from e
    if value <= 0:
        raise ConfigError(f"{TIMEOUT_ENV} must be positive, got {raw!r}")
    return value


@dataclass(frozen=True)
class Rendezvous:
    master_addr: str
    master_port: int
    world_size: int
    rank: int
    local_rank: int

    @classmethod
    def from_env(cls) -> Rendezvous | None:
        """The rendezvous described by the environment, or None when it describes none."""
        if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
            return None
        try:
            world = int(os.environ["WORLD_SIZE"])
            rank = int(os.environ["RANK"])
            local = int(os.environ.get("LOCAL_RANK", rank))
            port = int(os.environ.get("MASTER_PORT", "29500"))
        except ValueError as e:
            raise ConfigError(f"bad torch.distributed environment: {e}") from e
        if world <= 1:
            return None
        if not 0 <= rank < world:
            raise ConfigError(f"RANK={rank} is outside WORLD_SIZE={world}")
        return cls(os.environ.get("MASTER_ADDR", "127.0.0.1"), port, world, rank, local)


def host_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store, listening on a port the OS picks as it binds.

    Choosing a free port and binding it later leaves a window in which another process (a
    parallel test, a gloo connection's ephemeral port) can take it; binding first and handing
    the bound port (``.port``) to the workers leaves none. Workers join it as clients, through
    ``rendezvous_store``."""
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def rank_device(device: str, local_rank: int) -> torch.device:
    """This rank's device: one accelerator per process, indexed by LOCAL_RANK."""
    if device == "cpu":
        return torch.device("cpu")
    if device in ("auto", "cuda"):
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank)
        if device == "cuda":
            raise ConfigError("device 'cuda' requested but CUDA is not available")
        return torch.device("cpu")
    raise ConfigError(
        f"with several ranks, device must be auto, cuda or cpu (each rank takes cuda:LOCAL_RANK), "
        f"got {device!r}"
    )


@dataclass
class Groups:
    rank: int
    world_size: int
    # pairs[r - 1]: a gloo group of ranks {0, r}, so rank 0 can talk to each worker on its own
    # (ranks stepping at their own pace) without two threads ever sharing a group.
    pairs: list[dist.ProcessGroup]
    # This process's DLO weight group (None: no AllGather group in this topology).
    weight: dist.ProcessGroup | None = None
    # This process's SP group (its DP rank's processes; None without sequence parallelism).
    sequence: dist.ProcessGroup | None = None

    def pair(self, rank: int) -> dist.ProcessGroup:
        return self.pairs[rank - 1]


def rendezvous_store(rdv: Rendezvous, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store at MASTER_ADDR:MASTER_PORT: rank 0 serves it, the others join it.

    Every rank passes a store to ``init_process_group`` (none gives it a ``tcp://`` URL):
    torch prefixes the keys of a store it makes from a URL and not those of one it is given,
    so ranks that joined the two ways would never see each other's addresses."""
    return dist.TCPStore(rdv.master_addr, rdv.master_port, rdv.world_size,
                         is_master=rdv.rank == 0, timeout=datetime.timedelta(seconds=timeout_s))


def init_groups(rdv: Rendezvous, device: torch.device, timeout_s: float,
                topology: Topology, store: dist.Store | None = None) -> Groups:
    """Join the rendezvous; returns this process's weight and sequence groups (as the
    ``topology`` names them) and the pair groups. store: rank 0's own ``host_store`` when it
    hosts the rendezvous itself (None: ``rendezvous_store``)."""
    if topology.world_size != rdv.world_size:
        raise ConfigError(f"the topology has {topology.world_size} processes but the rendezvous "
                          f"WORLD_SIZE is {rdv.world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    options = None
    if backend == "nccl":
        # High-priority NCCL streams: DLO's per-block all_gather then gets SMs as soon as the
        # running GEMM's thread blocks retire, instead of queueing behind the whole kernel
        # (measured on 2 x H200: a 648 MiB gather took ~6 ms next to compute, 1.3 ms with this).
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = True
    dist.init_process_group(
        backend, store=store if store is not None else rendezvous_store(rdv, timeout_s),
        rank=rdv.rank, world_size=rdv.world_size, timeout=timeout, pg_options=options,
    )
    # Every rank creates every group, in the same order (a collective requirement).
    pairs = [dist.new_group([0, r], backend="gloo", timeout=timeout)
             for r in range(1, rdv.world_size)]

    def member_of(groups: Ranks, *, reuse_world: bool) -> dist.ProcessGroup | None:
        if not groups:
            return None
        if reuse_world and groups == (tuple(range(rdv.world_size)),):
            return dist.group.WORLD  # one group of everyone: the default group's communicator
        mine, _ = dist.new_subgroups_by_enumeration(
            [list(g) for g in groups], timeout=timeout, backend=backend, pg_options=options)
        return mine

    weight = member_of(topology.weight_groups, reuse_world=True)
    sequence = member_of(topology.sequence_groups, reuse_world=False)
    return Groups(rank=rdv.rank, world_size=rdv.world_size, pairs=pairs, weight=weight,
                  sequence=sequence)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
