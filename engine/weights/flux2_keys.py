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
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

# (diffusers module path, original module path), copied as they are.
_TOP = (
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
)
# The final modulation: BFL's (shift, scale) rows, diffusers' (scale, shift).
_SWAPPED = ("norm_out.linear", "final_layer.adaLN_modulation.1")
# Inside ``transformer_blocks.{i}.`` -> ``double_blocks.{i}.``; full keys for the norms
# (BFL's RMSNorm weight is ``scale``).
_DOUBLE = (
    ("attn.to_out.0", "img_attn.proj"),
    ("attn.to_add_out", "txt_attn.proj"),
    ("ff.linear_in", "img_mlp.0"),
    ("ff.linear_out", "img_mlp.2"),
    ("ff_context.linear_in", "txt_mlp.0"),
    ("ff_context.linear_out", "txt_mlp.2"),
)
_DOUBLE_NORMS = (
    ("attn.norm_q.weight", "img_attn.norm.query_norm.scale"),
    ("attn.norm_k.weight", "img_attn.norm.key_norm.scale"),
    ("attn.norm_added_q.weight", "txt_attn.norm.query_norm.scale"),
    ("attn.norm_added_k.weight", "txt_attn.norm.key_norm.scale"),
)
_DOUBLE_FUSED = (
    ("img_attn.qkv", ("attn.to_q", "attn.to_k", "attn.to_v")),
    ("txt_attn.qkv", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")),
)
# Inside ``single_transformer_blocks.{i}.`` -> ``single_blocks.{i}.``.
_SINGLE = (
    ("attn.to_qkv_mlp_proj", "linear1"),
    ("attn.to_out", "linear2"),
)
_SINGLE_NORMS = (
    ("attn.norm_q.weight", "norm.query_norm.scale"),
    ("attn.norm_k.weight", "norm.key_norm.scale"),
)
_PARAMS = ("weight", "bias")


def _blocks(names: Any, prefix: str) -> list[int]:
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    return sorted({int(m.group(1)) for n in names if (m := pattern.match(n))})


def to_original(state: Mapping[str, Any], *, cat: Callable[[list[Any]], Any]) -> dict[str, Any]:
    """A diffusers-named FLUX.2 state dict in BFL's names. ``cat`` joins along dim 0.

    Raises KeyError naming the tensors the table does not know (another DiT class)."""
    rest = dict(state)
    out: dict[str, Any] = {}

    def move(src: str, dst: str) -> None:
        if src in rest:
            out[dst] = rest.pop(src)

    for diffusers_path, original_path in _TOP:
        for p in _PARAMS:
            move(f"{diffusers_path}.{p}", f"{original_path}.{p}")
    for p in _PARAMS:
        if f"{_SWAPPED[0]}.{p}" in rest:
            t = rest.pop(f"{_SWAPPED[0]}.{p}")
            half = int(t.shape[0]) // 2
            out[f"{_SWAPPED[1]}.{p}"] = cat([t[half:], t[:half]])
    for i in _blocks(rest, "transformer_blocks."):
        src, dst = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for diffusers_path, original_path in _DOUBLE:
            for p in _PARAMS:
                move(f"{src}{diffusers_path}.{p}", f"{dst}{original_path}.{p}")
        for diffusers_key, original_key in _DOUBLE_NORMS:
            move(src + diffusers_key, dst + original_key)
        for fused, parts in _DOUBLE_FUSED:
            for p in _PARAMS:
                if all(f"{src}{part}.{p}" in rest for part in parts):
                    out[f"{dst}{fused}.{p}"] = cat([rest.pop(f"{src}{part}.{p}") for part in parts])
    for i in _blocks(rest, "single_transformer_blocks."):
        src, dst = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        for diffusers_path, original_path in _SINGLE:
            for p in _PARAMS:
                move(f"{src}{diffusers_path}.{p}", f"{dst}{original_path}.{p}")
        for diffusers_key, original_key in _SINGLE_NORMS:
            move(src + diffusers_key, dst + original_key)
    if rest:
        raise KeyError(f"FLUX.2 tensors with no original name: {', '.join(sorted(rest)[:5])}")
    return out
