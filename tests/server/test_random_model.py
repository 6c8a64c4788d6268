"""`ditserve model init-random`: the random pipeline has Flux's latent layout, loads through
the engine's loader and generates; the CLI refuses to overwrite a different model."""

from __future__ import annotations

import json

import pytest

from ditserve.engine.cli.main import main
from ditserve.engine.config import EngineConfig
from ditserve.engine.errors import ConfigError
from ditserve.engine.families.flux import DIT_SIZES as FLUX_TRANSFORMER
from ditserve.engine.makers.random_model import init_random
from ditserve.engine.request import SamplingParams


def test_tiny_random_flux_serves_with_flux_layout(tmp_path) -> None:
    from ditserve.engine.loop.engine import DiffusionEngine

    model = tmp_path / "rnd"
    assert main(["model", "init-random", "--size", "tiny", "--dtype", "float32",
                 "--device", "cpu", str(model)]) == 0
    config = json.loads((model / "transformer" / "config.json").read_text())
    assert config["in_channels"] == 64 and config["guidance_embeds"] is True
    assert json.loads((model / "vae" / "config.json").read_text())["latent_channels"] == 16
    marker = json.loads((model / ".ditserve-random-complete").read_text())
    assert marker["size"] == "tiny" and marker["transformer_parameters"] > 0

    engine = DiffusionEngine(EngineConfig(model=str(model), device="cpu")).start()
    try:
        assert engine.limits.pixel_multiple == 16  # 8x VAE and 2x2 packing, as real Flux
        result = engine.add_request(
            SamplingParams(prompt="a random cat", height=32, width=48, num_inference_steps=2,
                           seed=0)).result(timeout=120)
    finally:
        engine.shutdown()
    assert tuple(result.pixels.shape) == (1, 3, 32, 48)


def test_full_config_is_diffusers_default_flux_with_guidance() -> None:
    import inspect

    from diffusers import FluxTransformer2DModel

    defaults = {name: p.default for name, p in
                inspect.signature(FluxTransformer2DModel.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty and name != "out_channels"}
    full = FLUX_TRANSFORMER["full"]
    assert {**defaults, "guidance_embeds": True} == {k: full[k] for k in defaults}
    assert full["num_attention_heads"] * full["attention_head_dim"] == 3072


def test_refuses_a_directory_holding_another_random_model(tmp_path) -> None:
    (tmp_path / ".ditserve-random-complete").write_text(json.dumps(
        {"family": "flux", "size": "small", "dtype": "bfloat16", "seed": 0,
         "random_weights": True}))
    with pytest.raises(ConfigError, match="already holds a different random model"):
        init_random(tmp_path, size="tiny")
    with pytest.raises(ConfigError, match="size must be one of tiny, small, full"):
        init_random(tmp_path / "x", size="huge")


def test_a_directory_holding_anything_else_is_never_written_over(tmp_path, capsys) -> None:
    from ditserve.engine.makers.tiny_model import init_tiny

    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.txt").write_text("years of work")
    assert main(["model", "init-tiny", str(precious)]) == 2
    assert "is a directory that is not empty" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="is a directory that is not empty"):
        init_random(precious, size="tiny", device="cpu")
    assert sorted(p.name for p in precious.iterdir()) == ["thesis.txt"]
    assert (precious / "thesis.txt").read_text() == "years of work"

    flux = init_tiny(tmp_path / "m", family="flux")
    with pytest.raises(ConfigError, match="already holds a different tiny model"):
        init_tiny(flux, family="wan")
    assert init_tiny(flux, family="flux") == flux  # the same one: nothing to do
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (init_tiny(empty) / "model_index.json").exists()


def test_an_interrupted_random_model_is_continued_by_the_same_command(tmp_path) -> None:
    target = tmp_path / "r"
    target.mkdir()
    settings = {"family": "flux", "size": "tiny", "components": "dit", "dtype": "bfloat16",
                "seed": 0, "random_weights": True}
    (target / ".ditserve-random-started").write_text(json.dumps(settings))
    (target / "model_index.json").write_text("{")  # cut short by a kill
    assert init_random(target, size="tiny", device="cpu") == target
    assert json.loads((target / "model_index.json").read_text())["_class_name"] == "FluxPipeline"
    assert not (target / ".ditserve-random-started").exists()
    with pytest.raises(ConfigError, match="unfinished random model of other settings"):
        other = tmp_path / "o"
        other.mkdir()
        (other / ".ditserve-random-started").write_text(json.dumps({**settings, "seed": 1}))
        init_random(other, size="tiny", device="cpu")
