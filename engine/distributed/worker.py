"""The loop of a worker process (ranks 1..N-1): receive a step, run it, send the output.

Kept light at import time (spawned children re-import this module). After loading its
ModelRunner a worker says hello (or why it failed) to rank 0 over its link, then answers rank
0's messages one at a time until ``Stop`` (the protocol: ``protocol``).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import traceback
from typing import TYPE_CHECKING, Any

from ditserve.engine.distributed.protocol import (
    Link,
    Reports,
    Step,
    Stop,
    WorkerFailure,
    WorkerHello,
    WorkerReply,
)

if TYPE_CHECKING:
    from ditserve.engine.config import ParallelConfig, RunnerConfig

log = logging.getLogger(__name__)


def answer(runner: Any, rank: int, message: Step | Reports) -> WorkerReply | WorkerFailure:
    """Carry out one message from rank 0; an unexpected error becomes a WorkerFailure."""
    try:
        if isinstance(message, Reports):
            return WorkerReply(None, runner.offload_report())
        work = message.work
        output = runner.execute(work.plan, work.new, upcoming=work.upcoming,
                                collective_wave=message.collective)
        return WorkerReply(output, runner.offload_report() if message.reports else None)
    except Exception:
        return WorkerFailure(rank, os.getpid(), traceback.format_exc())


def serve(runner: Any, rank: int, link: Link) -> None:
    """Answer rank 0's messages until Stop (or until this worker failed)."""
    while True:
        message = link.receive()
        if isinstance(message, Stop):
            return
        reply = answer(runner, rank, message)
        link.send(reply)
        if isinstance(reply, WorkerFailure):
            return


def worker_main(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    config: RunnerConfig,
    parallel: ParallelConfig,
    model_dir: str,
    timeout_s: float,
    local_rank: int,
) -> None:
    """Entry point of a spawned worker process (also used by `ditserve worker`).

    config: this rank's runner options, cut from the replica's judged config with its offload
    as rank 0 resolved it (``RunnerConfig.of``; a spawned worker receives them pickled: they
    are neither judged nor resolved again here). parallel: the replica's DP x SP layout.
    local_rank: this process's index on its node (its device is cuda:local_rank): the rank
    itself when rank 0 spawned the workers, the launcher's LOCAL_RANK in a multi-node pod."""
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    # `kill -USR1 <worker pid>` prints where every thread of a stuck worker is (to stderr).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
                      WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(local_rank))
    from ditserve.engine.config.judged import remember_judged_offload
    from ditserve.engine.distributed.rendezvous import (
        Rendezvous,
        destroy,
        init_groups,
        rank_device,
    )
    from ditserve.engine.distributed.topology import Topology
    from ditserve.engine.runner.model_runner import ModelRunner

    # Rank 0 (or `ditserve worker`'s flags) judged these options: their rules do not run again.
    remember_judged_offload(config.offload.options)
    rdv = Rendezvous(master_addr, master_port, world_size, rank, local_rank)
    device = rank_device(config.device, rdv.local_rank)
    groups = init_groups(rdv, device, timeout_s, Topology.of(parallel, offload=config.offload))
    link = Link(groups.pair(rank), peer=0)
    runner = None
    try:
        try:
            runner = ModelRunner(config, model_dir=model_dir, device=device,
                                 weight_group=groups.weight, sequence_group=groups.sequence)
        except Exception as e:
            link.send(WorkerFailure(rank, os.getpid(), f"startup failed: {e!r}"))
            return
        link.send(WorkerHello(rank, os.getpid(), str(device), runner.pixel_multiple,
                              runner.offload_report()))
        serve(runner, rank, link)
    finally:
        if runner is not None:
            runner.close()
        destroy()
