"""MultiProcessExecutor: rank 0 of a multi-process replica (data and sequence parallel).

Rank 0 runs in the engine's process (its ModelRunner is ``runner``); ranks 1..N-1 (N = dp x
sp) are worker processes, spawned here when the environment names no rendezvous, or already
started by a launcher (a Kubernetes pod's entry point) when it does. Rank 0 talks to each worker over that
worker's link (``protocol``): a step sends every stepping worker its ``Step``, runs rank 0's
own plan if rank 0 steps, and receives the replies.

Which ranks step together comes from the ``Topology``: without a weight collective every rank
is its own step group (the engine runs one step loop per rank, and a rank with a cheap batch
never waits for a rank with an expensive one); with DLO AllGather all ranks step together,
and when any rank runs a forward the ranks without work still join each block's weight
collective (``Step.collective``), so requests of any step count and arrival time share steps
without the ranks' collectives going out of step.

With sequence parallelism every DP rank is an SP group of processes (``Topology.processes``):
a step sends the DP rank's ``Step`` to each process of its group - the same plan and the same
new requests, so the group's processes run the same batch in lockstep, each on its share of
the tokens - and the DP rank's output is its leader's; the followers decode nothing and
send back no pixels. Scheduling, continuous batching, bypass admission and DP waves work on
DP ranks exactly as without SP.

Failure detection: a worker that dies breaks its link's connection and a worker that hangs
exceeds the link's timeout (``DITSERVE_WORKER_TIMEOUT_S``); either way the step raises
``DistributedError`` naming the rank and, for spawned workers, its exit status. A peer that
dies or hangs inside a collective (an SP all-to-all, a DLO gather) fails that collective on
the other ranks - at once when its connection breaks, at the groups' timeout (the same
setting) when it hangs - so the step fails within that bound too.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ditserve.engine.config import ParallelConfig, RunnerConfig
from ditserve.engine.distributed.protocol import (
    Link,
    Reports,
    Step,
    Stop,
    WorkerFailure,
    WorkerHello,
    WorkerReply,
)
from ditserve.engine.distributed.rendezvous import (
    Rendezvous,
    destroy,
    host_store,
    init_groups,
    rank_device,
    worker_timeout_s,
)
from ditserve.engine.distributed.topology import Topology
from ditserve.engine.distributed.worker import worker_main
from ditserve.engine.errors import ConfigError, DistributedError
from ditserve.engine.executor import RankWork
from ditserve.engine.step.plan import RunnerOutput

log = logging.getLogger(__name__)
REPORT_EVERY_S = 5.0


class MultiProcessExecutor:
    """Rank 0's side of a multi-process replica (see module docstring)."""

    def __init__(self, config: RunnerConfig, *, parallel: ParallelConfig,
                 model_dir: Path) -> None:
        """config: every rank's runner options (each worker receives them pickled);
        parallel: the replica's DP x SP layout."""
        from ditserve.engine.runner.model_runner import ModelRunner

        if parallel.sequence_parallel_size > 1:
            # Before spawning anything: the model's DiTs must split their heads over the group.
            from ditserve.engine.config import raise_problems, sequence_parallel_problems
            from ditserve.engine.weights.loader import dit_attention_heads

            raise_problems("sequence-parallel", sequence_parallel_problems(
                parallel.sequence_parallel_size, dit_attention_heads(model_dir)))
        self.topology = Topology.of(parallel, offload=config.offload)
        self.num_ranks = self.topology.data_parallel_size
        self.step_groups = self.topology.step_groups
        self.timeout_s = worker_timeout_s()
        world = self.topology.world_size
        self._procs: dict[int, mp.process.BaseProcess] = {}
        # One lock per process: rank 0's runner and each worker's link are used by one thread
        # at a time (a step loop, or a report refresh from a /ready handler).
        self._locks = [threading.Lock() for _ in range(world)]
        rdv = Rendezvous.from_env()
        store = None
        if rdv is None:
            store = host_store(world, self.timeout_s)
            rdv = Rendezvous("127.0.0.1", store.port, world, 0, 0)
            self._spawn_workers(rdv, config, parallel, model_dir)
        elif rdv.world_size != world or rdv.rank != 0:
            raise ConfigError(
                f"environment rendezvous (WORLD_SIZE={rdv.world_size}, RANK={rdv.rank}) does "
                f"not match data_parallel_size x sequence_parallel_size = {world} on rank 0; "
                "start ranks > 0 with `ditserve worker`"
            )
        device = rank_device(config.device, rdv.local_rank)
        try:
            groups = init_groups(rdv, device, self.timeout_s, self.topology, store)
            self._links = {r: Link(groups.pair(r), peer=r) for r in range(1, world)}
            self.runner = ModelRunner(config, model_dir=model_dir, device=device,
                                      weight_group=groups.weight,
                                      sequence_group=groups.sequence)
            hellos = [self._receive(r, "start-up") for r in self._links]
        except BaseException:
            self._kill_workers()
            destroy()
            raise
        self._closed = False
        failures = [h for h in hellos if isinstance(h, WorkerFailure)]
        if failures:
            self.shutdown()
            raise DistributedError("; ".join(f"rank {f.rank}: {f.message}" for f in failures))
        for hello in hellos:
            assert isinstance(hello, WorkerHello)
            log.info("rank %d ready (pid %d, %s)", hello.rank, hello.pid, hello.device)
        # Workers' offload reports, refreshed by riding on a step every REPORT_EVERY_S: a link
        # is only ever used by the thread holding its lock, never by a /ready handler while
        # a step runs on it.
        self._reports: list[dict[str, Any] | None] = [None, *[h.offload for h in hellos]]
        self._reports_at = [time.monotonic()] * world

    # -- process management ---------------------------------------------------------------------
    def _spawn_workers(self, rdv: Rendezvous, config: RunnerConfig, parallel: ParallelConfig,
                       model_dir: Path) -> None:
        ctx = mp.get_context("spawn")  # fork after torch/CUDA init is unsafe
        for rank in range(1, rdv.world_size):
            proc = ctx.Process(
                target=worker_main, name=f"ditserve-rank{rank}", daemon=True,
                args=(rank, rdv.world_size, rdv.master_addr, rdv.master_port,
                      config, parallel, str(model_dir), self.timeout_s, rank),
            )
            proc.start()
            self._procs[rank] = proc
        log.info("spawned %d worker process(es) on %s:%d", len(self._procs),
                 rdv.master_addr, rdv.master_port)

    def worker_pids(self) -> dict[int, int]:
        """Spawned workers' pids by rank (empty when a launcher started them)."""
        return {rank: p.pid for rank, p in self._procs.items() if p.pid is not None}

    def _dead_workers(self, settle_s: float = 3.0) -> str:
        # A broken connection can surface a moment before the dead worker is reaped; give
        # the exit status a short while to appear so the error can name it.
        deadline = time.monotonic() + settle_s
        while self._procs and time.monotonic() < deadline:
            if any(p.exitcode is not None for p in self._procs.values()):
                break
            time.sleep(0.05)
        dead = [
            f"rank {rank} (pid {p.pid}) exited with {_describe_exit(p.exitcode)}"
            for rank, p in self._procs.items() if p.exitcode is not None
        ]
        return "; ".join(dead)

    def _kill_workers(self) -> None:
        _kill(self._procs)

    # -- control messages -----------------------------------------------------------------------
    def _send(self, rank: int, message: Any) -> None:
        try:
            self._links[rank].send(message)
        except Exception as e:
            raise self._failure(f"a message to rank {rank}", e) from e

    def _receive(self, rank: int, what: str) -> Any:
        try:
            return self._links[rank].receive()
        except Exception as e:
            raise self._failure(f"{what} of rank {rank}", e) from e

    def _failure(self, what: str, error: Exception) -> DistributedError:
        dead = self._dead_workers()
        detail = dead or f"no reply within the timeout or connection lost ({error})"
        return DistributedError(
            f"a worker failed during {what}: {detail}. The replica cannot continue; restart it "
            f"(timeout {self.timeout_s:.0f}s, set {'DITSERVE_WORKER_TIMEOUT_S'})"
        )

    @contextlib.contextmanager
    def _holding(self, processes: list[int]) -> Iterator[None]:
        # Always in ascending order, so two threads never wait on each other's locks.
        with contextlib.ExitStack() as stack:
            for process in sorted(processes):
                stack.enter_context(self._locks[process])
            yield

    # -- Executor interface ---------------------------------------------------------------------
    def step(self, work: Mapping[int, RankWork]) -> dict[int, RunnerOutput]:
        # A step of some ranks only would leave the others' weight gathers unmatched.
        assert not self.topology.lockstep or len(work) == self.num_ranks, "a partial lockstep step"
        collective = self.topology.lockstep and any(w.plan.denoise for w in work.values())
        members = {rank: list(self.topology.processes(rank)) for rank in work}
        processes = [p for group in members.values() for p in group]
        workers = [p for p in processes if p != 0]
        now = time.monotonic()
        refresh = {p for p in workers if now - self._reports_at[p] > REPORT_EVERY_S}
        with self._holding(processes):
            for rank, group in members.items():
                for p in group:
                    if p != 0:
                        self._send(p, Step(work[rank], collective, reports=p in refresh))
            own = None
            if 0 in processes:
                mine = work[0]
                own = self.runner.execute(mine.plan, mine.new, upcoming=mine.upcoming,
                                          collective_wave=collective)
            replies = {p: self._receive(p, "a step") for p in workers}
        failures = [r for r in replies.values() if isinstance(r, WorkerFailure)]
        if failures:
            raise DistributedError("; ".join(f"rank {f.rank} failed: {f.message}"
                                             for f in failures))
        for p in refresh:
            self._keep_report(p, replies[p])
        # Each DP rank's output is its leader's (the group's first process).
        return {rank: own if group[0] == 0 else replies[group[0]].output
                for rank, group in members.items()}

    def _keep_report(self, process: int, reply: WorkerReply) -> None:
        self._reports[process] = reply.offload_report
        self._reports_at[process] = time.monotonic()

    def offload_reports(self, *, refresh: bool = False) -> list[dict[str, Any] | None]:
        """Rank 0's live report and the workers' latest: at most ~REPORT_EVERY_S old while
        the replica is busy, from start-up while idle. Never blocks unless ``refresh``, which
        asks every worker for its report between two of its steps (no step runs)."""
        if refresh:
            for process in self._links:
                with self._locks[process]:
                    self._send(process, Reports())
                    reply = self._receive(process, "a report")
                if isinstance(reply, WorkerFailure):
                    raise DistributedError(f"rank {reply.rank} failed: {reply.message}")
                self._keep_report(process, reply)
        return [self.runner.offload_report(), *self._reports[1:]]

    def shutdown(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        for process, link in self._links.items():
            # A step stuck on a hung worker holds its lock: skip it (killed below).
            if not self._locks[process].acquire(timeout=5):
                continue
            try:
                link.send(Stop())
            except Exception as e:
                log.warning("could not stop rank %d cleanly: %s", process, e)
            finally:
                self._locks[process].release()
        tear_down_rank0(self.runner, self._procs)


def tear_down_rank0(runner: Any, workers: Mapping[int, Any]) -> None:
    """Close rank 0's runner and process groups while the told-to-stop ``workers`` (spawned
    processes by rank) close theirs; then join them, killing what is left."""
    runner.close()
    # NCCL's destroy returns only once every rank has called it, so ours runs while the
    # workers run theirs (joining them first would wait out the join timeout); in a thread,
    # so a worker that never gets there cannot hold the shutdown.
    teardown = threading.Thread(target=destroy, daemon=True, name="ditserve-pg-destroy")
    teardown.start()
    for proc in workers.values():
        proc.join(timeout=30)
    _kill(workers)
    teardown.join(timeout=10)


def _kill(processes: Mapping[int, Any]) -> None:
    for proc in processes.values():
        if proc.is_alive():
            proc.kill()
    for proc in processes.values():
        proc.join(timeout=10)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "no exit yet"
    if code < 0:
        return f"signal {-code}"
    return f"status {code}"
