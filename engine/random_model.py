"""Random-weight pipelines at chosen DiT sizes, for benchmarks (`ditserve model init-random`).

Every family of ``engine.families.MODEL_VARIANTS``: Flux here, Qwen-Image and Wan 2.x through
``model_builders`` (the same tiny-encoders-around-a-real-DiT recipe, with their released DiT
shapes at ``full``). What follows describes Flux.

``init_random(dir, family="flux", size="full")`` writes a diffusers FluxPipeline directory
whose transformer has the real Flux.1 architecture (diffusers' FluxTransformer2DModel default
config: 19 double + 38 single blocks, 3072 wide, ~11.9B parameters, guidance embedding on)
with random weights, next to deliberately tiny text encoders (their output widths match what
the DiT expects: T5 d_model 4096, CLIP hidden 768) and a tiny VAE with Flux's latent layout
(16 channels, 8x downsampling: 1024x1024 pixels -> 4096 image tokens). The DiT - the part DLO
streams and batching amortizes - is full size; everything around it costs next to nothing.

Sizes: ``full`` (the real DiT, ~24 GB in bfloat16), ``small`` (the same widths with 2 + 4
blocks and 4 heads, ~40M parameters: for CPU checks) and ``tiny`` (a few MB).

Building ``full`` allocates every parameter once, on ``device``: on a GPU it takes seconds;
on a CPU it needs ~24 GB of free RAM for bfloat16 (more for float32) and minutes of random
initialization. Writing the directory needs as much disk. Weights are never downloaded.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from ditserve.engine.errors import ConfigError
from ditserve.engine.families import MODEL_VARIANTS

log = logging.getLogger(__name__)

FAMILIES = tuple(MODEL_VARIANTS)
SIZES = ("tiny", "small", "full")
_COMPLETE_MARKER = ".ditserve-random-complete"

# FluxTransformer2DModel keyword arguments per size. "full" is diffusers' default config
# (that of FLUX.1-dev) with the guidance embedding on.
FLUX_TRANSFORMER: dict[str, dict[str, Any]] = {
    "full": dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                 attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                 pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56)),
    "small": dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=4,
                  attention_head_dim=128, num_attention_heads=4, joint_attention_dim=4096,
                  pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56)),
    "tiny": dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=2,
                 attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                 pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6)),
}
# T5 context length per size: real Flux-dev pads prompts to 512 tokens, and so do its tests.
T5_TOKENS = {"full": 512, "small": 512, "tiny": 512}  # as the released tokenizer


def _resolve_device(name: str) -> Any:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _text_encoders(*, t5_width: int, clip_width: int, t5_tokens: int) -> dict[str, Any]:
    """Tiny CLIP and T5 encoders (1-2 layers, 4 heads) whose output widths the DiT expects."""
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from ditserve.engine.tiny_model import _tokenizers

    clip_tok, t5_tok = _tokenizers()
    t5_tok.model_max_length = t5_tokens
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(clip_tok), hidden_size=clip_width, intermediate_size=37,
        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=77,
        projection_dim=32, bos_token_id=clip_tok.bos_token_id,
        eos_token_id=clip_tok.eos_token_id, pad_token_id=clip_tok.pad_token_id,
    ))
    t5 = T5EncoderModel(T5Config(
        vocab_size=len(t5_tok), d_model=t5_width, d_kv=8, d_ff=37, num_layers=1, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,  # type: ignore[call-arg]
    ))
    return {"text_encoder": clip, "tokenizer": clip_tok, "text_encoder_2": t5,
            "tokenizer_2": t5_tok}


def _vae() -> Any:
    from diffusers import AutoencoderKL

    # Flux's latent layout with tiny widths: 16 latent channels, 4 levels = 8x downsampling.
    return AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16), layers_per_block=1, latent_channels=16,
        norm_num_groups=8, scaling_factor=0.3611, shift_factor=0.1159,
        use_quant_conv=False, use_post_quant_conv=False,
    )


def _transformer(size: str, *, dtype: Any, device: Any, seed: int) -> Any:
    import torch
    from diffusers import FluxTransformer2DModel

    previous = torch.get_default_dtype()
    torch.manual_seed(seed)
    # Allocate (and randomly initialize) straight in the target dtype on the target device,
    # so "full" never needs a float32 copy (48 GB) anywhere.
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = FluxTransformer2DModel(**FLUX_TRANSFORMER[size])
    finally:
        torch.set_default_dtype(previous)
    return model.to(device="cpu", dtype=dtype).eval()  # type: ignore[attr-defined]


def init_random(
    path: str | os.PathLike[str],
    *,
    family: str = "flux",
    size: str = "full",
    dtype: str = "bfloat16",
    device: str = "auto",
    seed: int = 0,
) -> Path:
    """Write the pipeline directory (see module docstring); idempotent once complete."""
    if family not in FAMILIES:
        raise ConfigError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    if size not in SIZES:
        raise ConfigError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    target = Path(path)
    marker = target / _COMPLETE_MARKER
    wanted = {"family": family, "size": size, "dtype": dtype, "seed": seed,
              "random_weights": True}
    if marker.exists():
        found = json.loads(marker.read_text())
        if found != wanted:
            raise ConfigError(f"{str(target)!r} already holds a different random model "
                              f"({found}); choose another directory")
        return target
    from ditserve.engine.weights.loader import torch_dtype as to_torch_dtype

    started = time.perf_counter()
    pipe = _build(family, size, dtype=to_torch_dtype(dtype), device=_resolve_device(device),
                  seed=seed)
    params = sum(p.numel() for name in ("transformer", "transformer_2")
                 if getattr(pipe, name, None) is not None
                 for p in getattr(pipe, name).parameters())
    log.info("built a random %s-size %s pipeline: %.2fB DiT parameters in %.1fs", size, family,
             params / 1e9, time.perf_counter() - started)
    target.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(target, max_shard_size="5GB")
    marker.write_text(json.dumps({**wanted, "transformer_parameters": params}))
    log.info("wrote %s in %.1fs", target, time.perf_counter() - started)
    return target


def _build(family: str, size: str, *, dtype: Any, device: Any, seed: int) -> Any:
    from ditserve.engine import conditioned_builders

    if family == "flux-kontext":
        flux = _build("flux", size, dtype=dtype, device=device, seed=seed)
        return conditioned_builders.kontext_from_flux(flux, tiny=size == "tiny")
    if family in conditioned_builders.VARIANTS:
        return conditioned_builders.build_pipeline(family, size, dtype=dtype, device=device,
                                                   seed=seed)
    if family != "flux":
        from ditserve.engine.model_builders import build_pipeline

        return build_pipeline(family, size, dtype=dtype, device=device, seed=seed)
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    torch_dtype = dtype
    config = FLUX_TRANSFORMER[size]
    torch.manual_seed(seed)
    encoders = _text_encoders(t5_width=config["joint_attention_dim"],
                              clip_width=config["pooled_projection_dim"],
                              t5_tokens=T5_TOKENS[size])
    vae = _vae()
    # The small parts are stored in the same dtype so the loader never casts (casting would
    # break mmap sharing).
    for name in ("text_encoder", "text_encoder_2"):
        encoders[name] = encoders[name].to(torch_dtype)
    vae = vae.to(torch_dtype)
    transformer = _transformer(size, dtype=torch_dtype, device=device, seed=seed)
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_image_seq_len=256, max_image_seq_len=4096,
        base_shift=0.5, max_shift=1.15, shift=3.0,
    )
    return FluxPipeline(scheduler=scheduler, vae=vae, transformer=transformer, **encoders)
