"""Whether a model's host bytes fit this host under offload, and the DiT backing that fits.

Pure (no torch, no file reads): facts in, a ``HostFit`` out. ``host_facts`` reads the facts
(``/proc/meminfo``, the cgroup's limit, which filesystem each component's files are on, their
bytes); ``weights.load`` calls ``plan_host_fit`` before anything is loaded, logs the plan and
refuses to start (``HostMemoryError``) when it does not fit, instead of being OOM-killed.

What counts (docs/offload.md, "Host memory at load"): the host bytes a load *adds that the
kernel cannot reclaim*, against what is available now (``MemAvailable``, and under a cgroup
limit, as in a pod, the limit minus the cgroup's working set; the smaller wins):

- a checkpoint on tmpfs/shmem (``/dev/shm``, a memory-backed emptyDir) is already in memory
  and never reclaimable: ``MemAvailable`` excludes it, and mapping it adds nothing; a private
  copy of it holds the bytes twice;
- a checkpoint on a disk is page cache: counted as available, and mapping it adds nothing
  committed (the kernel evicts its pages under pressure) - unless its pages are registered
  (``cudaHostRegister`` locks them: committed);
- a private pinned copy (the DiT's slabs, a streamed or parked text encoder's layers) is
  committed, as is a private copy made by a cast while loading (stored dtype != serving);
- resident parts are views of their files while they move to the device: nothing committed.

``auto`` (``--dlo-checkpoint-mmap auto`` without ``--dlo-pin-limit-gib``) picks the DiT's
backing on CUDA rank-local streaming: the checkpoint on tmpfs -> map it and register the
mapping (a pin limit of the mapped bytes: full speed, no copy); on a disk -> a private pinned
copy when it fits, else the mapping through staging slots (nothing committed, about 2x
slower per step). Some headroom is kept free for the process itself (CUDA context,
staging, decoded images' host copies: ``headroom_for``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ditserve.engine.weights.host_memory import GIB, CgroupMemory, HostMemory, gib

__all__ = ["GIB", "CgroupMemory", "ComponentFiles", "DitBacking", "HostFit", "HostMemory",
           "Holding", "LoadOptions", "gib", "headroom_for", "pin_limit_for", "plan_host_fit"]

# Host memory kept free beyond the weights: torch and the CUDA context (~1-3 GiB RSS), pinned
# staging slots, decoded images' host copies, the allocator's slack. An eighth of what the
# load commits, up to this: a load that commits nothing is never refused, a large one keeps
# room for the process around its weights.
HEADROOM_BYTES = 4 * GIB
HEADROOM_FRACTION = 8


def headroom_for(committed: int, cap: int = HEADROOM_BYTES) -> int:
    return min(cap, committed // HEADROOM_FRACTION)
# Filesystems whose pages live in memory and are never reclaimed (swap aside).
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "shmem", "ramfs", "hugetlbfs"})


@dataclass(frozen=True)
class ComponentFiles:
    """A component's checkpoint on this host. bytes: in the serving dtype; filesystem: of
    its files (``tmpfs``, ``ext4``, ...); cast: stored in another dtype than served (loading
    makes private tensors)."""

    name: str
    bytes: int
    filesystem: str
    cast: bool = False

    @property
    def in_memory(self) -> bool:
        return self.filesystem in MEMORY_FILESYSTEMS


class DitBacking(str, enum.Enum):
    """Where the DiT's streamed bytes are held."""

    PRIVATE = "private"  # pinned slabs (or shards, packed slabs) copied from the files
    MAPPED_REGISTERED = "mapped-registered"  # the file's pages, registered: full speed
    MAPPED_STAGING = "mapped-staging"  # the file's pages through two pinned staging slots
    MAPPED = "mapped"  # the file's pages, read straight (a CPU device)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class LoadOptions:
    """The options that decide the host bytes. mmap: ``--dlo-checkpoint-mmap``;
    pin_limit_bytes: ``--dlo-pin-limit-gib``; registers: blocks stream rank-locally to a CUDA
    device straight from their backing (only then is there a choice to make, and a
    registration to do); keep_private: why the DiT loads privately whatever the rest says
    (quantization, a fused adapter); runtime_cache: the DiT comes from the node cache's
    mapping; encoders_offloaded: DLO streams or parks the text encoders (pinned copies);
    processes: engine processes on this host loading at once (private copies each; the
    files' pages once); sharded: each keeps 1/processes of the DiT (AllGather shards);
    copies: the backend copies the blocks into private slabs whatever their backing
    (AllGather shards, lossless packing). Neither registers nor copies: a CPU device."""

    mmap: str = "auto"
    pin_limit_bytes: int = 0
    registers: bool = True
    keep_private: str | None = None
    runtime_cache: bool = False
    encoders_offloaded: bool = True
    processes: int = 1
    sharded: bool = False
    copies: bool = False


