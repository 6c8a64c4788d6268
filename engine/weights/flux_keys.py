"""Flux's two key layouts: diffusers' names and BFL's (``flux1-dev.safetensors``, ComfyUI, city96's
GGUF files), both ways.

diffusers reads BFL files with ``convert_flux_transformer_checkpoint_to_diffusers``; it has no
writer, and it hard-codes the released width (3072: the split of each single block's
``linear1``), so it cannot read a narrower Flux (the tiny models tests use). This module is that
mapping as one table, for any width (read from the tensors: a single block's ``linear2`` has
``inner`` rows), in both directions; a test checks that ``to_diffusers`` gives exactly what
diffusers' converter gives on the released shapes.

Every transform is along dim 0 (rows) only - fused projections are concatenated row blocks and
the final modulation's halves are swapped - so the same functions map GGUF tensors (quantized
along rows' columns), FP8 weights and their per-row scales alike.

Called by ``weights.dit_file`` (reading) and ``weights.convert`` (writing).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

# diffusers' key prefixes that BFL-style files may carry before the BFL names.
BFL_PREFIXES = ("model.diffusion_model.", "diffusion_model.")

# (diffusers name, BFL name) for tensors copied as they are; {i} is the block index.
_TOP = [
    ("time_text_embed.timestep_embedder.linear_1", "time_in.in_layer"),
    ("time_text_embed.timestep_embedder.linear_2", "time_in.out_layer"),
    ("time_text_embed.text_embedder.linear_1", "vector_in.in_layer"),
    ("time_text_embed.text_embedder.linear_2", "vector_in.out_layer"),
    ("time_text_embed.guidance_embedder.linear_1", "guidance_in.in_layer"),
    ("time_text_embed.guidance_embedder.linear_2", "guidance_in.out_layer"),
    ("context_embedder", "txt_in"),
    ("x_embedder", "img_in"),
    ("proj_out", "final_layer.linear"),
]
_DOUBLE = [
    ("norm1.linear", "img_mod.lin"),
    ("norm1_context.linear", "txt_mod.lin"),
    ("ff.net.0.proj", "img_mlp.0"),
    ("ff.net.2", "img_mlp.2"),
    ("ff_context.net.0.proj", "txt_mlp.0"),
    ("ff_context.net.2", "txt_mlp.2"),
    ("attn.to_out.0", "img_attn.proj"),
    ("attn.to_add_out", "txt_attn.proj"),
]
_DOUBLE_NORMS = [
    ("attn.norm_q.weight", "img_attn.norm.query_norm.scale"),
    ("attn.norm_k.weight", "img_attn.norm.key_norm.scale"),
    ("attn.norm_added_q.weight", "txt_attn.norm.query_norm.scale"),
    ("attn.norm_added_k.weight", "txt_attn.norm.key_norm.scale"),
]
# Fused in BFL: (BFL name, the diffusers parts in row order).
_DOUBLE_FUSED: list[tuple[str, tuple[str, ...]]] = [
    ("img_attn.qkv", ("attn.to_q", "attn.to_k", "attn.to_v")),
    ("txt_attn.qkv", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")),
]
_SINGLE = [("norm.linear", "modulation.lin"), ("proj_out", "linear2")]
_SINGLE_NORMS = [
    ("attn.norm_q.weight", "norm.query_norm.scale"),
    ("attn.norm_k.weight", "norm.key_norm.scale"),
]
_SINGLE_FUSED: tuple[str, tuple[str, ...]] = ("linear1", ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"))
# The final modulation: BFL stores (shift, scale), diffusers (scale, shift).
_SWAPPED = ("norm_out.linear", "final_layer.adaLN_modulation.1")
_PARAMS = ("weight", "bias")


def is_bfl(names: Any) -> bool:
    """Whether a key set is in BFL's Flux layout (with or without a diffusers-style prefix)."""
    return any(strip_prefix(n).startswith("double_blocks.") for n in names)


def is_diffusers(names: Any) -> bool:
    """Whether a key set is diffusers' Flux layout."""
    names = set(names)
    return "x_embedder.weight" in names and any(
        n.startswith("single_transformer_blocks.") for n in names)


def strip_prefix(name: str) -> str:
    for prefix in BFL_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _block_count(names: Any, pattern: str) -> int:
    found = {int(m.group(1)) for n in names if (m := re.match(pattern, n))}
    return max(found) + 1 if found else 0


def _rows(t: Any) -> int:
    return int(t.shape[0])


