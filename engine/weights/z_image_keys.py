"""Z-Image's two key layouts: diffusers' names and Tongyi-MAI's original ones (Z-Image-Turbo's
single files, ComfyUI's ``z_image_turbo_*.safetensors`` and GGUF files), both ways, for any
width.

diffusers reads the original names with ``convert_z_image_transformer_checkpoint_to_diffusers``
(``weights.dit_file.map_keys`` uses it as is): substring renames (``x_embedder.`` ->
``all_x_embedder.2-1.``, ``final_layer.`` -> ``all_final_layer.2-1.``, ``attention.out`` ->
``attention.to_out.0``, ``q_norm``/``k_norm`` -> ``norm_q``/``norm_k``), the unused
``norm_final`` dropped, and each attention's fused ``qkv`` weight split in three equal row
blocks (``torch.chunk``): nothing depends on the released width, but there is no writer. This
table is what ``weights.convert`` writes with; a test checks that diffusers' converter, given
what ``to_original`` writes, gives back the folder's tensors (released shapes on meta tensors,
tiny ones by value). Every transform is along dim 0, so FP8 per-row scales map with their
weights.

The table lists only the names that differ (the rest are the same in both layouts, and kept),
so it is not a ``weights.key_tables.Layout`` (whose tables name every tensor); the q, k, v join
is that module's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ditserve.engine.weights.key_tables import Cat, pop_joined

# (diffusers prefix, original prefix) of top-level modules (the 2x2 patch's embedder and
# final layer: the released DiT has one patch size).
_TOP = (
    ("all_x_embedder.2-1.", "x_embedder."),
    ("all_final_layer.2-1.", "final_layer."),
)
# Inside every block (``noise_refiner``, ``context_refiner``, ``layers``).
_BLOCK = (
    ("attention.to_out.0.", "attention.out."),
    ("attention.norm_q.", "attention.q_norm."),
    ("attention.norm_k.", "attention.k_norm."),
)
_FUSED = ("attention.qkv.weight", ("attention.to_q.weight", "attention.to_k.weight",
                                   "attention.to_v.weight"))
_BLOCK_KEY = re.compile(r"((?:noise_refiner|context_refiner|layers)\.\d+\.)(.+)")


def to_original(state: Mapping[str, Any], *, cat: Cat) -> dict[str, Any]:
    """A diffusers-named Z-Image state dict in the original names. ``cat`` joins along dim 0."""
    out: dict[str, Any] = {}
    fused: dict[str, dict[str, Any]] = {}
    for key, value in state.items():
        match = _BLOCK_KEY.fullmatch(key)
        if match is None:
            out[_renamed(key, _TOP)] = value
            continue
        block, rest = match.groups()
        if rest in _FUSED[1]:
            fused.setdefault(block, {})[rest] = value
        else:
            out[block + _renamed(rest, _BLOCK)] = value
    for block, parts in fused.items():
        joined = pop_joined(parts, _FUSED[1], cat)
        if joined is None:
            raise KeyError(f"Z-Image block {block} has {sorted(parts)} of q, k, v only")
        out[block + _FUSED[0]] = joined
    return out


def _renamed(key: str, table: tuple[tuple[str, str], ...]) -> str:
    for diffusers_prefix, original_prefix in table:
        if key.startswith(diffusers_prefix):
            return original_prefix + key[len(diffusers_prefix):]
    return key