@dataclass(frozen=True)
class Holding:
    """One component's row of the plan: where its bytes are held and what that commits."""

    name: str
    bytes: int
    held_in: str
    committed: int  # host bytes added that cannot be reclaimed (this host's processes)


@dataclass(frozen=True)
class HostFit:
    """The plan: the DiT's backing (auto pin limit included), every component's holding, the
    committed total against what is available, and what else would fit when it does not."""

    dit: DitBacking
    pin_limit_bytes: int  # the registration budget the DiT streams under (0: none)
    auto_pin: bool  # the pin limit was chosen here, not by the flag
    reason: str
    holdings: tuple[Holding, ...]
    memory: HostMemory
    headroom: int = HEADROOM_BYTES
    remedies: tuple[str, ...] = ()
    private_fits: bool = True  # a private copy of the DiT would fit too (a failed mapping)

    @property
    def committed(self) -> int:
        return sum(h.committed for h in self.holdings)

    @property
    def needed(self) -> int:
        return self.committed + self.headroom

    @property
    def fits(self) -> bool:
        return self.needed <= self.memory.available

    def to_json(self) -> dict[str, object]:
        return {"dit_backing": str(self.dit), "reason": self.reason, "fits": self.fits,
                "pin_limit_bytes": self.pin_limit_bytes, "auto_pin": self.auto_pin,
                "committed_bytes": self.committed, "headroom_bytes": self.headroom,
                "available_bytes": self.memory.available, "available_from": self.memory.source(),
                "components": [dict(h.__dict__) for h in self.holdings],
                "remedies": list(self.remedies)}

    def table(self) -> str:
        """The host plan, one line per component, then the verdict."""
        width = max(len(h.name) for h in self.holdings) if self.holdings else 0
        lines = [f"  {h.name.ljust(width)}  {gib(h.bytes):>10}  {h.held_in}  "
                 f"(commits {gib(h.committed) if h.committed else 'nothing'})"
                 for h in self.holdings]
        lines.append(f"  needs {gib(self.committed)} + {gib(self.headroom)} headroom of "
                     f"{gib(self.memory.available)} available ({self.memory.source()}): "
                     + ("fits" if self.fits else "DOES NOT FIT"))
        return "\n".join(["host plan (DiT: " + self.reason + ")", *lines])

    def refusal(self) -> str:
        """The error of a plan that does not fit: bytes needed, available, what would fit."""
        parts = "; ".join(f"{h.name} {gib(h.committed)} as {h.held_in}"
                          for h in self.holdings if h.committed)
        fixes = ("; would fit: " + "; or ".join(self.remedies)) if self.remedies else (
            "; nothing this engine can choose fits: free host memory, or serve on a larger host")
        return (f"host memory: loading would commit {gib(self.committed)} that the kernel "
                f"cannot reclaim ({parts}) + {gib(self.headroom)} headroom, but "
                f"{gib(self.memory.available)} is available ({self.memory.source()}); "
                f"refusing to start instead of being OOM-killed{fixes} "
                "(DITSERVE_HOST_MEMORY_CHECK=warn loads anyway)")


