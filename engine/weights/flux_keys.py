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

This module is Flux's table; ``weights.key_tables`` walks it both ways. Called by
``weights.dit_file`` (reading) and ``weights.convert`` (writing).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ditserve.engine.weights import key_tables
from ditserve.engine.weights.key_tables import Blocks, Cat, Fused, Layout

# diffusers' key prefixes that BFL-style files may carry before the BFL names.
BFL_PREFIXES = ("model.diffusion_model.", "diffusion_model.")

# The attention tables BFL's two generations share (FLUX.2 keeps FLUX.1's names for the
# q/k norms, the fused qkv of both streams and the final modulation; ``flux2_keys`` reuses them).
FINAL_MODULATION = ("norm_out.linear", "final_layer.adaLN_modulation.1")
DOUBLE_NORMS = (
    ("attn.norm_q.weight", "img_attn.norm.query_norm.scale"),
    ("attn.norm_k.weight", "img_attn.norm.key_norm.scale"),
    ("attn.norm_added_q.weight", "txt_attn.norm.query_norm.scale"),
    ("attn.norm_added_k.weight", "txt_attn.norm.key_norm.scale"),
)
DOUBLE_QKV = (
    Fused("img_attn.qkv", ("attn.to_q", "attn.to_k", "attn.to_v")),
    Fused("txt_attn.qkv", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")),
)
SINGLE_NORMS = (
    ("attn.norm_q.weight", "norm.query_norm.scale"),
    ("attn.norm_k.weight", "norm.key_norm.scale"),
)

_LAYOUT = Layout(
    unknown="Flux tensors with no BFL name",
    # (diffusers name, BFL name) for tensors copied as they are.
    top=(
        ("time_text_embed.timestep_embedder.linear_1", "time_in.in_layer"),
        ("time_text_embed.timestep_embedder.linear_2", "time_in.out_layer"),
        ("time_text_embed.text_embedder.linear_1", "vector_in.in_layer"),
        ("time_text_embed.text_embedder.linear_2", "vector_in.out_layer"),
        ("time_text_embed.guidance_embedder.linear_1", "guidance_in.in_layer"),
        ("time_text_embed.guidance_embedder.linear_2", "guidance_in.out_layer"),
        ("context_embedder", "txt_in"),
        ("x_embedder", "img_in"),
        ("proj_out", "final_layer.linear"),
    ),
    # The final modulation: BFL stores (shift, scale), diffusers (scale, shift).
    swapped=FINAL_MODULATION,
    blocks=(
        Blocks(
            "transformer_blocks.", "double_blocks.",
            paths=(
                ("norm1.linear", "img_mod.lin"),
                ("norm1_context.linear", "txt_mod.lin"),
                ("ff.net.0.proj", "img_mlp.0"),
                ("ff.net.2", "img_mlp.2"),
                ("ff_context.net.0.proj", "txt_mlp.0"),
                ("ff_context.net.2", "txt_mlp.2"),
                ("attn.to_out.0", "img_attn.proj"),
                ("attn.to_add_out", "txt_attn.proj"),
            ),
            keys=DOUBLE_NORMS,
            fused=DOUBLE_QKV,
        ),
        Blocks(
            "single_transformer_blocks.", "single_blocks.",
            paths=(("norm.linear", "modulation.lin"), ("proj_out", "linear2")),
            keys=SINGLE_NORMS,
            # (3 * inner + mlp, ...): q, k, v of ``inner`` rows each (``linear2``'s rows, the
            # width diffusers' converter hard-codes), then the MLP's input rows
            fused=(Fused("linear1", ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
                         rows_from="linear2.weight"),),
        ),
    ),
)


def is_bfl(names: Any) -> bool:
    """Whether a key set is in BFL's Flux layout (with or without a diffusers-style prefix)."""
    return any(strip_prefix(n).startswith("double_blocks.") for n in names)


def is_diffusers(names: Any) -> bool:
    """Whether a key set is diffusers' Flux layout."""
    names = set(names)
    return "x_embedder.weight" in names and any(
        n.startswith("single_transformer_blocks.") for n in names)


def strip_prefix(name: str) -> str:
    return key_tables.strip_prefix(name, BFL_PREFIXES)


def to_diffusers(checkpoint: Mapping[str, Any], *, cat: Cat) -> dict[str, Any]:
    """A BFL-named Flux state dict (or GGUF/FP8 tensors under BFL names) in diffusers' names.

    cat: concatenates along dim 0 (``torch.cat``); row splits use plain slicing. Keys the table
    does not know are kept under their own names, so the caller's shape check names them."""
    bfl = {strip_prefix(k): v for k, v in checkpoint.items()}
    return key_tables.to_diffusers(bfl, _LAYOUT, cat=cat)


def to_bfl(state: Mapping[str, Any], *, cat: Cat) -> dict[str, Any]:
    """A diffusers-named Flux state dict in BFL's names (the inverse of ``to_diffusers``)."""
    return key_tables.to_original(state, _LAYOUT, cat=cat)
