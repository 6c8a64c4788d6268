"""Wan image-to-video's random-weight pipelines: Wan's parts, plus a CLIP image encoder.

Around the DiT (shapes: ``engine.families.wan_i2v``): Wan's tiny UMT5 encoder, tokenizer and
VAE (``engine.families.wan.builders``); Wan 2.1 I2V adds a two-layer CLIP vision encoder as wide as
the DiT's ``image_dim`` and its image processor; Wan 2.2 TI2V as image-to-video has none
(``expand_timesteps``). With ``released``, UMT5-XXL, the variant's VAE and (Wan 2.1 I2V)
CLIP ViT-H/14's vision tower at their released shapes. Called through
``engine.makers.builders``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ditserve.engine.families.base import ComponentShape
from ditserve.engine.families.wan import builders as wan
from ditserve.engine.families.wan_i2v import TI2V_I2V, WAN_I2V


def _clip_vision(width: int, image_size: int) -> tuple[Any, Any]:
    """A CLIP vision encoder of ``width`` (Wan's image context) and its image processor."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    patch = 8 if image_size < 64 else 14
    encoder = CLIPVisionModel(CLIPVisionConfig(
        hidden_size=width, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        image_size=image_size, patch_size=patch))
    processor = CLIPImageProcessor(size={"shortest_edge": image_size},
                                   crop_size={"height": image_size, "width": image_size})
    return encoder, processor


def build_pipeline(variant: str, size: str, *, dtype: Any, device: Any, seed: int,
                   released: Mapping[str, ComponentShape] | None = None) -> Any:
    """The whole diffusers pipeline object (not saved); the DiT on ``device``."""
    import diffusers
    import torch

    from ditserve.engine.makers.builders import dit_setting, make_dit

    torch.manual_seed(seed)
    ti2v = variant == TI2V_I2V
    parts = wan.text_and_vae(variant, size, dtype=dtype, device=device, seed=seed,
                             released=released, wan22_vae=ti2v)
    if not ti2v:  # Wan 2.1 I2V: a CLIP image context as wide as the DiT's image_dim
        encoder, processor = _clip_vision(int(dit_setting(variant, size, "image_dim")),
                                          32 if size == "tiny" else 224)
        # The released encoder (CLIP ViT-H/14) when the table has it, else the tiny one.
        parts.setdefault("image_encoder", encoder.to(dtype))
        parts["image_processor"] = processor
    scheduler = diffusers.UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000,
        flow_shift=5.0 if ti2v else 3.0)  # the released 480P I2V and TI2V shifts
    dit = make_dit(variant, size, dtype=dtype, device=device, seed=seed)
    pipeline_cls = getattr(diffusers, WAN_I2V.pipeline_class)
    return pipeline_cls(scheduler=scheduler, transformer=dit, expand_timesteps=ti2v, **parts)


def build_tiny(variant: str, seed: int) -> Any:
    import torch

    return build_pipeline(variant, "tiny", dtype=torch.float32, device="cpu", seed=seed)