def plan_host_fit(dits: Sequence[ComponentFiles], encoders: Sequence[ComponentFiles],
                  others: Sequence[ComponentFiles], memory: HostMemory,
                  options: LoadOptions, *, headroom: int = HEADROOM_BYTES) -> HostFit:
    """The host plan of a load (module docstring), with remedies when it does not fit."""
    fit = _plan(dits, encoders, others, memory, options, headroom)
    if fit.fits:
        return fit
    return replace(fit, remedies=tuple(_remedies(dits, encoders, others, memory, options,
                                                 headroom)))


def _plan(dits: Sequence[ComponentFiles], encoders: Sequence[ComponentFiles],
          others: Sequence[ComponentFiles], memory: HostMemory, options: LoadOptions,
          headroom: int) -> HostFit:
    rest = [*_encoder_holdings(encoders, options), *_resident_holdings(others, options)]
    rest_committed = sum(h.committed for h in rest)
    dit_bytes = sum(d.bytes for d in dits) * options.processes
    room = memory.available - rest_committed - headroom_for(rest_committed + dit_bytes, headroom)
    backing, pin, auto_pin, reason = _dit_backing(dits, memory, options, room=room)
    holdings = [_dit_holding(d, backing, options) for d in dits] + rest
    committed = sum(h.committed for h in holdings)
    private = rest_committed + sum(_dit_holding(d, DitBacking.PRIVATE, options).committed
                                   for d in dits)
    return HostFit(dit=backing, pin_limit_bytes=pin, auto_pin=auto_pin, reason=reason,
                   holdings=tuple(holdings), memory=memory,
                   headroom=headroom_for(committed, headroom),
                   private_fits=private + headroom_for(private, headroom) <= memory.available)


def _dit_backing(dits: Sequence[ComponentFiles], memory: HostMemory, options: LoadOptions,
                 *, room: int) -> tuple[DitBacking, int, bool, str]:
    """(backing, pin limit, chosen here, reason). ``room``: what the DiT may commit."""
    total = sum(d.bytes for d in dits)
    in_memory = bool(dits) and all(d.in_memory for d in dits)
    where = _filesystems(dits)
    if options.keep_private is not None:
        return DitBacking.PRIVATE, 0, False, f"private: {options.keep_private}"
    if options.runtime_cache:
        kind = DitBacking.MAPPED_REGISTERED if options.pin_limit_bytes else \
            DitBacking.MAPPED_STAGING
        return kind, options.pin_limit_bytes, False, "the node cache entry's mapping"
    if any(d.cast for d in dits):
        return (DitBacking.PRIVATE, 0, False, "private copy: the checkpoint is stored in "
                "another dtype than served, and a cast copies (store it in the serving dtype "
                "to map it)")
    if options.mmap == "off":
        return DitBacking.PRIVATE, 0, False, "private pinned copy (--dlo-checkpoint-mmap off)"
    if options.copies or options.sharded:
        return (DitBacking.PRIVATE, 0, False, "checkpoint mapped, blocks copied into private "
                "slabs (AllGather shards or packed bf16)")
    if not options.registers:
        return DitBacking.MAPPED, 0, False, f"checkpoint on {where} mapped (read straight)"
    if options.pin_limit_bytes > 0:
        return (DitBacking.MAPPED_REGISTERED, options.pin_limit_bytes, False,
                f"checkpoint mapped and registered (--dlo-pin-limit-gib, files on {where})")
    if in_memory:
        return (DitBacking.MAPPED_REGISTERED, pin_limit_for(total), True,
                f"checkpoint on {where}: mapped and registered (automatic pin limit "
                f"{gib(pin_limit_for(total))}) - its pages are in memory already, a private "
                "copy would hold them twice")
    if total * options.processes <= room:
        return (DitBacking.PRIVATE, 0, False,
                f"checkpoint on {where}: private pinned copy (fits; full speed)")
    return (DitBacking.MAPPED_STAGING, 0, False,
            f"checkpoint on {where}: a private copy ({gib(total * options.processes)}) does "
            f"not fit the {gib(max(0, room))} left, so it streams from the mapping through "
            "staging slots (page cache, reclaimable; about 2x slower per step)")


