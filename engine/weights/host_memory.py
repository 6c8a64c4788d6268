"""How much host memory a process may still commit: ``MemAvailable`` bounded by every memory
cgroup limit above it (a pod's). Pure data; read by ``host_facts``, planned with by
``host_fit``.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class CgroupMemory:
    """One memory cgroup level with a limit: ``memory.max`` (v2) or ``limit_in_bytes`` (v1).
    reclaimable: its inactive file pages (what kubelet subtracts for the working set)."""

    path: str
    limit: int
    usage: int
    reclaimable: int = 0

    @property
    def available(self) -> int:
        return max(0, self.limit - max(0, self.usage - self.reclaimable))


@dataclass(frozen=True)
class HostMemory:
    """What this process may still commit: MemAvailable, bounded by every cgroup limit."""

    mem_available: int
    cgroups: tuple[CgroupMemory, ...] = ()

    @property
    def available(self) -> int:
        return min([self.mem_available, *(c.available for c in self.cgroups)])

    def source(self) -> str:
        """Which bound is the available figure, in words."""
        tight = min(self.cgroups, key=lambda c: c.available, default=None)
        if tight is not None and tight.available < self.mem_available:
            return (f"cgroup {tight.path}: limit {gib(tight.limit)}, working set "
                    f"{gib(max(0, tight.usage - tight.reclaimable))}")
        return "MemAvailable in /proc/meminfo (tmpfs pages count as used)"


def gib(n: int) -> str:
    """Bytes for a person: GiB from 1 GiB up, MiB below (tiny models, headroom)."""
    return f"{n / GIB:.1f} GiB" if abs(n) >= GIB else f"{n / (1 << 20):.1f} MiB"
