"""`init-random --components all`: every component around the DiT at its released shape.

Two proofs without building billions of parameters on a CPU: the families' released tables
built on the meta device have the published sizes (and the built modules' configs are the
tables'), and scaled-down tables of the same keys, written to disk around a tiny DiT, come
back in each component's config.json exactly as asked and load and generate through the
engine."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest
import torch

from ditserve.engine.errors import ConfigError
from ditserve.engine.families.base import ComponentShape
from ditserve.engine.makers.builders import VARIANTS, build_pipeline, released_shapes
from ditserve.engine.makers.random_model import default_components, init_random

# Published bf16 sizes (GB) of the released components, +-2%: T5 v1.1 XXL's encoder 9.52,
# CLIP ViT-L/14's text tower 0.246, Flux's VAE 0.168, Qwen2.5-VL-7B-Instruct 16.58,
# UMT5-XXL's encoder 11.36, the Wan 2.1 VAE 0.254, Wan 2.2's 1.41, CLIP ViT-H/14's vision
# tower 1.26.
PUBLISHED_GB = {
    ("flux", "text_encoder"): 0.246, ("flux", "text_encoder_2"): 9.52, ("flux", "vae"): 0.168,
    ("qwen-image", "text_encoder"): 16.58, ("qwen-image", "vae"): 0.254,
    ("wan", "text_encoder"): 11.36, ("wan", "vae"): 0.254,
    ("wan2.2-ti2v", "vae"): 1.41, ("wan-i2v", "image_encoder"): 1.26,
    ("z-image", "vae"): 0.168,  # Flux's VAE
    # Mistral-Small-3.1-24B (24.0B parameters, untied head), Qwen3-4B (4.02B, tied), Qwen3-8B
    # (8.19B): FLUX.2 [dev]'s and [klein]'s encoders.
    ("flux2", "text_encoder"): 48.0, ("flux2-klein", "text_encoder"): 8.04,
    ("flux2-klein-9b", "text_encoder"): 16.38,
    ("cosmos3", "vae"): 1.41,
}
NO_TEXT_ENCODER = ("cosmos3", "cosmos3-super")  # the DiT reads the prompt's tokens itself


def _subset(table: Mapping[str, Any], found: Mapping[str, Any], where: str) -> None:
    """Every value of ``table`` is ``found``'s (nested mappings key by key)."""
    for key, value in table.items():
        assert key in found, f"{where}: {key} missing"
        if isinstance(value, Mapping):
            _subset(value, found[key], f"{where}.{key}")
        else:
            wanted = list(value) if isinstance(value, tuple) else value
            got = list(found[key]) if isinstance(found[key], tuple) else found[key]
            assert got == wanted, f"{where}.{key}: {got!r} != {wanted!r}"


def _config_of(module: Any) -> dict[str, Any]:
    config = module.config
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


@pytest.mark.parametrize("variant", VARIANTS)
def test_full_build_has_the_released_shapes(variant: str) -> None:
    pipe = build_pipeline(variant, "full", dtype=torch.bfloat16, device="meta", seed=0,
                          components="all")
    table = released_shapes(variant)
    for name, shape in table.items():
        module = getattr(pipe, name)
        assert type(module).__name__ == shape.model_class
        _subset(shape.config, _config_of(module), f"{variant}.{name}")
        gb = sum(p.numel() * p.element_size() for p in module.parameters()) / 1e9
        published = PUBLISHED_GB.get((variant, name))
        if published is not None:
            assert abs(gb - published) <= 0.02 * published, f"{variant}.{name}: {gb:.3f} GB"


def test_every_family_names_its_text_encoders_and_vae() -> None:
    for variant in VARIANTS:
        named = {"vae"} if variant in NO_TEXT_ENCODER else {"text_encoder", "vae"}
        assert named <= set(released_shapes(variant)), variant
    assert set(released_shapes("flux")) == {"text_encoder", "text_encoder_2", "vae"}
    assert "image_encoder" in released_shapes("wan-i2v")


# Scaled-down tables: the released tables' keys, widths a tiny DiT takes (its text width 32).
_QWEN3_SMALL = dict(vocab_size=300, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                    max_position_embeddings=2048)
_SMALL: dict[str, dict[str, dict[str, Any]]] = {
    "flux": {
        "text_encoder": dict(vocab_size=300, hidden_size=32, intermediate_size=37,
                             num_hidden_layers=2, num_attention_heads=4, projection_dim=32),
        "text_encoder_2": dict(vocab_size=300, d_model=32, d_kv=8, d_ff=37, num_layers=2,
                               num_heads=4),
        "vae": dict(block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=8,
                    sample_size=64),
    },
    "qwen-image": {
        "text_encoder": dict(
            text_config=dict(vocab_size=300, hidden_size=32, intermediate_size=37,
                             num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, max_position_embeddings=2048,
                             rope_parameters={"rope_type": "default", "mrope_section": [4, 2, 2],
                                              "rope_theta": 1000000.0}),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                               out_hidden_size=32, fullatt_block_indexes=[0])),
        "vae": dict(base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1),
    },
    "wan": {
        "text_encoder": dict(vocab_size=300, d_model=32, d_kv=8, d_ff=37, num_layers=2,
                             num_heads=4),
        "vae": dict(base_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=1),
    },
    "z-image": {
        "text_encoder": _QWEN3_SMALL,
        "vae": dict(block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=8,
                    sample_size=64),
    },
}
# FLUX.2: the text width 16 (x 3 stacked layers = the tiny DiT's 48), as many layers as the
# pipelines read (Mistral's 30th, Qwen3's 27th), the tiny DiT's 4 latent channels.
_FLUX2_VAE = dict(block_out_channels=[8, 16], down_block_types=["DownEncoderBlock2D"] * 2,
                  up_block_types=["UpDecoderBlock2D"] * 2, layers_per_block=1,
                  norm_num_groups=8, latent_channels=4, sample_size=64)
