"""Random-weight diffusers pipelines of the Qwen-Image and Wan families, at a chosen DiT size.

Everything is built locally from a seed; nothing is downloaded. The DiT has the size asked
for: ``full`` is the released model's architecture (Qwen-Image 20B: diffusers'
QwenImageTransformer2DModel defaults, 60 blocks 3072 wide; Wan2.1-T2V-14B: diffusers'
WanTransformer3DModel defaults, 40 blocks 5120 wide; Wan2.2-T2V-A14B: two such experts with
``boundary_ratio`` 0.875; Wan2.2-TI2V-5B: 30 blocks 3072 wide on 48 latent channels),
``small`` keeps the full widths with two blocks and few heads (CPU checks) and ``tiny`` is a
few hundred kilobytes (tests, ``ditserve model init-tiny``). Around the DiT everything is
deliberately tiny - text encoders (Qwen2.5-VL, UMT5) of one or two layers whose output width
is what the DiT expects, tokenizers built from an in-code vocabulary, VAEs with the family's
latent layout (channels, spatial and temporal factors) and a few channels - so the DiT, the
part offload streams and batching amortizes, is the only large part.

Called by ``tiny_model.init_tiny`` and ``random_model.init_random``; the bench builds DiTs
in memory with ``dit_config``.
"""

from __future__ import annotations

import string
from typing import Any

from ditserve.engine.errors import ConfigError
from ditserve.engine.families import MODEL_VARIANTS

# The variants built here (Flux's builders live in tiny_model / random_model, the
# image-conditioned ones in conditioned_builders, which takes its DiTs from here).
VARIANTS: tuple[str, ...] = tuple(v for v, family in MODEL_VARIANTS.items()
                                  if family in ("qwen-image", "wan"))
SIZES = ("tiny", "small", "full")

_QWEN_FULL: dict[str, Any] = {}  # diffusers' defaults are Qwen-Image's released DiT
_WAN_FULL: dict[str, Any] = {}  # diffusers' defaults are Wan2.1-T2V-14B's (and each A14B expert)
DIT_CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    "qwen-image": {
        "full": _QWEN_FULL,
        "small": dict(num_layers=2, num_attention_heads=4),
        "tiny": dict(num_layers=2, attention_head_dim=16, num_attention_heads=2,
                     joint_attention_dim=32, axes_dims_rope=(4, 6, 6)),
    },
    "wan": {
        "full": _WAN_FULL,
        "small": dict(num_layers=2, num_attention_heads=4),
        "tiny": dict(num_attention_heads=2, attention_head_dim=12, text_dim=32, freq_dim=32,
                     ffn_dim=32, num_layers=2, rope_max_seq_len=32),
    },
    "wan2.2-ti2v": {
        "full": dict(num_attention_heads=24, in_channels=48, out_channels=48, ffn_dim=14336,
                     num_layers=30),
        "small": dict(num_attention_heads=4, in_channels=48, out_channels=48, ffn_dim=14336,
                      num_layers=2),
        "tiny": dict(num_attention_heads=2, attention_head_dim=12, in_channels=48,
                     out_channels=48, text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2,
                     rope_max_seq_len=32),
    },
}
DIT_CONFIGS["wan2.2"] = DIT_CONFIGS["wan"]
# Image-to-video DiTs (built by conditioned_builders): Wan2.1-I2V-14B takes 16 noise + 4 mask
# + 16 condition channels and a CLIP ViT-H image context (1280 wide); TI2V-5B is unchanged.
_I2V = dict(in_channels=36, out_channels=16)
DIT_CONFIGS["wan-i2v"] = {
    "full": dict(_I2V, image_dim=1280, added_kv_proj_dim=5120),
    "small": dict(_I2V, num_layers=2, num_attention_heads=4, image_dim=1280,
                  added_kv_proj_dim=512),
    "tiny": dict(DIT_CONFIGS["wan"]["tiny"], **_I2V, image_dim=32, added_kv_proj_dim=24),
}
DIT_CONFIGS["wan2.2-ti2v-i2v"] = DIT_CONFIGS["wan2.2-ti2v"]
# The tokenizers' model_max_length: the released models' 512 at every size, so a tiny model
# encodes prompts exactly as the released pipeline's defaults do (max_sequence_length 512).
TEXT_TOKENS = 512
WAN22_BOUNDARY_RATIO = 0.875  # Wan2.2-T2V-A14B: the high-noise expert runs t >= 875


def check(variant: str, size: str) -> None:
    if variant not in VARIANTS and variant not in DIT_CONFIGS:
        raise ConfigError(f"family must be one of flux, {', '.join(VARIANTS)}, got {variant!r}")
    if size not in SIZES:
        raise ConfigError(f"size must be one of {', '.join(SIZES)}, got {size!r}")


def dit_class(variant: str) -> Any:
    import diffusers

    return (diffusers.QwenImageTransformer2DModel if variant == "qwen-image"
            else diffusers.WanTransformer3DModel)


def dit_config(variant: str, size: str) -> dict[str, Any]:
    """The DiT's keyword arguments (full size: the class defaults, i.e. the released model)."""
    check(variant, size)
    return dict(DIT_CONFIGS[variant][size])


