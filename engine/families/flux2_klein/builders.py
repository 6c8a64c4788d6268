"""FLUX.2 [klein]'s random-weight pipelines: the tiny model and the ``init-random`` sizes.

FLUX.2's DiT at the variant's shapes (``engine.families.flux2_klein``: 4B and 9B), FLUX.2's
VAE and scheduler (``engine.families.flux2.builders``), and a Qwen3 causal LM: tiny (16
wide, 27 layers - the pipeline stacks layers 9, 18 and 27 - so the tiny DiT's text input is
48 wide), or with ``released`` Qwen3-4B / Qwen3-8B at their released shapes. The tokenizer
is built in code: the byte-level vocabulary of FLUX.2's builders with Qwen's chat markers
and a chat template that renders one user turn with the generation prompt and, with
``enable_thinking`` false, the empty thinking block, as Qwen3's does. Called through
``engine.makers.builders``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ditserve.engine.families.base import ComponentShape
from ditserve.engine.families.flux2.builders import (
    byte_level_tokenizer,
    make_vae,
    scheduler,
    tiny_vae,
)
from ditserve.engine.families.flux2_klein import FLUX2_KLEIN

QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
TINY_TEXT_WIDTH = 16  # x 3 stacked layers = the tiny DiT's joint_attention_dim (48)
TEXT_LAYERS = 27  # the deepest layer the pipeline reads


def make_tokenizer() -> Any:
    """The tiny model's tokenizer (module docstring)."""
    return byte_level_tokenizer(QWEN_SPECIALS, chat_template=QWEN3_TEMPLATE,
                                eos_token="<|im_end|>", pad_token="<|endoftext|>")


def make_text_encoder(tokenizer: Any, *, width: int) -> Any:
    """A Qwen3 causal LM ``width`` wide with ``TEXT_LAYERS`` layers and 8-wide heads."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=width, intermediate_size=24,
        num_hidden_layers=TEXT_LAYERS, num_attention_heads=2, num_key_value_heads=1,
        head_dim=8, max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None))


def _dit_sizes(variant: str) -> Mapping[str, Mapping[str, Any]]:
    return FLUX2_KLEIN.dit_sizes[variant]


def build_tiny(variant: str, seed: int) -> Any:
    """The tiny model (``ditserve model init-tiny --family flux2-klein``; float32)."""
    import diffusers
    import torch

    torch.manual_seed(seed)
    tokenizer = make_tokenizer()
    encoder = make_text_encoder(tokenizer, width=TINY_TEXT_WIDTH)
    transformer = getattr(diffusers, FLUX2_KLEIN.dit_class)(**_dit_sizes(variant)["tiny"])
    return getattr(diffusers, FLUX2_KLEIN.pipeline_class)(
        scheduler=scheduler(), vae=tiny_vae(), text_encoder=encoder, tokenizer=tokenizer,
        transformer=transformer)


def build_pipeline(variant: str, size: str, *, dtype: Any, device: Any, seed: int,
                   released: Mapping[str, ComponentShape] | None = None) -> Any:
    """A random pipeline with a ``size`` DiT on ``device``; around it the tiny parts (an
    encoder whose stacked layers are the DiT's text width), or the ``released`` shapes'
    parts; everything stored in ``dtype``, so the loader never casts."""
    import diffusers
    import torch

    from ditserve.engine.makers.builders import make_dit
    from ditserve.engine.makers.released import build_released

    torch.manual_seed(seed)
    tokenizer = make_tokenizer()
    config = _dit_sizes(variant)[size]
    if released is not None:
        ids = {"text_encoder": dict(pad_token_id=tokenizer.pad_token_id,
                                    eos_token_id=tokenizer.eos_token_id)}
        parts = build_released(released, dtype=dtype, device=device, seed=seed, ids=ids)
    else:
        vae = make_vae(latent_channels=config["in_channels"] // 4, widths=(8, 8, 16, 16))
        parts = {"text_encoder": make_text_encoder(
                     tokenizer, width=config["joint_attention_dim"] // 3), "vae": vae}
        parts = {name: module.to(device, dtype) for name, module in parts.items()}
    transformer = make_dit(variant, size, dtype=dtype, device=device, seed=seed)
    return getattr(diffusers, FLUX2_KLEIN.pipeline_class)(
        scheduler=scheduler(), tokenizer=tokenizer, transformer=transformer, **parts)
