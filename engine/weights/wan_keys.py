"""Wan's two key layouts: diffusers' names and Wan's original ones (Wan-AI's and Comfy-Org's
single files, city96's and QuantStack's GGUF files), both ways, as one table.

diffusers reads the original names with ``convert_wan_transformer_to_diffusers``: an ordered
list of substring replacements (``self_attn`` -> ``attn1``, ``.o.`` -> ``.to_out.0.``, and a
three-step swap of ``norm2``/``norm3``, since Wan's affine cross-attention norm is its
``norm3`` and diffusers' ``norm2``) with no writer. Every change is a rename - no tensor is
split, fused or reshaped - so the mapping is this table of module paths, read in either
direction; a test checks that diffusers' converter, given what ``to_original`` writes, gives
back exactly the diffusers folder's tensors (Wan 2.1 text-to-video and image-to-video).

Covers the Wan family's one-DiT models (Wan 2.1 T2V and I2V, Wan 2.2 TI2V); Wan 2.2's
two experts are two files and are refused by the callers. Loading keeps diffusers' converter
(``weights.dit_file.map_keys``); this module is what ``weights.convert`` writes with.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ditserve.engine.weights import key_tables

# A prefix ComfyUI-style files may carry before the original names.
ORIGINAL_PREFIXES = ("model.diffusion_model.",)

# (diffusers module path, original module path) outside the blocks; a key is a path plus its
# parameter name (``.weight``/``.bias``), or the path itself for a bare tensor.
_TOP = (
    ("patch_embedding", "patch_embedding"),
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    # image-to-video: the CLIP image context's projection (LayerNorm, Linear, GELU, Linear, LN)
    ("condition_embedder.image_embedder.norm1", "img_emb.proj.0"),
    ("condition_embedder.image_embedder.ff.net.0.proj", "img_emb.proj.1"),
    ("condition_embedder.image_embedder.ff.net.2", "img_emb.proj.3"),
    ("condition_embedder.image_embedder.norm2", "img_emb.proj.4"),
    ("scale_shift_table", "head.modulation"),  # the final modulation, (1, 2, dim)
    ("proj_out", "head.head"),
)
# The same inside ``blocks.{i}.``.
_BLOCK = (
    ("scale_shift_table", "modulation"),  # (1, 6, dim)
    ("attn1.to_q", "self_attn.q"),
    ("attn1.to_k", "self_attn.k"),
    ("attn1.to_v", "self_attn.v"),
    ("attn1.to_out.0", "self_attn.o"),
    ("attn1.norm_q", "self_attn.norm_q"),
    ("attn1.norm_k", "self_attn.norm_k"),
    ("attn2.to_q", "cross_attn.q"),
    ("attn2.to_k", "cross_attn.k"),
    ("attn2.to_v", "cross_attn.v"),
    ("attn2.to_out.0", "cross_attn.o"),
    ("attn2.norm_q", "cross_attn.norm_q"),
    ("attn2.norm_k", "cross_attn.norm_k"),
    ("attn2.add_k_proj", "cross_attn.k_img"),  # image-to-video: the image context's k, v
    ("attn2.add_v_proj", "cross_attn.v_img"),
    ("attn2.norm_added_k", "cross_attn.norm_k_img"),
    ("norm2", "norm3"),  # the affine norm before cross-attention (norm1, norm2: no weights)
    ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"),
)
_BLOCK_KEY = re.compile(r"blocks\.(\d+)\.(.+)")


def is_original(names: Any) -> bool:
    """Whether a key set is in Wan's original layout (prefixed or not)."""
    return any(strip_prefix(n).startswith("blocks.0.self_attn.") for n in names)


def strip_prefix(name: str) -> str:
    return key_tables.strip_prefix(name, ORIGINAL_PREFIXES)


def to_original(state: Mapping[str, Any]) -> dict[str, Any]:
    """A diffusers-named Wan state dict in Wan's original names (tensors untouched).

    Raises KeyError naming the tensors the table does not know (another DiT class)."""
    out, unknown = {}, []
    for key, value in state.items():
        name = _rename(key, to_original=True)
        if name is None:
            unknown.append(key)
        else:
            out[name] = value
    if unknown:
        raise KeyError(f"Wan tensors with no original name: {', '.join(sorted(unknown)[:5])}")
    return out


def to_diffusers(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """Original names (optionally prefixed) in diffusers' names; keys the table does not know
    are kept under their own names, for the caller's shape check to report."""
    out = {}
    for key, value in checkpoint.items():
        name = strip_prefix(key)
        out[_rename(name, to_original=False) or name] = value
    return out


def _rename(key: str, *, to_original: bool) -> str | None:
    match = _BLOCK_KEY.fullmatch(key)
    table, rest, head = (_BLOCK, match.group(2), f"blocks.{match.group(1)}.") if match \
        else (_TOP, key, "")
    for diffusers_path, original_path in table:
        src, dst = (diffusers_path, original_path) if to_original \
            else (original_path, diffusers_path)
        if rest == src or rest.startswith(src + "."):
            return head + dst + rest[len(src):]
    return None
