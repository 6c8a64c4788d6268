"""The embedded default model: a tiny, random-weight Flux pipeline in diffusers format.

Used by `ditserve demo`, `ditserve serve` without `--model`, the tests and CI. Everything is
built locally from a fixed seed (tokenizers from an in-code vocabulary), so nothing is ever
downloaded. ``init_random`` builds the same layout at real Flux size for benchmarks.
``init_tiny(path, family=...)`` writes the other families' tiny models (Qwen-Image, Wan 2.1,
Wan 2.2 with two experts, Wan 2.2 TI2V; built by ``model_builders``) the same way.
"""

from __future__ import annotations

import json
import os
import string
from pathlib import Path

TINY_SEED = 0
# The released Flux.1 T5 tokenizer's model_max_length (and FluxPipeline's default
# max_sequence_length): a tiny model encodes prompts as a default diffusers call does.
TINY_MAX_SEQUENCE_LENGTH = 512
_COMPLETE_MARKER = ".ditserve-tiny-complete"


def default_tiny_dir() -> Path:
    """Where `demo` and `serve` keep the embedded model: $DITSERVE_HOME or ~/.cache/ditserve."""
    home = os.environ.get("DITSERVE_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ditserve"
    )
    return Path(home) / "tiny-flux"


def _tokenizers():  # type: ignore[no-untyped-def]
    from transformers import CLIPTokenizer, T5Tokenizer

    # Byte-level BPE with no merges is a character-level tokenizer; good enough for random weights.
    chars = [chr(c) for c in range(33, 127)]
    vocab = {c: i for i, c in enumerate(chars)} | {c + "</w>": 94 + i for i, c in enumerate(chars)}
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    clip = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in string.ascii_letters + string.digits + string.punctuation]
    # extra_ids=0: the default adds 100 sentinel tokens the tiny embedding would not cover.
    t5 = T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=TINY_MAX_SEQUENCE_LENGTH)
    return clip, t5


def _build_pipeline(*, transformer_kwargs: dict[str, object], seed: int):  # type: ignore[no-untyped-def]
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    clip_tok, t5_tok = _tokenizers()
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(clip_tok), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=77, projection_dim=32,
            bos_token_id=clip_tok.bos_token_id, eos_token_id=clip_tok.eos_token_id,
            pad_token_id=clip_tok.pad_token_id,
        )
    )
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=len(t5_tok), d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,  # type: ignore[call-arg]
        )
    )
    transformer = FluxTransformer2DModel(**transformer_kwargs)  # type: ignore[arg-type]
    vae = AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16), latent_channels=4, norm_num_groups=8,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
    )
    # Dynamic shifting as in real Flux checkpoints, so the mu/shift code path is exercised.
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_image_seq_len=256, max_image_seq_len=4096,
        base_shift=0.5, max_shift=1.15, shift=3.0,
    )
    return FluxPipeline(
        scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=clip_tok,
        text_encoder_2=t5, tokenizer_2=t5_tok, transformer=transformer,
    )


TINY_TRANSFORMER = dict(
    patch_size=1, in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=16,
    num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
    axes_dims_rope=(4, 6, 6), guidance_embeds=True,
)




def _build_tiny(family: str, seed: int):  # type: ignore[no-untyped-def]
    from ditserve.engine import conditioned_builders

    if family in ("flux", "flux-kontext"):
        flux = _build_pipeline(transformer_kwargs=TINY_TRANSFORMER, seed=seed)
        return flux if family == "flux" else conditioned_builders.kontext_from_flux(flux,
                                                                                    tiny=True)
    import torch

    if family in conditioned_builders.VARIANTS:
        return conditioned_builders.build_pipeline(family, "tiny", dtype=torch.float32,
                                                   device="cpu", seed=seed)

    from ditserve.engine.model_builders import build_pipeline

    return build_pipeline(family, "tiny", dtype=torch.float32, device="cpu", seed=seed)


def init_tiny(
    path: str | os.PathLike[str], *, family: str = "flux", seed: int = TINY_SEED
) -> Path:
    """Write a tiny pipeline of ``family`` to ``path`` (about 1 MB). Idempotent once complete.

    Safe when several processes ask at once (the demo, a server and its workers): one builds
    into a temporary sibling under a file lock and renames it into place.
    """
    from ditserve.engine.families import MODEL_VARIANTS

    if family not in MODEL_VARIANTS:
        from ditserve.engine.errors import ConfigError

        raise ConfigError(f"family must be one of {', '.join(MODEL_VARIANTS)}, got {family!r}")
    import shutil
    import tempfile

    from filelock import FileLock

    target = Path(path)
    if (target / _COMPLETE_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / _COMPLETE_MARKER).exists():
            return target
        pipe = _build_tiny(family, seed)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            pipe.save_pretrained(staging)
            (staging / _COMPLETE_MARKER).write_text(
                json.dumps({"family": family, "seed": seed, "random_weights": True}))
            if target.exists():  # an incomplete leftover from an interrupted older version
                shutil.rmtree(target)
            staging.rename(target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target


def ensure_tiny(path: str | os.PathLike[str] | None = None) -> Path:
    """The embedded model's directory, created on first use."""
    return init_tiny(path or default_tiny_dir())