_SMALL["flux2"] = {
    "text_encoder": dict(
        text_config=dict(vocab_size=300, hidden_size=16, intermediate_size=24,
                         num_hidden_layers=30, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=8, max_position_embeddings=1024),
        vision_config=dict(hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                           num_attention_heads=1, head_dim=8, image_size=28)),
    "vae": _FLUX2_VAE,
}
_SMALL["flux2-klein"] = _SMALL["flux2-klein-9b"] = {
    "text_encoder": dict(vocab_size=300, hidden_size=16, intermediate_size=24,
                         num_hidden_layers=27, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=8, max_position_embeddings=1024),
    "vae": _FLUX2_VAE,
}
# The edit layouts: Qwen-Image's parts (the text encoder's vision markers come from the
# builder's tokenizer) and a processor folder.
_SMALL["qwen-image-edit"] = _SMALL["qwen-image-edit-plus"] = _SMALL["qwen-image"]
_SMALL["wan-i2v"] = {**_SMALL["wan"], "image_encoder": dict(
    hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
    image_size=32, patch_size=8, projection_dim=32)}


def scaled(variant: str) -> dict[str, ComponentShape]:
    """The variant's released table with the scaled-down values over it (same keys)."""
    from ditserve.engine.makers.released import merged

    return {name: replace(shape, config=merged(shape.config, _SMALL[variant][name]))
            for name, shape in released_shapes(variant).items()}


@pytest.mark.parametrize("variant", sorted(_SMALL))
def test_written_configs_are_the_tables(variant: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.weights.loader import load_components

    table = scaled(variant)
    pipe = build_pipeline(variant, "tiny", dtype=torch.float32, device="cpu", seed=0,
                          components="all", shapes=table)
    pipe.save_pretrained(tmp_path)
    for name, shape in table.items():
        found = json.loads((tmp_path / name / "config.json").read_text())
        assert found["_class_name" if shape.library == "diffusers" else "architectures"] in (
            shape.model_class, [shape.model_class])
        _subset(shape.config, found, f"{variant}.{name}")
    loaded = load_components(tmp_path)
    assert set(table) <= set(loaded.modules)


def test_a_scaled_whole_flux_generates(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.config import EngineConfig, OffloadConfig
    from ditserve.engine.loop.engine import DiffusionEngine
    from ditserve.engine.request import SamplingParams

    build_pipeline("flux", "tiny", dtype=torch.float32, device="cpu", seed=0,
                   components="all", shapes=scaled("flux")).save_pretrained(tmp_path)
    config = EngineConfig(model=str(tmp_path), device="cpu",
                          offload=OffloadConfig(enabled=True))
    engine = DiffusionEngine(config).start()
    try:
        result = engine.add_request(SamplingParams(
            prompt="a lighthouse", height=32, width=32, num_inference_steps=2,
            seed=0)).result(timeout=120)
    finally:
        engine.shutdown()
    assert tuple(result.pixels.shape) == (1, 3, 32, 32)


def test_components_default_and_refusals(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert default_components("full") == "all"
    assert default_components("small") == default_components("tiny") == "dit"
    with pytest.raises(ConfigError, match="--components all builds the released ones"):
        init_random(tmp_path / "t", size="tiny", components="all", device="cpu")
    with pytest.raises(ConfigError, match="components must be one of all, dit"):
        init_random(tmp_path / "u", size="tiny", components="some", device="cpu")
    path = init_random(tmp_path / "d", size="tiny", dtype="float32", device="cpu")
    marker = json.loads((path / ".ditserve-random-complete").read_text())
    assert marker["components"] == "dit" and marker["parameters"]["text_encoder_2"] > 0
    # A directory written before the choice existed holds the DiT-only build.
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / ".ditserve-random-complete").write_text(json.dumps(
        {"family": "flux", "size": "tiny", "dtype": "float32", "seed": 0,
         "random_weights": True, "transformer_parameters": 1}))
    assert init_random(tmp_path / "old", size="tiny", dtype="float32") == tmp_path / "old"
    with pytest.raises(ConfigError, match="already holds a different random model"):
        init_random(tmp_path / "old", size="small", dtype="float32", components="all")


def test_cli_components_flag(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.cli.main import main

    assert main(["model", "init-random", "--size", "tiny", "--components", "all",
                 "--device", "cpu", str(tmp_path / "a")]) == 2
    assert "use --size small or full" in capsys.readouterr().err
    assert main(["model", "init-random", "--size", "tiny", "--components", "dit",
                 "--dtype", "float32", "--device", "cpu", str(tmp_path / "d")]) == 0
    assert "tiny text encoders and VAE" in capsys.readouterr().out
