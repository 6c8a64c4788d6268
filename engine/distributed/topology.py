"""Topology: which processes run which data-parallel rank, which ranks step together, and
which processes form the SP and DLO weight groups.

Pure (no torch). Read by rank 0's executor, which fans each step out along it, and by
``rendezvous``, which creates the process groups it names.

- A *DP rank* has its own scheduler and continuous batch. It runs on ``sequence_parallel_size``
  processes: DP rank d is processes ``d*sp .. d*sp + sp - 1`` (``processes``), its leader
  first. With sp = 1 DP rank d is process d.
- The processes of a DP rank are its *SP group*: they run that rank's batch in lockstep, each
  on its slice of the tokens (Ulysses, ``engine.parallel``), so the executor sends the same
  work to every process of ``processes(dp_rank)`` and takes the leader's output.
- A *step group* is the DP ranks that run their steps together. Without a weight collective
  across DP ranks every rank is its own group, so a rank with a cheap batch never waits for a
  rank with an expensive one. With DLO AllGather over the DP group every block load is a
  collective across DP ranks, so all ranks form one group and run matched passes (a rank
  without a batch joins the gathers).
- The *weight groups* DLO's AllGather shards over (``ParallelConfig.weight_group``): with
  dp > 1 the processes at the same SP index of every DP rank (each process holds 1/dp of the
  blocks; its SP peers hold the same shard of their own groups); else with sp > 1 the SP
  group (1/sp each; its lockstep already matches the gathers); never TP.
"""

from __future__ import annotations

from dataclasses import dataclass

from ditserve.engine.config import ParallelConfig, ResolvedOffload

Ranks = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Topology:
    data_parallel_size: int
    sequence_parallel_size: int = 1
    # Every weight load is a collective over the DP group: all DP ranks step together.
    lockstep: bool = False

    @classmethod
    def of(cls, parallel: ParallelConfig, *, offload: ResolvedOffload) -> Topology:
        return cls(parallel.data_parallel_size, parallel.sequence_parallel_size,
                   lockstep=offload.lockstep)

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.sequence_parallel_size

    @property
    def step_groups(self) -> Ranks:
        ranks = tuple(range(self.data_parallel_size))
        return (ranks,) if self.lockstep else tuple((rank,) for rank in ranks)

    def processes(self, dp_rank: int) -> range:
        """The processes that run ``dp_rank``'s batch, its leader first."""
        sp = self.sequence_parallel_size
        return range(dp_rank * sp, (dp_rank + 1) * sp)

    @property
    def sequence_groups(self) -> Ranks:
        """The SP groups (one per DP rank), or none without sequence parallelism."""
        if self.sequence_parallel_size == 1:
            return ()
        return tuple(tuple(self.processes(d)) for d in range(self.data_parallel_size))

    @property
    def weight_groups(self) -> Ranks:
        """DLO's AllGather groups (see module doc), or none when there is no group."""
        dp, sp = self.data_parallel_size, self.sequence_parallel_size
        if dp > 1:
            return tuple(tuple(d * sp + s for d in range(dp)) for s in range(sp))
        if sp > 1:
            return self.sequence_groups
        return ()
