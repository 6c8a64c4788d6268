#!/usr/bin/env python3
"""Host -> device copy bandwidth by host backing: where DLO's bytes live changes how fast they move.

For each GPU, one ``nbytes`` buffer per backing, registered with ``cudaHostRegister`` (as DLO
does), copied to the device on a side stream ``reps`` times (median GB/s):

- ``malloc``: private anonymous memory (DLO's slabs), as the kernel gives it (transparent huge
  pages where enabled); ``malloc-4k``: the same with ``MADV_NOHUGEPAGE`` (4 KiB pages only);
- ``mmap:<dir>``: a file in ``<dir>`` mapped read-only and registered with
  ``cudaHostRegisterReadOnly`` (the runtime-cache / checkpoint-mmap path): page-cache pages;
- with more than one NUMA node, ``malloc`` again with memory preferred on each node;
- ``--offsets``: the same copies starting ``k`` bytes into each buffer (safetensors files put
  tensor data at 8-byte, not page, alignment, so a mapped block's copy rarely starts on a
  page or even a 256-byte boundary).

Also prints the host facts that explain the numbers: NUMA nodes and each GPU's node, kernel,
transparent-huge-page settings. Prints a table; writes JSON to --out.

    python3 bench/h2d_backings.py --out $OUT --dirs /tmp /dev/shm
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import harness
import numpy as np
import torch

GIB = 1024**3
MADV_NOHUGEPAGE = 15
MPOL_DEFAULT, MPOL_PREFERRED = 0, 1
SYS_SET_MEMPOLICY = 238  # x86-64
REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly
LIBC = ctypes.CDLL(None, use_errno=True)


def read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "?"


def numa_nodes() -> list[int]:
    base = Path("/sys/devices/system/node")
    return sorted(int(p.name[4:]) for p in base.glob("node[0-9]*")) if base.exists() else []


def gpu_node(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return "?"
    dom = getattr(props, "pci_domain_id", 0)
    dev = getattr(props, "pci_device_id", 0)
    return read(f"/sys/bus/pci/devices/{dom:04x}:{bus:02x}:{dev:02x}.0/numa_node")


def prefer_node(node: int | None) -> None:
    if node is None:
        LIBC.syscall(SYS_SET_MEMPOLICY, MPOL_DEFAULT, None, 0)
        return
    mask = ctypes.c_ulong(1 << node)
    if LIBC.syscall(SYS_SET_MEMPOLICY, MPOL_PREFERRED, ctypes.byref(mask), 64) != 0:
        raise OSError(ctypes.get_errno(), "set_mempolicy")


def anonymous(nbytes: int, *, small_pages: bool) -> tuple[Any, int]:
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arr = np.frombuffer(buf, dtype=np.uint8)
    if small_pages:
        LIBC.madvise(ctypes.c_void_p(arr.ctypes.data), ctypes.c_size_t(nbytes), MADV_NOHUGEPAGE)
    arr[::4096] = 1  # fault every page in on this thread's node
    return (buf, arr), arr.ctypes.data


def file_mapping(directory: str, nbytes: int) -> tuple[Any, int]:
    fd, name = tempfile.mkstemp(dir=directory, prefix="h2d-")
    try:
        chunk = np.ones(64 * 2**20, dtype=np.uint8).tobytes()
        for _ in range(nbytes // len(chunk)):
            os.write(fd, chunk)
        buf = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)
        os.unlink(name)  # the mapping keeps the pages alive
    arr = np.frombuffer(buf, dtype=np.uint8)
    return (buf, arr), arr.ctypes.data


def gbps(device: torch.device, host: torch.Tensor, reps: int) -> float:
    dev = torch.empty(host.numel(), dtype=torch.uint8, device=device)
    return float(harness.copy_gbps(dev, host, torch.cuda.Stream(device=device), reps))


def measure(device: torch.device, make, flags: int, reps: int, offset: int = 0) -> float | str:
    keep, ptr = make()
    nbytes = keep[1].nbytes
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(ptr, nbytes, flags)
    if err != cudart.cudaError.success:
        return f"register failed: {cudart.cudaGetErrorString(err)}"
    try:
        with warnings.catch_warnings():  # a read-only mapping: torch warns it is not writable
            warnings.simplefilter("ignore")
            host = torch.from_numpy(keep[1])
        end = offset + (host.numel() - 4096) // 4096 * 4096  # same length for every offset
        return gbps(device, host[offset:end], reps)
    finally:
        cudart.cudaHostUnregister(ptr)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out/h2d_backings"))
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--dirs", nargs="*", default=[tempfile.gettempdir(), "/dev/shm"])
    p.add_argument("--offsets", type=int, nargs="*", default=[0, 8, 64, 256],
                   help="source start offsets in bytes")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/h2d_backings.py needs a CUDA device", file=sys.stderr)
        return 2
    nbytes = int(args.gib * GIB) // (64 * 2**20) * (64 * 2**20)
    nodes = numa_nodes()
    facts = {"kernel": platform.release(), "numa_nodes": nodes,
             "thp_enabled": read("/sys/kernel/mm/transparent_hugepage/enabled"),
             "thp_shmem_enabled": read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
             "cpus": os.cpu_count(),
             "gpus": {i: {"name": torch.cuda.get_device_name(i), "numa_node": gpu_node(i)}
                      for i in range(torch.cuda.device_count())}}
    print(json.dumps(facts), flush=True)
    backings: list[tuple[str, Any, int]] = [
        ("malloc", lambda: anonymous(nbytes, small_pages=False), 0),
        ("malloc-4k", lambda: anonymous(nbytes, small_pages=True), 0),
    ]
    for d in args.dirs:
        backings.append((f"mmap:{d}", lambda d=d: file_mapping(d, nbytes), REGISTER_READ_ONLY))
    rows: list[dict[str, Any]] = []
    for i in range(torch.cuda.device_count()):
        device = torch.device("cuda", i)
        torch.cuda.set_device(device)
        for name, make, flags in backings:
            for offset in args.offsets:
                rows.append({"gpu": i, "backing": name, "node": "default", "offset": offset,
                             "gbps": measure(device, make, flags, args.reps, offset)})
                print(rows[-1], flush=True)
        if len(nodes) > 1:
            for node in nodes:
                prefer_node(node)
                try:
                    rows.append({"gpu": i, "backing": "malloc", "node": node, "offset": 0,
                                 "gbps": measure(device, backings[0][1], 0, args.reps)})
                finally:
                    prefer_node(None)
                print(rows[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "h2d_backings.json").write_text(json.dumps({"facts": facts, "rows": rows}, indent=1))
    print(f"\n{args.gib:g} GiB per copy, median of {args.reps}\n")
    print("| GPU | backing | memory node | source offset B | GB/s |\n|---|---|---|---|---|")
    for r in rows:
        v = r["gbps"]
        print(f"| {r['gpu']} | {r['backing']} | {r['node']} | {r['offset']} | "
              f"{v if isinstance(v, str) else f'{v:.1f}'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