def make_dit(variant: str, size: str, *, dtype: Any, device: Any, seed: int) -> Any:
    """One random DiT on ``device``, allocated and initialized in ``dtype`` there (so a full
    one never needs a float32 copy), in the dtypes an ordinary load gives: the class's
    keep-in-float32 modules (Wan's norms and modulation tables) in float32."""
    import torch

    from ditserve.engine.weights.loader import keeps_float32

    previous = torch.get_default_dtype()
    torch.manual_seed(seed)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            cls = dit_class(variant)
            model = cls(**dit_config(variant, size))
    finally:
        torch.set_default_dtype(previous)
    for name, p in model.named_parameters():
        if keeps_float32(cls, name) and p.is_floating_point():
            p.data = p.data.float()
    return model.eval().requires_grad_(False)


def build_dit(variant: str, size: str, *, dtype: Any, device: Any, seed: int) -> Any:
    """``make_dit``, returned on the CPU (what the builders save)."""
    return make_dit(variant, size, dtype=dtype, device=device, seed=seed).to(device="cpu")


def _text_width(variant: str, size: str) -> int:
    config = {**_defaults(variant), **dit_config(variant, size)}
    return int(config["joint_attention_dim" if variant == "qwen-image" else "text_dim"])


def _defaults(variant: str) -> dict[str, Any]:
    import inspect

    signature = inspect.signature(dit_class(variant).__init__)
    return {k: p.default for k, p in signature.parameters.items()
            if p.default is not inspect.Parameter.empty}


def _qwen_tokenizer() -> Any:
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    # Byte-level BPE without merges: one token per byte, any UTF-8 prompt encodes.
    vocab = {ch: i for i, ch in enumerate(sorted(set(bytes_to_unicode().values())))}
    vocab["<|endoftext|>"] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[])
    # The chat template's markers as single tokens, as in Qwen2.5-VL's tokenizer.
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tokenizer


def _qwen_text_encoder(tokenizer: Any, width: int) -> Any:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    heads = 2 if width <= 64 else max(1, width // 128)
    half = width // heads // 2  # multimodal RoPE: the sections cover half a head
    sections = [half - 2 * (half // 3), half // 3, half // 3]
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=width, intermediate_size=37,
            num_hidden_layers=1 if width > 64 else 2, num_attention_heads=heads,
            num_key_value_heads=1, max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "mrope_section": sections,
                             "rope_theta": 1000000.0},
            bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                           out_hidden_size=width, fullatt_block_indexes=[0]),
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def _t5_tokenizer(tokens: int = TEXT_TOKENS) -> Any:
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in string.ascii_letters + string.digits + string.punctuation]
    # extra_ids=0: the default adds 100 sentinel tokens the tiny embedding would not cover.
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=tokens)


def _umt5(tokenizer: Any, width: int) -> Any:
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=width, d_kv=8, d_ff=37,
        num_layers=1 if width > 64 else 2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,  # type: ignore[call-arg]
    ))


def _qwen_vae() -> Any:
    from diffusers import AutoencoderKLQwenImage

    # Qwen-Image's latent layout: 16 channels, 8x spatial (three downsamplings), one frame.
    return AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                  temperal_downsample=[False, True, True])


def _wan_vae(ti2v: bool) -> Any:
    from diffusers import AutoencoderKLWan

    if ti2v:  # Wan 2.2's VAE: 48 channels, 16x spatial (2x2 patchified pixels), 4x temporal
        return AutoencoderKLWan(
            base_dim=8, decoder_base_dim=8, z_dim=48, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
            temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
            out_channels=12, patch_size=2, scale_factor_spatial=16,
            latents_mean=[0.0] * 48, latents_std=[1.0] * 48)
    # Wan 2.1's layout: 16 channels, 8x spatial, 4x temporal.
    return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True])


def build_pipeline(variant: str, size: str, *, dtype: Any, device: Any, seed: int) -> Any:
    """The whole diffusers pipeline object (not saved); small parts in ``dtype`` too."""
    import torch
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        UniPCMultistepScheduler,
        WanPipeline,
    )

    check(variant, size)
    torch.manual_seed(seed)
    width = _text_width(variant, size)
    if variant == "qwen-image":
        tokenizer = _qwen_tokenizer()
        parts: dict[str, Any] = {"tokenizer": tokenizer,
                                 "text_encoder": _qwen_text_encoder(tokenizer, width),
                                 "vae": _qwen_vae()}
        # Qwen-Image's released scheduler: resolution-dependent exponential time shift.
        scheduler: Any = FlowMatchEulerDiscreteScheduler(
            base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9,
            num_train_timesteps=1000, shift=1.0, shift_terminal=0.02,
            time_shift_type="exponential", use_dynamic_shifting=True)
    else:
        tokenizer = _t5_tokenizer()
        parts = {"tokenizer": tokenizer, "text_encoder": _umt5(tokenizer, width),
                 "vae": _wan_vae(variant == "wan2.2-ti2v")}
        scheduler = UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000,
            flow_shift=5.0 if variant == "wan2.2-ti2v" else 3.0)
    for name in ("text_encoder", "vae"):
        parts[name] = parts[name].to(dtype)  # stored as served: the loader never casts
    dit = build_dit(variant, size, dtype=dtype, device=device, seed=seed)
    if variant == "qwen-image":
        return QwenImagePipeline(scheduler=scheduler, transformer=dit, **parts)
    extra: dict[str, Any] = {}
    if variant == "wan2.2":
        extra = {"transformer_2": build_dit(variant, size, dtype=dtype, device=device,
                                            seed=seed + 1),
                 "boundary_ratio": WAN22_BOUNDARY_RATIO}
    if variant == "wan2.2-ti2v":
        extra = {"expand_timesteps": True}
    return WanPipeline(scheduler=scheduler, transformer=dit, **parts, **extra)
