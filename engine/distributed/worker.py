"""The worker loop of ranks 1..N-1: receive a wave, run this rank's plan, send the output.

Kept light at import time (spawned children re-import this module). Messages travel on the
gloo control group: rank 0 broadcasts a ``Wave`` (every rank's plan and new requests, and
whether any rank runs a forward), each rank answers with its RunnerOutput via gather. A worker
that cannot start or hits an unexpected error answers with a ``WorkerFailure`` and exits, so
rank 0 reports it instead of waiting for a timeout.

Without a weight collective (no DLO AllGather) ranks are independent: after start-up each
worker instead serves ``RankStep`` messages from rank 0 on its own pair group, one step at a
time, at whatever pace its own batch allows.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Wave:
    plans: Sequence[Any]  # StepPlan per rank
    new: Sequence[Any]  # NewRequests per rank
    forward: bool  # some rank runs a denoise forward (collective participation needed)
    reports: bool = False  # attach this rank's offload report to the reply


@dataclass(frozen=True)
class RankStep:
    """Independent mode: one step of this rank alone (no other rank is involved)."""

    plan: Any  # StepPlan
    new: Any  # NewRequests
    reports: bool = False


def independent_ranks(config: Any) -> bool:
    """Ranks step on their own unless DLO shards weights over the group (every block load is
    then a collective, so ranks must run matched passes in waves)."""
    return not (config.offload.enabled and config.offload.use_allgather)


@dataclass(frozen=True)
class Reports:
    """Answer with this rank's offload report and run nothing. Not an empty step: a step
    waits for the runner's queued work and hands back its late outputs (decoded pixels),
    which a report request would drop."""


@dataclass(frozen=True)
class WorkerReply:
    output: Any  # RunnerOutput; None for Reports
    offload_report: dict[str, Any] | None = None


@dataclass(frozen=True)
class Stop:
    """Rank 0 is shutting down; workers leave their loop."""


@dataclass(frozen=True)
class WorkerHello:
    rank: int
    pid: int
    device: str
    pixel_multiple: int
    offload: dict[str, Any] | None


@dataclass(frozen=True)
class WorkerFailure:
    rank: int
    pid: int
    message: str


def _gather(payload: Any, group: Any) -> None:
    import torch.distributed as dist

    dist.gather_object(payload, None, dst=0, group=group)


def _answer(runner: Any, rank: int, message: Wave | RankStep | Reports) -> WorkerReply | WorkerFailure:
    """Carry out one message from rank 0; an unexpected error becomes a WorkerFailure."""
    try:
        if isinstance(message, Reports):
            return WorkerReply(None, runner.offload_report())
        if isinstance(message, Wave):
            output = runner.execute(message.plans[rank], message.new[rank],
                                    collective_wave=message.forward)
        else:
            output = runner.execute(message.plan, message.new)
        return WorkerReply(output, runner.offload_report() if message.reports else None)
    except Exception:
        return WorkerFailure(rank, os.getpid(), traceback.format_exc())


def _serve_steps(runner: Any, rank: int, pair: Any) -> None:
    """Independent mode: answer rank 0's RankSteps over this worker's pair group."""
    import torch.distributed as dist

    while True:
        box: list[Any] = [None]
        dist.recv_object_list(box, src=0, group=pair)
        if isinstance(box[0], Stop):
            return
        reply = _answer(runner, rank, box[0])
        dist.send_object_list([reply], dst=0, group=pair)
        if isinstance(reply, WorkerFailure):
            return


def worker_main(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    config_mapping: dict[str, Any],
    model_dir: str,
    timeout_s: float,
) -> None:
    """Entry point of a spawned worker process (also used by `ditserve worker`)."""
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    # `kill -USR1 <worker pid>` prints where every thread of a stuck worker is (to stderr).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
                      WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank))
    import torch.distributed as dist

    from ditserve.engine.config import EngineConfig
    from ditserve.engine.distributed.rendezvous import (
        Rendezvous,
        destroy,
        init_groups,
        rank_device,
    )
    from ditserve.engine.model_runner import ModelRunner

    config = EngineConfig.from_mapping(config_mapping)
    rdv = Rendezvous(master_addr, master_port, world_size, rank, rank)
    device = rank_device(config.device, rdv.local_rank)
    groups = init_groups(rdv, device, timeout_s)
    runner = None
    try:
        try:
            runner = ModelRunner(config, model_dir=model_dir, device=device,
                                 weight_group=groups.weight)
        except Exception as e:
            _gather(WorkerFailure(rank, os.getpid(), f"startup failed: {e!r}"), groups.control)
            return
        _gather(WorkerHello(rank, os.getpid(), str(device), runner.pixel_multiple,
                            runner.offload_report()), groups.control)
        if independent_ranks(config):
            _serve_steps(runner, rank, groups.pair(rank))
            return
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=groups.control)
            if isinstance(box[0], Stop):
                break
            reply = _answer(runner, rank, box[0])
            _gather(reply, groups.control)
            if isinstance(reply, WorkerFailure):
                return
    finally:
        if runner is not None:
            runner.close()
        destroy()
