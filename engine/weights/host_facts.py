"""The facts ``host_fit`` plans with, read from this host: memory and the model's files.

- ``read_host_memory``: ``MemAvailable`` from ``/proc/meminfo`` and every memory cgroup
  limit above this process (v2 ``memory.max`` / ``memory.current`` / ``inactive_file``
  walking up to the mounted root; v1 ``memory.limit_in_bytes`` / ``usage_in_bytes`` /
  ``total_inactive_file``), so a pod's limit bounds what counts as available;
- ``component_files``: a component folder's bytes in the serving dtype (from the
  safetensors headers, nothing mapped), whether loading casts it, and the filesystem its
  files are on (``/proc/self/mountinfo``, matched by device number, after symlinks: a model
  directory may link a component to another disk).

Each reader takes its roots as arguments (tests pass fake trees). Called by ``weights.load``.
"""

from __future__ import annotations

import os
from pathlib import Path

from ditserve.cachectl.st_header import SERVING_DTYPES, read_header
from ditserve.engine.weights.host_fit import ComponentFiles
from ditserve.engine.weights.host_memory import CgroupMemory, HostMemory

# Written as the cgroup's memory.max when there is no limit (v2), or a page-rounded
# LONG_MAX (v1): anything this large is "unlimited".
UNLIMITED = 1 << 60
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def meminfo_available(text: str) -> int:
    """``MemAvailable`` of a ``/proc/meminfo`` text, in bytes."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "MemAvailable":
            number, *unit = value.split()
            return int(number) * (1024 if unit and unit[0].lower() == "kb" else 1)
    raise ValueError("/proc/meminfo has no MemAvailable line (a kernel older than 3.14)")


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_limits(proc_cgroup: str, cgroup_root: Path) -> tuple[CgroupMemory, ...]:
    """Every limited memory cgroup from this process's up to the mounted root."""
    found: list[CgroupMemory] = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: the unified hierarchy
            found += _walk(cgroup_root, path, "memory.max", "memory.current",
                           "memory.stat", "inactive_file")
        elif "memory" in controllers.split(","):
            found += _walk(cgroup_root / "memory", path, "memory.limit_in_bytes",
                           "memory.usage_in_bytes", "memory.stat", "total_inactive_file")
    return tuple(found)


def _walk(root: Path, path: str, limit_file: str, usage_file: str, stat_file: str,
          reclaimable_key: str) -> list[CgroupMemory]:
    if not root.is_dir():
        return []
    # Inside a cgroup namespace the mounted root already is this process's cgroup, and the
    # path read from /proc names a folder that does not exist under it.
    parts = [p for p in path.strip("/").split("/") if p]
    while parts and not (root.joinpath(*parts)).is_dir():
        parts = parts[1:]
    out = []
    while True:
        folder = root.joinpath(*parts)
        limit = _read_int(folder / limit_file)
        usage = _read_int(folder / usage_file)
        if limit is not None and usage is not None and limit < UNLIMITED:
            out.append(CgroupMemory("/" + "/".join(parts), limit, usage,
                                    _stat_value(folder / stat_file, reclaimable_key)))
        if not parts:
            return out
        parts = parts[:-1]


def read_host_memory(proc: Path = Path("/proc"),
                     cgroup_root: Path = Path("/sys/fs/cgroup")) -> HostMemory:
    """This host's available memory, bounded by this process's cgroup limits."""
    available = meminfo_available((proc / "meminfo").read_text())
    try:
        own = (proc / "self" / "cgroup").read_text()
    except OSError:
        own = ""
    return HostMemory(available, cgroup_limits(own, cgroup_root))


def read_mountinfo(proc: Path = Path("/proc")) -> str:
    """This process's mount table (empty when unreadable: filesystems read "unknown")."""
    try:
        return (proc / "self" / "mountinfo").read_text()
    except OSError:
        return ""


def filesystem_of(device: int, mountinfo: str) -> str:
    """The filesystem type of a file's device number (``st_dev``) in a mountinfo text."""
    wanted = f"{os.major(device)}:{os.minor(device)}"
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) < 7 or fields[2] != wanted or "-" not in fields[6:]:
            continue
        return fields[fields.index("-", 6) + 1]
    return "unknown"


def component_files(folder: Path, *, dtype: str, mountinfo: str,
                    name: str | None = None) -> ComponentFiles | None:
    """A component's checkpoint (see module docstring); None without safetensors files."""
    paths = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not paths:
        return None
    served = ITEMSIZE.get(dtype)
    total, native, filesystems = 0, 0, set()
    stored: dict[str, int] = {}  # floating bytes stored in another dtype, by its name
    for path in paths:
        real = path.resolve()
        filesystems.add(filesystem_of(os.stat(real).st_dev, mountinfo))
        tensors, _, _ = read_header(real)
        for tensor in tensors.values():
            kind = SERVING_DTYPES.get(tensor.dtype)
            if kind is None or served is None or kind == dtype:
                total += tensor.nbytes
                native += tensor.nbytes if kind == dtype else 0
                continue
            stored[kind] = stored.get(kind, 0) + tensor.nbytes
            total += tensor.nbytes // ITEMSIZE[kind] * served
    # A cast when most floating bytes are stored in another dtype: a few float32 norms in a
    # bfloat16 checkpoint are the model's own (kept in float32 by diffusers), not a cast.
    cast = bool(stored) and max(stored.values()) > native
    return ComponentFiles(name or folder.name, total, "/".join(sorted(filesystems)), cast)
