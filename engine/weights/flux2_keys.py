"""FLUX.2's two key layouts: diffusers' names and BFL's original ones (``flux2-dev.safetensors``,
ComfyUI's files, city96-style GGUF files), both ways, for any width.

diffusers reads BFL's names with ``convert_flux2_transformer_checkpoint_to_diffusers``
(``weights.dit_file.map_keys`` uses it as is): renames, the double blocks' fused ``qkv``
split in three equal row blocks (``torch.chunk``), and the final modulation's halves swapped
(BFL stores shift then scale). Nothing depends on the released width (the single blocks'
``linear1`` stays fused in diffusers too), but the converter has no writer: this table is
what ``weights.convert`` writes with, and a test checks that diffusers' converter, given what
``to_original`` writes, gives back the folder's tensors (released shapes on meta tensors,
tiny ones by value). Every transform is along dim 0 (rows), so FP8 per-row scales map with
their weights. FLUX.2 [klein] is the same DiT class (no guidance embedder): the same names.
The table is a ``weights.key_tables.Layout``, which that module walks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ditserve.engine.weights import key_tables
from ditserve.engine.weights.flux_keys import (
    DOUBLE_NORMS,
    DOUBLE_QKV,
    FINAL_MODULATION,
    SINGLE_NORMS,
)
from ditserve.engine.weights.key_tables import Blocks, Cat, Layout

_LAYOUT = Layout(
    unknown="FLUX.2 tensors with no original name",
    # (diffusers module path, original module path), copied as they are.
    top=(
        ("x_embedder", "img_in"),
        ("context_embedder", "txt_in"),
        ("time_guidance_embed.timestep_embedder.linear_1", "time_in.in_layer"),
        ("time_guidance_embed.timestep_embedder.linear_2", "time_in.out_layer"),
        ("time_guidance_embed.guidance_embedder.linear_1", "guidance_in.in_layer"),
        ("time_guidance_embed.guidance_embedder.linear_2", "guidance_in.out_layer"),
        ("double_stream_modulation_img.linear", "double_stream_modulation_img.lin"),
        ("double_stream_modulation_txt.linear", "double_stream_modulation_txt.lin"),
        ("single_stream_modulation.linear", "single_stream_modulation.lin"),
        ("proj_out", "final_layer.linear"),
    ),
    # The final modulation: BFL's (shift, scale) rows, diffusers' (scale, shift).
    swapped=FINAL_MODULATION,
    blocks=(
        # Full keys for the norms (BFL's RMSNorm weight is ``scale``).
        Blocks(
            "transformer_blocks.", "double_blocks.",
            paths=(
                ("attn.to_out.0", "img_attn.proj"),
                ("attn.to_add_out", "txt_attn.proj"),
                ("ff.linear_in", "img_mlp.0"),
                ("ff.linear_out", "img_mlp.2"),
                ("ff_context.linear_in", "txt_mlp.0"),
                ("ff_context.linear_out", "txt_mlp.2"),
            ),
            keys=DOUBLE_NORMS,
            fused=DOUBLE_QKV,
        ),
        # The single blocks' fused projection is one tensor in diffusers too: a rename.
        Blocks(
            "single_transformer_blocks.", "single_blocks.",
            paths=(("attn.to_qkv_mlp_proj", "linear1"), ("attn.to_out", "linear2")),
            keys=SINGLE_NORMS,
        ),
    ),
)


def to_original(state: Mapping[str, Any], *, cat: Cat) -> dict[str, Any]:
    """A diffusers-named FLUX.2 state dict in BFL's names. ``cat`` joins along dim 0.

    Raises KeyError naming the tensors the table does not know (another DiT class)."""
    return key_tables.to_original(state, _LAYOUT, cat=cat)
