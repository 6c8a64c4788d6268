"""Reading the host plan's facts (engine/weights/host_facts.py) from fake /proc and cgroup
trees, a fake mount table, and real safetensors files."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from ditserve.engine.weights.host_facts import (
    cgroup_limits,
    component_files,
    filesystem_of,
    meminfo_available,
    read_host_memory,
)

GIB = 1 << 30
MEMINFO = "MemTotal:       131072000 kB\nMemFree:         1000 kB\nMemAvailable:   17825792 kB\n"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_meminfo_available_is_read_in_bytes() -> None:
    assert meminfo_available(MEMINFO) == 17 * GIB


def test_cgroup_v2_limits_up_the_tree(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    pod, container = root / "kubepods" / "pod1", root / "kubepods" / "pod1" / "c1"
    write(pod / "memory.max", str(64 * GIB))
    write(pod / "memory.current", str(40 * GIB))
    write(pod / "memory.stat", f"anon 1\ninactive_file {8 * GIB}\nactive_file 5\n")
    write(container / "memory.max", "max")  # no limit of its own
    write(container / "memory.current", str(30 * GIB))
    write(root / "kubepods" / "memory.max", "max")
    found = cgroup_limits("0::/kubepods/pod1/c1\n", root)
    assert [(c.path, c.limit, c.usage, c.reclaimable) for c in found] == [
        ("/kubepods/pod1", 64 * GIB, 40 * GIB, 8 * GIB)]
    assert found[0].available == 32 * GIB


def test_cgroup_namespace_reads_the_mounted_root(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    write(root / "memory.max", str(16 * GIB))
    write(root / "memory.current", str(4 * GIB))
    (found,) = cgroup_limits("0::/kubepods/pod1/c1\n", root)  # the path is not under root
    assert found.path == "/" and found.available == 12 * GIB


def test_cgroup_v1_memory_controller(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    folder = root / "memory" / "job"
    write(folder / "memory.limit_in_bytes", str(8 * GIB))
    write(folder / "memory.usage_in_bytes", str(6 * GIB))
    write(folder / "memory.stat", f"cache 1\ntotal_inactive_file {GIB}\n")
    write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712")  # unlimited
    write(root / "memory" / "memory.usage_in_bytes", str(50 * GIB))
    (found,) = cgroup_limits("5:cpu:/\n4:memory:/job\n", root)
    assert found.limit == 8 * GIB and found.available == 3 * GIB


def test_read_host_memory_takes_the_smaller_bound(tmp_path: Path) -> None:
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    write(proc / "meminfo", MEMINFO)
    write(proc / "self" / "cgroup", "0::/\n")
    write(root / "memory.max", str(10 * GIB))
    write(root / "memory.current", str(2 * GIB))
    memory = read_host_memory(proc, root)
    assert memory.mem_available == 17 * GIB and memory.available == 8 * GIB
    assert "cgroup /" in memory.source()
    write(proc / "self" / "cgroup", "")
    assert read_host_memory(proc, root).available == 17 * GIB


def mountinfo_for(path: Path, fstype: str) -> str:
    dev = os.stat(path).st_dev
    return (f"22 27 0:21 / /proc rw - proc proc rw\n"
            f"25 24 {os.major(dev)}:{os.minor(dev)} / /fake rw,relatime shared:5 - {fstype} "
            f"{fstype} rw,size=1k\n")


def test_filesystem_of_matches_the_device_number(tmp_path: Path) -> None:
    dev = os.stat(tmp_path).st_dev
    assert filesystem_of(dev, mountinfo_for(tmp_path, "tmpfs")) == "tmpfs"
    assert filesystem_of(dev, "22 27 0:21 / /proc rw - proc proc rw\n") == "unknown"


def test_component_files_bytes_cast_and_symlinked_folders(tmp_path: Path) -> None:
    folder = tmp_path / "disk" / "text_encoder"
    folder.mkdir(parents=True)
    save_file({"w": torch.zeros(64, 32, dtype=torch.float32),
               "ids": torch.zeros(10, dtype=torch.int64)}, str(folder / "model.safetensors"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "text_encoder").symlink_to(folder)  # a component spilled to another disk
    mounts = mountinfo_for(folder, "ext4")
    served = component_files(model / "text_encoder", dtype="bfloat16", mountinfo=mounts)
    assert served is not None
    assert served.name == "text_encoder" and served.filesystem == "ext4" and served.cast
    assert served.bytes == 64 * 32 * 2 + 80  # float32 served in bfloat16; int64 as stored
    same = component_files(model / "text_encoder", dtype="float32", mountinfo=mounts)
    assert same is not None and not same.cast and same.bytes == 64 * 32 * 4 + 80
    assert component_files(tmp_path / "missing", dtype="float32", mountinfo=mounts) is None


def test_a_few_float32_norms_are_not_a_cast(tmp_path: Path) -> None:
    folder = tmp_path / "transformer"
    folder.mkdir()
    save_file({"w": torch.zeros(256, 256, dtype=torch.bfloat16),
               "norm": torch.zeros(256, dtype=torch.float32)}, str(folder / "m.safetensors"))
    files = component_files(folder, dtype="bfloat16", mountinfo="")
    assert files is not None and not files.cast and files.filesystem == "unknown"