def to_diffusers(checkpoint: Mapping[str, Any], *, cat: Callable[[list[Any]], Any],
                 ) -> dict[str, Any]:
    """A BFL-named Flux state dict (or GGUF/FP8 tensors under BFL names) in diffusers' names.

    cat: concatenates along dim 0 (``torch.cat``); row splits use plain slicing. Keys the table
    does not know are kept under their own names, so the caller's shape check names them."""
    bfl = {strip_prefix(k): v for k, v in checkpoint.items()}
    out: dict[str, Any] = {}

    def move(new: str, old: str) -> None:
        if old in bfl:
            out[new] = bfl.pop(old)

    for new, old in _TOP:
        for p in _PARAMS:
            move(f"{new}.{p}", f"{old}.{p}")
    for p in _PARAMS:
        if f"{_SWAPPED[1]}.{p}" in bfl:
            out[f"{_SWAPPED[0]}.{p}"] = _swap_halves(bfl.pop(f"{_SWAPPED[1]}.{p}"), cat)
    for i in range(_block_count(bfl, r"double_blocks\.(\d+)\.")):
        src, dst = f"double_blocks.{i}.", f"transformer_blocks.{i}."
        for new, old in _DOUBLE:
            for p in _PARAMS:
                move(f"{dst}{new}.{p}", f"{src}{old}.{p}")
        for new, old in _DOUBLE_NORMS:
            move(dst + new, src + old)
        for old, parts in _DOUBLE_FUSED:
            for p in _PARAMS:
                if f"{src}{old}.{p}" in bfl:
                    fused = bfl.pop(f"{src}{old}.{p}")
                    third = _rows(fused) // 3
                    for j, part in enumerate(parts):
                        out[f"{dst}{part}.{p}"] = fused[j * third:(j + 1) * third]
    for i in range(_block_count(bfl, r"single_blocks\.(\d+)\.")):
        src, dst = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
        inner = _rows(bfl[f"{src}linear2.weight"]) if f"{src}linear2.weight" in bfl else None
        for new, old in _SINGLE:
            for p in _PARAMS:
                move(f"{dst}{new}.{p}", f"{src}{old}.{p}")
        for new, old in _SINGLE_NORMS:
            move(dst + new, src + old)
        old, parts = _SINGLE_FUSED
        for p in _PARAMS:
            if f"{src}{old}.{p}" in bfl and inner is not None:
                fused = bfl.pop(f"{src}{old}.{p}")
                # (3 * inner + mlp, ...) -> q, k, v (inner rows each) and the MLP's input rows
                bounds = [0, inner, 2 * inner, 3 * inner, _rows(fused)]
                for j, part in enumerate(parts):
                    out[f"{dst}{part}.{p}"] = fused[bounds[j]:bounds[j + 1]]
    out.update(bfl)  # unknown keys: left for the shape check to report
    return out


def to_bfl(state: Mapping[str, Any], *, cat: Callable[[list[Any]], Any]) -> dict[str, Any]:
    """A diffusers-named Flux state dict in BFL's names (the inverse of ``to_diffusers``)."""
    rest = dict(state)
    out: dict[str, Any] = {}

    def move(new: str, old: str) -> None:
        if old in rest:
            out[new] = rest.pop(old)

    for old, new in _TOP:
        for p in _PARAMS:
            move(f"{new}.{p}", f"{old}.{p}")
    for p in _PARAMS:
        if f"{_SWAPPED[0]}.{p}" in rest:
            out[f"{_SWAPPED[1]}.{p}"] = _swap_halves(rest.pop(f"{_SWAPPED[0]}.{p}"), cat)
    for i in range(_block_count(rest, r"transformer_blocks\.(\d+)\.")):
        src, dst = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for old, new in _DOUBLE:
            for p in _PARAMS:
                move(f"{dst}{new}.{p}", f"{src}{old}.{p}")
        for old, new in _DOUBLE_NORMS:
            move(dst + new, src + old)
        for new, parts in _DOUBLE_FUSED:
            for p in _PARAMS:
                if all(f"{src}{part}.{p}" in rest for part in parts):
                    out[f"{dst}{new}.{p}"] = cat([rest.pop(f"{src}{part}.{p}") for part in parts])
    for i in range(_block_count(rest, r"single_transformer_blocks\.(\d+)\.")):
        src, dst = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        for old, new in _SINGLE:
            for p in _PARAMS:
                move(f"{dst}{new}.{p}", f"{src}{old}.{p}")
        for old, new in _SINGLE_NORMS:
            move(dst + new, src + old)
        new, parts = _SINGLE_FUSED
        for p in _PARAMS:
            if all(f"{src}{part}.{p}" in rest for part in parts):
                out[f"{dst}{new}.{p}"] = cat([rest.pop(f"{src}{part}.{p}") for part in parts])
    if rest:
        raise KeyError(f"Flux tensors with no BFL name: {', '.join(sorted(rest)[:5])}")
    return out


def _swap_halves(t: Any, cat: Callable[[list[Any]], Any]) -> Any:
    half = _rows(t) // 2
    return cat([t[half:], t[:half]])
