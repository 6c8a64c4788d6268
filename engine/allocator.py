"""The CUDA caching allocator's settings for engine processes.

A serving engine runs steps of changing sizes (continuous batching: 2, 6, then 8 rows of a
video DiT), and with fixed-size segments the allocator keeps each size's blocks reserved
side by side. Expandable segments let one segment grow and be reused across sizes: on one
H200 a Wan2.1-14B server at max_num_seqs 4 peaked at 17.5 GiB instead of 25.7 GiB under DLO
(42.2 instead of 50.5 resident; docs/benchmarks.md). Torch reads the setting when CUDA
first allocates, so the CLI applies it before any command touches the device; a user's own
PYTORCH_CUDA_ALLOC_CONF (or torch's newer name, PYTORCH_ALLOC_CONF) is left as it is.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

ALLOCATOR_ENV_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
DEFAULT_ALLOCATOR_SETTINGS = "expandable_segments:True"


def prefer_expandable_segments(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set the engine's allocator default unless the user configured the allocator; True
    when it was set here. Child processes (workers of a DP/SP group) inherit it."""
    if any(environ.get(name) for name in ALLOCATOR_ENV_NAMES):
        return False
    environ["PYTORCH_CUDA_ALLOC_CONF"] = DEFAULT_ALLOCATOR_SETTINGS
    return True
