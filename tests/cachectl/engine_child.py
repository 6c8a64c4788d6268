"""An engine process's DLO host backing, as a pod sees it (run by test_engine_pod.py, often in
a mount namespace where the model and the cache root are read-only bind mounts elsewhere).

    engine_child.py MODEL_DIR CACHE_ROOT    prepare the DiT with --dlo-runtime-cache; print JSON
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ditserve.engine.config import OffloadConfig
from ditserve.engine.weights.backing_choice import prepare_dit


def mapped_ranges(under: Path) -> list[tuple[int, int, str]]:
    """(start, end, path) of this process's mappings of files below ``under``."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith(str(under)):
            start, end = (int(x, 16) for x in parts[0].split("-"))
            out.append((start, end, parts[5]))
    return out


def main(model: Path, root: Path) -> None:
    offload = OffloadConfig(enabled=True, runtime_cache=True, cache_root=str(root))
    dit, plan = prepare_dit(model, dtype="float32", offload=offload)
    ranges = mapped_ranges(root)
    tensors = list(dit.state_dict().values())
    inside = sum(any(s <= t.data_ptr() < e for s, e, _ in ranges) for t in tensors if t.numel())
    print(json.dumps({
        "kind": str(plan.kind), "reason": plan.reason,
        "skipped_load": plan.skipped_materialization,
        "tensors": sum(1 for t in tensors if t.numel()), "in_entry_mapping": inside,
        "mapped_files": sorted({p for _, _, p in ranges}),
    }), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
