"""Topology: which processes run which data-parallel rank, and which ranks step together.

Pure (no torch). Read by rank 0's executor, which fans each step out along it.

- A *DP rank* has its own scheduler and continuous batch. Today it is one process: DP rank r
  is process r.
- A *step group* is the DP ranks that run their steps together. Without a weight collective
  every rank is its own group, so a rank with a cheap batch never waits for a rank with an
  expensive one. With DLO AllGather every block load is a collective over the DP group, so
  all ranks form one group and run matched passes (a rank without a batch joins the gathers).
- Sequence parallelism (#21) goes in ``processes``: the SP ranks of one DP rank run that
  rank's batch in lockstep, each on its slice of the sequence, so the executor sends the same
  work to every process of ``processes(dp_rank)`` and takes the leader's (first's) output.
  The SP process group joins ``rendezvous.Groups`` with the same numbering.
"""

from __future__ import annotations

from dataclasses import dataclass

from ditserve.engine.config import EngineConfig


@dataclass(frozen=True)
class Topology:
    data_parallel_size: int
    sequence_parallel_size: int = 1
    # Every weight load is a collective over the DP group: all DP ranks step together.
    lockstep: bool = False

    @classmethod
    def of(cls, config: EngineConfig) -> Topology:
        par, off = config.parallel, config.offload
        gathers = off.enabled and off.use_allgather and par.data_parallel_size > 1
        return cls(par.data_parallel_size, par.sequence_parallel_size, lockstep=gathers)

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.sequence_parallel_size

    @property
    def step_groups(self) -> tuple[tuple[int, ...], ...]:
        ranks = tuple(range(self.data_parallel_size))
        return (ranks,) if self.lockstep else tuple((rank,) for rank in ranks)

    def processes(self, dp_rank: int) -> range:
        """The processes that run ``dp_rank``'s batch, its leader first."""
        sp = self.sequence_parallel_size
        return range(dp_rank * sp, (dp_rank + 1) * sp)