def pin_limit_for(total: int) -> int:
    """A registration budget covering ``total`` mapped bytes (page rounding included)."""
    return -(-int(total * 1.01) // (1 << 20)) << 20  # 1% for page-aligned ranges, MiB up


def _dit_holding(d: ComponentFiles, backing: DitBacking, options: LoadOptions) -> Holding:
    if backing is DitBacking.PRIVATE:
        share = d.bytes if not options.sharded else d.bytes // max(1, options.processes)
        held = "private pinned copy" if not options.sharded else "private pinned 1/N shards"
        return Holding(d.name, d.bytes, held, share * options.processes)
    if backing is DitBacking.MAPPED_REGISTERED:
        if d.in_memory:
            return Holding(d.name, d.bytes, f"its {d.filesystem} pages, registered", 0)
        return Holding(d.name, d.bytes, f"its {d.filesystem} pages, registered (locked)",
                       d.bytes)
    if backing is DitBacking.MAPPED:
        return Holding(d.name, d.bytes, f"its {d.filesystem} pages, mapped", 0)
    held = (f"its {d.filesystem} pages via staging" if d.in_memory else
            f"page cache of {d.filesystem} via staging (reclaimable)")
    return Holding(d.name, d.bytes, held, 0)


def _encoder_holdings(encoders: Sequence[ComponentFiles],
                      options: LoadOptions) -> list[Holding]:
    if not options.encoders_offloaded:
        return _resident_holdings(encoders, options)
    return [Holding(e.name, e.bytes, "pinned copy (DLO streams or parks it)",
                    e.bytes * options.processes) for e in encoders]


def _resident_holdings(parts: Sequence[ComponentFiles],
                       options: LoadOptions) -> list[Holding]:
    out = []
    for p in parts:
        if p.cast:
            out.append(Holding(p.name, p.bytes, "private while loading (cast), then device",
                               p.bytes * options.processes))
        else:
            out.append(Holding(p.name, p.bytes, f"views of its {p.filesystem} files, then "
                               "device", 0))
    return out


def _remedies(dits: Sequence[ComponentFiles], encoders: Sequence[ComponentFiles],
              others: Sequence[ComponentFiles], memory: HostMemory, options: LoadOptions,
              headroom: int) -> list[str]:
    """Each change this engine (or moving files) offers, kept when its plan fits."""
    tries: list[tuple[str, LoadOptions, Sequence[ComponentFiles], HostMemory]] = []
    if options.mmap == "off" and not options.keep_private:
        tries.append(("--dlo-checkpoint-mmap auto", replace(options, mmap="auto"),
                      encoders, memory))
    if options.pin_limit_bytes and not any(d.in_memory for d in dits):
        tries.append(("--dlo-pin-limit-gib 0 (the DiT streams from its page cache through "
                      "staging, about 2x slower)", replace(options, pin_limit_bytes=0),
                      encoders, memory))
    if options.encoders_offloaded and encoders:
        tries.append(("--dlo-components dit (text encoders resident in HBM, if the device holds "
                      "them: no pinned copy)",
                      replace(options, encoders_offloaded=False), encoders, memory))
    spilled = sum(e.bytes for e in encoders if e.in_memory)
    if spilled:
        names = ", ".join(e.name for e in encoders if e.in_memory)
        on_disk = [replace(e, filesystem="disk") if e.in_memory else e for e in encoders]
        freed = replace(memory, mem_available=memory.mem_available + spilled,
                        cgroups=tuple(replace(c, usage=max(0, c.usage - spilled))
                                      for c in memory.cgroups))
        tries.append((f"the files of {names} on a local disk instead of tmpfs (frees "
                      f"{gib(spilled)}; their page cache is reclaimable)", options, on_disk,
                      freed))
    found = []
    for label, changed, encs, mem in tries:
        if _plan(dits, encs, others, mem, changed, headroom).fits:
            found.append(label)
    return found


def _filesystems(parts: Sequence[ComponentFiles]) -> str:
    return "/".join(sorted({p.filesystem for p in parts})) or "no files"
