"""FLUX.2 [dev]'s random-weight pipelines: the tiny model and the ``init-random`` sizes.

The DiT has the family's shapes (``engine.families.flux2``: ``DIT_SIZES``); around it a
Mistral-3 text encoder (Mistral3ForConditionalGeneration, the class the released model
uses: a Mistral text model with a Pixtral vision tower) 16 wide with 30 layers - the
pipeline stacks hidden layers 10, 20 and 30, so the DiT's text input is 48 wide - or, with
``released``, Mistral-Small-3.1-24B and FLUX.2's VAE at their released shapes
(``RELEASED_COMPONENTS``). The tokenizer is built in code: a byte-level BPE without merges
(one token per byte, any UTF-8 prompt encodes) with Mistral's control tokens and a chat
template rendering diffusers' system + user messages as Mistral's does
(``[SYSTEM_PROMPT]..[/SYSTEM_PROMPT][INST]..[/INST]``). It is a plain
``PreTrainedTokenizerFast``, not the released ``PixtralProcessor``: the pipeline calls only
``apply_chat_template`` on it (the processor's image side serves prompt upsampling, which
ditserve does not serve), and a processor would need torchvision for its image processor.
The [klein] builders (``engine.families.flux2_klein.builders``) reuse the VAE, scheduler and
byte-level vocabulary here. Called through ``engine.makers.builders``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ditserve.engine.families.base import ComponentShape
from ditserve.engine.families.flux2 import DIT_SIZES, FLUX2

# Mistral's control tokens at the released tokenizer's ids ([IMG] is 10, the encoder config's
# image_token_index; [SYSTEM_PROMPT] 17).
MISTRAL_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]",
                    "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]",
                    "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
                    "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")
# Mistral's chat layout for diffusers' messages (content: a string or a list of text parts).
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% set text = namespace(v='') %}"
    "{% if m['content'] is string %}{% set text.v = m['content'] %}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'text' %}"
    "{% set text.v = text.v + c['text'] %}{% endif %}{% endfor %}{% endif %}"
    "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ text.v }}[/SYSTEM_PROMPT]"
    "{% elif m['role'] == 'user' %}[INST]{{ text.v }}[/INST]"
    "{% else %}{{ text.v }}{{ eos_token }}{% endif %}{% endfor %}"
)
TEXT_TOKENS = 512  # the pipeline pads every prompt to 512 tokens (its call default)
TINY_TEXT_WIDTH = 16  # x 3 stacked layers = the tiny DiT's joint_attention_dim (48)


def byte_level_tokenizer(specials: tuple[str, ...], *, chat_template: str, **tokens: str) -> Any:
    """A ``PreTrainedTokenizerFast``: ``specials`` first (single tokens), then one token per
    byte (byte-level BPE without merges); ``tokens``: its bos/eos/pad/unk token names."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {token: i for i, token in enumerate(specials)}
    for ch in sorted(set(bytes_to_unicode().values())):
        vocab[ch] = len(vocab)
    model = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=tokens.get("unk_token")))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    model.decoder = decoders.ByteLevel()
    named = set(tokens.values())
    return PreTrainedTokenizerFast(
        tokenizer_object=model, chat_template=chat_template, model_max_length=TEXT_TOKENS,
        additional_special_tokens=[t for t in specials if t not in named], **tokens)


def make_tokenizer() -> Any:
    """The tiny model's tokenizer (module docstring)."""
    return byte_level_tokenizer(MISTRAL_SPECIALS, chat_template=MISTRAL_TEMPLATE,
                                unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                pad_token="<pad>")


def _token_ids(tokenizer: Any) -> dict[str, Any]:
    """The text config's special-token ids in ``tokenizer``."""
    return dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)


def make_text_encoder(tokenizer: Any, *, width: int, layers: int) -> Any:
    """A Mistral-3 encoder ``width`` wide with ``layers`` text layers and a one-layer
    Pixtral tower (never run by the encode, present as in the released model)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    config = Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=width,
                         intermediate_size=24, num_hidden_layers=layers, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8,
                         max_position_embeddings=1024, sliding_window=None,
                         **_token_ids(tokenizer)),
        vision_config=dict(model_type="pixtral", hidden_size=8, intermediate_size=8,
                           num_hidden_layers=1, num_attention_heads=1, head_dim=8,
                           image_size=28, patch_size=14),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2,
        multimodal_projector_bias=False,
        tie_word_embeddings=False,  # as released (Mistral3Config's default ties them)
    )
    return Mistral3ForConditionalGeneration(config)


def scheduler() -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    # FLUX.2's scheduler config: dynamic shifting (the pipeline passes its own mu).
    return FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_image_seq_len=256, max_image_seq_len=4096,
        base_shift=0.5, max_shift=1.15, shift=3.0,
    )


def make_vae(*, latent_channels: int, widths: tuple[int, ...]) -> Any:
    """FLUX.2's VAE layout with tiny widths (each level past the first halves the side) and
    a random latent batch norm, so its denormalisation is exercised."""
    import torch
    from diffusers import AutoencoderKLFlux2

    levels = len(widths)
    vae = AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels, block_out_channels=widths,
        layers_per_block=1, latent_channels=latent_channels, norm_num_groups=8,
    )
    norm: Any = getattr(vae, "bn")  # noqa: B009  # BatchNorm2d over the patchified latents (untyped)
    with torch.no_grad():
        norm.running_mean.normal_(0.0, 0.2)
        norm.running_var.uniform_(0.5, 1.5)
    return vae


def tiny_vae() -> Any:
    """The tiny models' VAE: 4 latent channels (the tiny DiT's 16 = 4 x 2x2), 2x down."""
    return make_vae(latent_channels=4, widths=(8, 16))


def dit_vae(size: str) -> Any:
    """The VAE beside a ``size`` DiT built with tiny parts: the DiT's latent channels, 8x."""
    return make_vae(latent_channels=DIT_SIZES[size]["in_channels"] // 4, widths=(8, 8, 16, 16))


def build_tiny(variant: str, seed: int) -> Any:
    """The tiny model (``ditserve model init-tiny --family flux2``; float32)."""
    import diffusers
    import torch

    torch.manual_seed(seed)
    tokenizer = make_tokenizer()
    encoder = make_text_encoder(tokenizer, width=TINY_TEXT_WIDTH, layers=30)
    transformer = getattr(diffusers, FLUX2.dit_class)(**DIT_SIZES["tiny"])
    return getattr(diffusers, FLUX2.pipeline_class)(
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
    if released is not None:
        ids = {"text_encoder": {"text_config": _token_ids(tokenizer)}}
        parts = build_released(released, dtype=dtype, device=device, seed=seed, ids=ids)
    else:
        width = DIT_SIZES[size]["joint_attention_dim"] // 3
        parts = {"text_encoder": make_text_encoder(tokenizer, width=width, layers=30),
                 "vae": dit_vae(size)}
        parts = {name: module.to(device, dtype) for name, module in parts.items()}
    transformer = make_dit(variant, size, dtype=dtype, device=device, seed=seed)
    return getattr(diffusers, FLUX2.pipeline_class)(
        scheduler=scheduler(), tokenizer=tokenizer, transformer=transformer, **parts)
