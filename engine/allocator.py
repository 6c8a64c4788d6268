"""The CUDA caching allocator's settings for engine processes.

A serving engine runs steps of changing sizes (continuous batching: 2, 6, then 8 rows of a
video DiT), and with fixed-size segments the allocator keeps each size's blocks reserved
side by side. Expandable segments let one segment grow and be reused across sizes: on one
H200 a Wan2.1-14B server at max_num_seqs 4 peaked at 17.5 GiB instead of 25.7 GiB under DLO
(42.2 instead of 50.5 resident; docs/benchmarks.md). Torch reads the setting when CUDA
first allocates, so the CLI applies it before any command touches the device; a user's own
PYTORCH_CUDA_ALLOC_CONF (or torch's newer name, PYTORCH_ALLOC_CONF) is left as it is.

A numeric HBM budget also caps the allocator (``cap_reserved``): what the process reserves,
the HBM other tenants of the device see taken, never exceeds the budget.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a cap is set: the CLI reads this module first
    import torch

ALLOCATOR_ENV_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
DEFAULT_ALLOCATOR_SETTINGS = "expandable_segments:True"


def prefer_expandable_segments(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set the engine's allocator default unless the user configured the allocator; True
    when it was set here. Child processes (workers of a DP/SP group) inherit it."""
    if any(environ.get(name) for name in ALLOCATOR_ENV_NAMES):
        return False
    environ["PYTORCH_CUDA_ALLOC_CONF"] = DEFAULT_ALLOCATOR_SETTINGS
    return True


def cap_reserved(device: torch.device, budget_bytes: int) -> int:
    """Cap what torch's caching allocator may reserve on ``device`` at ``budget_bytes``
    (``set_per_process_memory_fraction``): where fragmentation would cross the cap, the
    allocator frees its cached blocks and retries instead of growing. Returns the CUDA
    index capped (``cuda`` alone is the current device; torch wants an index)."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), index)
    return index


def lift_cap(index: int) -> None:
    """The whole device back to the allocator (a cap of ``cap_reserved`` lifted)."""
    import torch

    torch.cuda.set_per_process_memory_fraction(1.0, index)
