"""MultiProcessExecutor: rank 0 of a data-parallel replica.

Rank 0 runs in the engine's process (its ModelRunner is ``runner``); ranks 1..N-1 are worker
processes, spawned here when the environment names no rendezvous, or already started by a
launcher (a Kubernetes pod's entry point) when it does. Every engine step is a *wave*: rank 0
broadcasts all ranks' plans, every rank runs its own plan (its own continuous batch), and rank
0 gathers the outputs. When any rank runs a forward, ranks without work still join each
block's weight collective (``collective_wave``), so requests of any step count and arrival
time share waves without the ranks' collectives going out of step.

Without a weight collective (no DLO AllGather), ranks are *independent*: the engine runs one
step loop per rank and ``execute_rank`` talks to that rank's worker alone, over a gloo group
of just {0, r}, so a rank with a cheap batch never waits for a rank with an expensive one.

Failure detection: a worker that dies breaks the control group's connection and a worker
that hangs exceeds its timeout (``DITSERVE_WORKER_TIMEOUT_S``); either way the wave raises
``DistributedError`` naming the rank and, for spawned workers, its exit status.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ditserve.engine.config import EngineConfig
from ditserve.engine.distributed.rendezvous import (
    Rendezvous,
    destroy,
    free_port,
    init_groups,
    rank_device,
    worker_timeout_s,
)
from ditserve.engine.distributed.worker import (
    RankStep,
    Reports,
    Stop,
    Wave,
    WorkerFailure,
    WorkerHello,
    WorkerReply,
    independent_ranks,
    worker_main,
)
from ditserve.engine.errors import ConfigError, DistributedError
from ditserve.engine.executor import NewRequests
from ditserve.engine.scheduler import RunnerOutput, StepPlan

log = logging.getLogger(__name__)
REPORT_EVERY_S = 5.0


class MultiProcessExecutor:
    """Rank 0's side of a multi-process replica (see module docstring)."""

    def __init__(self, config: EngineConfig, *, model_dir: Path) -> None:
        from ditserve.engine.model_runner import ModelRunner

        par = config.parallel
        if par.sequence_parallel_size != 1:
            raise ConfigError(
                "sequence parallelism is not implemented in this build (its DLO weight group "
                "is selected and validated); use data_parallel_size for several GPUs"
            )
        self.num_ranks = par.data_parallel_size
        self.timeout_s = worker_timeout_s()
        self._procs: dict[int, mp.process.BaseProcess] = {}
        # Waves and report refreshes use the control group from different threads; one at a
        # time, or their collectives would interleave.
        self._control_lock = threading.Lock()
        # Independent mode: each rank steps on its own (the engine runs one loop per rank);
        # a worker's pair group is used by one thread at a time.
        self.independent = independent_ranks(config)
        self._rank_locks = [threading.Lock() for _ in range(self.num_ranks)]
        rdv = Rendezvous.from_env()
        if rdv is None:
            rdv = Rendezvous("127.0.0.1", free_port(), self.num_ranks, 0, 0)
            self._spawn_workers(rdv, config, model_dir)
        elif rdv.world_size != self.num_ranks or rdv.rank != 0:
            raise ConfigError(
                f"environment rendezvous (WORLD_SIZE={rdv.world_size}, RANK={rdv.rank}) does "
                f"not match data_parallel_size={self.num_ranks} on rank 0; start ranks > 0 with "
                "`ditserve worker`"
            )
        device = rank_device(config.device, rdv.local_rank)
        try:
            self._groups = init_groups(rdv, device, self.timeout_s)
            self.runner = ModelRunner(config, model_dir=model_dir, device=device,
                                      weight_group=self._groups.weight)
            hellos = self._gather(None)
        except BaseException:
            self._kill_workers()
            destroy()
            raise
        failures = [h for h in hellos[1:] if isinstance(h, WorkerFailure)]
        if failures:
            self.shutdown()
            raise DistributedError("; ".join(f"rank {f.rank}: {f.message}" for f in failures))
        for hello in hellos[1:]:
            assert isinstance(hello, WorkerHello)
            log.info("rank %d ready (pid %d, %s)", hello.rank, hello.pid, hello.device)
        # Workers' offload reports, refreshed by riding on a wave every REPORT_EVERY_S: the
        # control group must only ever be used by the engine loop's thread, never by a
        # /ready handler running concurrently with a wave.
        self._worker_reports: list[dict[str, Any] | None] = [
            None, *[h.offload for h in hellos[1:]]]
        self._reports_at = time.monotonic()
        self._rank_reports_at = [time.monotonic()] * self.num_ranks
        self._closed = False

    # -- process management ---------------------------------------------------------------------
    def _spawn_workers(self, rdv: Rendezvous, config: EngineConfig, model_dir: Path) -> None:
        ctx = mp.get_context("spawn")  # fork after torch/CUDA init is unsafe
        for rank in range(1, rdv.world_size):
            proc = ctx.Process(
                target=worker_main, name=f"ditserve-rank{rank}", daemon=True,
                args=(rank, rdv.world_size, rdv.master_addr, rdv.master_port,
                      config.to_mapping(), str(model_dir), self.timeout_s),
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
        for proc in self._procs.values():
            if proc.is_alive():
                proc.kill()
        for proc in self._procs.values():
            proc.join(timeout=10)

    # -- control messages -----------------------------------------------------------------------
    def _broadcast(self, message: Any) -> None:
        try:
            dist.broadcast_object_list([message], src=0, group=self._groups.control)
        except Exception as e:
            raise self._failure("broadcast", e) from e

    def _gather(self, payload: Any) -> list[Any]:
        box: list[Any] = [None] * self.num_ranks
        try:
            dist.gather_object(payload, box, dst=0, group=self._groups.control)
        except Exception as e:
            raise self._failure("gather", e) from e
        return box

    def _failure(self, what: str, error: Exception) -> DistributedError:
        dead = self._dead_workers()
        detail = dead or f"no reply within the timeout or connection lost ({error})"
        return DistributedError(
            f"a worker failed during {what}: {detail}. The replica cannot continue; restart it "
            f"(timeout {self.timeout_s:.0f}s, set {'DITSERVE_WORKER_TIMEOUT_S'})"
        )

    # -- Executor interface ---------------------------------------------------------------------
    def execute(
        self, plans: Sequence[StepPlan], new: Sequence[NewRequests]
    ) -> list[RunnerOutput]:
        if self.independent:
            # No collective ties the ranks together: step them concurrently, one thread each.
            with ThreadPoolExecutor(max_workers=self.num_ranks) as pool:
                futures = [pool.submit(self.execute_rank, r, plans[r], new[r])
                           for r in range(self.num_ranks)]
                return [f.result() for f in futures]
        with self._control_lock:
            return self._wave(plans, new, refresh=time.monotonic() - self._reports_at
                              > REPORT_EVERY_S)

    def execute_rank(self, rank: int, plan: StepPlan, new: NewRequests) -> RunnerOutput:
        """Independent mode: one step of one rank, at that rank's own pace."""
        if rank == 0:
            with self._rank_locks[0]:
                return self.runner.execute(plan, new)
        refresh = time.monotonic() - self._rank_reports_at[rank] > REPORT_EVERY_S
        with self._rank_locks[rank]:
            reply = self._exchange(rank, RankStep(plan, list(new), reports=refresh))
        if refresh:
            self._worker_reports[rank] = reply.offload_report
            self._rank_reports_at[rank] = time.monotonic()
        return reply.output

    def _exchange(self, rank: int, message: Any) -> WorkerReply:
        pair = self._groups.pair(rank)
        try:
            dist.send_object_list([message], dst=rank, group=pair)
            box: list[Any] = [None]
            dist.recv_object_list(box, src=rank, group=pair)
        except Exception as e:
            raise self._failure(f"a step of rank {rank}", e) from e
        reply = box[0]
        if isinstance(reply, WorkerFailure):
            raise DistributedError(f"rank {reply.rank} failed: {reply.message}")
        assert isinstance(reply, WorkerReply)
        return reply

    def _wave(
        self, plans: Sequence[StepPlan], new: Sequence[NewRequests], *, refresh: bool
    ) -> list[RunnerOutput]:
        forward = any(plan.denoise for plan in plans)
        self._broadcast(Wave(plans=list(plans), new=[list(n) for n in new], forward=forward,
                             reports=refresh))
        own = self.runner.execute(plans[0], new[0], collective_wave=forward)
        replies = self._gathered_replies(WorkerReply(own))
        if refresh:
            self._keep_reports(replies)
        return [r.output for r in replies]

    def _gathered_replies(self, own: WorkerReply) -> list[WorkerReply]:
        replies = self._gather(own)
        failures = [r for r in replies if isinstance(r, WorkerFailure)]
        if failures:
            raise DistributedError("; ".join(f"rank {f.rank} failed: {f.message}"
                                             for f in failures))
        return replies

    def _keep_reports(self, replies: list[WorkerReply]) -> None:
        self._worker_reports = [None, *[r.offload_report for r in replies[1:]]]
        self._reports_at = time.monotonic()

    def offload_reports(self, *, refresh: bool = False) -> list[dict[str, Any] | None]:
        """Rank 0's live report and the workers' latest: at most ~REPORT_EVERY_S old while
        the replica is busy, from start-up while idle. Never blocks unless ``refresh``, which
        asks every worker for its report between two steps (no step runs)."""
        if refresh and self.independent:
            for rank in range(1, self.num_ranks):
                with self._rank_locks[rank]:
                    reply = self._exchange(rank, Reports())
                self._worker_reports[rank] = reply.offload_report
                self._rank_reports_at[rank] = time.monotonic()
        elif refresh:
            with self._control_lock:
                self._broadcast(Reports())
                self._keep_reports(self._gathered_replies(WorkerReply(None)))
        return [self.runner.offload_report(), *self._worker_reports[1:]]

    def shutdown(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        try:
            if self.independent:
                for rank in range(1, self.num_ranks):
                    # A step stuck on a hung worker holds its lock: skip it (killed below).
                    if not self._rank_locks[rank].acquire(timeout=5):
                        continue
                    try:
                        dist.send_object_list([Stop()], dst=rank, group=self._groups.pair(rank))
                    finally:
                        self._rank_locks[rank].release()
            else:
                self._broadcast(Stop())
        except Exception as e:
            log.warning("could not stop workers cleanly: %s", e)
        self.runner.close()
        # NCCL's destroy returns only once every rank has called it, so ours runs while the
        # workers run theirs (joining them first would wait out the join timeout); in a
        # thread, so a worker that never gets there cannot hold the shutdown.
        teardown = threading.Thread(target=destroy, daemon=True, name="ditserve-pg-destroy")
        teardown.start()
        for proc in self._procs.values():
            proc.join(timeout=30)
        self._kill_workers()
        teardown.join(timeout=10)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "no exit yet"
    if code < 0:
        return f"signal {-code}"
    return f"status {code}"
