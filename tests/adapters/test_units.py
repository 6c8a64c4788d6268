"""The adapter pieces on their own: flag syntax and config rules, the catalog's names,
generations and in-use refusals, the file checks (text-encoder parts, rank, format), the
row segments of a narrowed forward (the step work adapters do not add:
test_admission_rows.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ditserve.engine.adapters.bank import startup_refs
from ditserve.engine.adapters.catalog import AdapterCatalog
from ditserve.engine.adapters.rows import RowAdapters, RowSegment
from ditserve.engine.config import EngineConfig
from ditserve.engine.config.adapters import (
    AdapterConfig,
    parse_lora_arg,
    parse_lora_module,
)
from ditserve.engine.errors import AdapterError, AdapterNotFoundError, ConfigError
from ditserve.engine.request import LoraRef, SamplingParams


def test_flag_syntax() -> None:
    assert parse_lora_module("style=/data/s.safetensors") == ("style", "/data/s.safetensors")
    assert parse_lora_arg("style=/data/s.safetensors:0.6") == ("style", "/data/s.safetensors", 0.6)
    assert parse_lora_arg("s=C:/x.safetensors") == ("s", "C:/x.safetensors", 1.0)
    for bad in ("noequals", "=path", "bad name=/x", "x="):
        with pytest.raises(ConfigError):
            parse_lora_module(bad)


def test_a_mistyped_scale_is_named_not_taken_for_the_path(tmp_path) -> None:
    adapter = tmp_path / "style.safetensors"
    adapter.write_bytes(b"x")
    with pytest.raises(ConfigError, match="the scale after the last ':' must be a number, "
                                          "got 'abc'"):
        parse_lora_arg(f"style={adapter}:abc")
    odd = tmp_path / "odd:name.safetensors"  # a colon that belongs to an existing file
    odd.write_bytes(b"x")
    assert parse_lora_arg(f"s={odd}") == ("s", str(odd), 1.0)


def test_generate_refuses_a_missing_adapter_before_loading(tmp_path, capsys) -> None:
    from ditserve.engine.cli.main import main

    rc = main(["generate", "--prompt", "x", "--out", str(tmp_path / "x.png"),
               "--lora", f"style={tmp_path / 'nope.safetensors'}:0.5"])
    err = capsys.readouterr().err
    assert rc != 0 and "adapter file" in err and "nope.safetensors" in err
    assert "does not exist" in err and "Traceback" not in err


def test_config_rules_through_from_mapping() -> None:
    ok = EngineConfig.from_mapping({"adapters": {"lora_modules": {"a": "/a.safetensors"},
                                                 "max_loras": 2}})
    assert ok.adapters.max_loras == 2
    with pytest.raises(ConfigError, match="exactly one adapter"):
        EngineConfig.from_mapping({"adapters": {"lora_modules": {"a": "/a", "b": "/b"},
                                                "fuse": True}})
    with pytest.raises(ConfigError, match="max_loras must be an integer >= 1"):
        EngineConfig.from_mapping({"adapters": {"max_loras": 0}})
    with pytest.raises(ConfigError, match="--compile"):
        EngineConfig.from_mapping({"compile": "inductor",
                                   "adapters": {"lora_modules": {"a": "/a"}}})


def catalog(**modules: str) -> AdapterCatalog:
    return AdapterCatalog(AdapterConfig(lora_modules=dict(modules)), inspect=lambda path: 16)


def test_catalog_resolves_names_as_the_runners_number_them() -> None:
    config = AdapterConfig(lora_modules={"a": "/a.safetensors", "b": "/b.safetensors"})
    c = AdapterCatalog(config, inspect=lambda path: 8)
    refs = c.resolve([("b", 0.5), ("a", 1.0)])
    assert [(r.name, r.scale, r.rank) for r in refs] == [("b", 0.5, 8), ("a", 1.0, 8)]
    assert {r.key for r in refs} == {r.key for r in startup_refs(config)}
    with pytest.raises(AdapterNotFoundError, match="'nope' is not loaded .*loaded: a, b"):
        c.resolve([("nope", 1.0)])


def test_catalog_load_unload_and_in_use() -> None:
    c = catalog(a="/a.safetensors")
    entry = c.load("new", "/new.safetensors")
    assert entry.version == 1 and "new" in c
    with pytest.raises(AdapterError, match="already loaded"):
        c.load("new", "/other.safetensors")
    refs = c.resolve([("new", 1.0)])
    c.hold(refs)
    with pytest.raises(AdapterError, match="in use by 1"):
        c.unload("new")
    c.release(refs)
    c.unload("new")
    with pytest.raises(AdapterNotFoundError):
        c.unload("new")
    assert c.load("new", "/new.safetensors").version == 2  # a new generation


def test_a_bad_file_is_not_registered() -> None:
    def inspect(path: str) -> int:
        raise AdapterError(f"adapter file {path!r} does not exist")

    c = AdapterCatalog(AdapterConfig(), inspect=inspect)
    with pytest.raises(AdapterError, match="does not exist"):
        c.load("x", "/missing.safetensors")
    assert "x" not in c


def test_a_pipeline_without_a_lora_loader_refuses_adapters_by_name(tmp_path: Path) -> None:
    """Cosmos3's diffusers pipeline has no ``lora_state_dict``: an adapter for it is an
    AdapterError saying so (a 400 at load, a refusal at start), not an AttributeError."""
    from diffusers import Cosmos3OmniPipeline

    from ditserve.engine.adapters.files import read_adapter

    dit = {"transformer.x.to_q.lora_A.weight": torch.randn(4, 32),
           "transformer.x.to_q.lora_B.weight": torch.randn(32, 4)}
    with pytest.raises(AdapterError, match="Cosmos3OmniPipeline has no LoRA loader"):
        read_adapter(write(tmp_path / "c.safetensors", dit), Cosmos3OmniPipeline, max_rank=64)


def test_fused_catalog() -> None:
    c = AdapterCatalog(AdapterConfig(lora_modules={"a": "/a"}, fuse=True), inspect=lambda p: 4)
    assert c.resolve([("a", 1.0)]) == ()
    with pytest.raises(AdapterError, match="fused"):
        c.resolve([("a", 0.5)])
    with pytest.raises(AdapterError, match="fused"):
        c.load("b", "/b")


def write(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> Path:
    save_file(tensors, str(path), metadata=metadata)
    return path


def test_file_checks(tmp_path: Path) -> None:
    from diffusers import FluxPipeline

    from ditserve.engine.adapters.files import read_adapter

    a, b = torch.randn(4, 32), torch.randn(32, 4)
    dit = {"transformer.x.to_q.lora_A.weight": a, "transformer.x.to_q.lora_B.weight": b}
    te = {"text_encoder.q.lora_A.weight": a.clone(), "text_encoder.q.lora_B.weight": b.clone()}
    with pytest.raises(AdapterError, match="also adapts text_encoder"):
        read_adapter(write(tmp_path / "te.safetensors", dit | te), FluxPipeline, max_rank=64)
    with pytest.raises(AdapterError, match="above --max-lora-rank 2"):
        read_adapter(write(tmp_path / "r.safetensors", dit), FluxPipeline, max_rank=2)
    pickle = tmp_path / "w.bin"
    pickle.write_bytes(b"x")
    with pytest.raises(AdapterError, match="not a .safetensors file"):
        read_adapter(pickle, FluxPipeline, max_rank=64)
    meta = {"lora_adapter_metadata": json.dumps({"transformer.r": 4,
                                                 "transformer.lora_alpha": 8})}
    weights = read_adapter(write(tmp_path / "m.safetensors", dit, meta), FluxPipeline,
                           max_rank=64)
    assert weights.layers[("transformer", "x.to_q")].scaling == 2.0  # lora_alpha / r
    (tmp_path / "dir").mkdir()
    write(tmp_path / "dir" / "pytorch_lora_weights.safetensors", dit)
    assert read_adapter(tmp_path / "dir", FluxPipeline, max_rank=64).rank == 4


def test_a_runtime_load_is_checked_against_the_dit(tmp_path: Path) -> None:
    """A file that names a layer the model lacks, or whose factors do not fit, is refused
    when it is loaded (issue 45: it was accepted, then failed every request naming it)."""
    from diffusers import FluxTransformer2DModel

    from ditserve.engine.adapters.bank import AdapterBank
    from ditserve.engine.adapters.files import rank_inspector
    from ditserve.engine.makers.tiny_model import init_tiny

    model = init_tiny(tmp_path / "model", family="flux")
    dit = FluxTransformer2DModel.from_pretrained(model / "transformer")
    bank = AdapterBank(dit, pipeline_class=None, device=torch.device("cpu"),
                       dtype=torch.float32, max_loras=1, max_rank=64)
    shapes = bank.linear_shapes()
    q = "transformer_blocks.0.attn.to_q"
    fan_in, fan_out = shapes[f"transformer.{q}"]
    inspect = rank_inspector(model, max_rank=64, shapes=shapes)
    fits = {f"transformer.{q}.lora_A.weight": torch.randn(4, fan_in),
            f"transformer.{q}.lora_B.weight": torch.randn(fan_out, 4)}
    assert inspect(str(write(tmp_path / "fits.safetensors", fits))) == 4
    wide = {f"transformer.{q}.lora_A.weight": torch.randn(4, fan_in * 2),
            f"transformer.{q}.lora_B.weight": torch.randn(fan_out, 4)}
    with pytest.raises(AdapterError, match="trained for another model"):
        inspect(str(write(tmp_path / "wide.safetensors", wide)))
    ghost = {"transformer.ghost.proj.lora_A.weight": torch.randn(4, fan_in),
             "transformer.ghost.proj.lora_B.weight": torch.randn(fan_out, 4)}
    with pytest.raises(AdapterError, match="ghost.proj, which is not a linear layer"):
        inspect(str(write(tmp_path / "ghost.safetensors", ghost)))
    catalog = AdapterCatalog(AdapterConfig(), inspect=inspect)
    with pytest.raises(AdapterError):
        catalog.load("wide", str(tmp_path / "wide.safetensors"))
    assert "wide" not in catalog


def test_rows_of_a_narrowed_forward() -> None:
    rows = RowAdapters(6, (RowSegment(0, 2, ((("a", 0), 1.0),)),
                           RowSegment(4, 6, ((("b", 0), 0.5),))))
    # Rows 1..2 and 4..5 as one forward of 3 rows: row 0 is a's, rows 1..2 are b's.
    narrowed = rows.narrowed([slice(1, 2), slice(2, 4), slice(4, 6)])
    assert narrowed.rows == 5
    assert narrowed.segments == (RowSegment(0, 1, ((("a", 0), 1.0),)),
                                 RowSegment(3, 5, ((("b", 0), 0.5),)))


def test_request_validation_of_loras() -> None:
    p = SamplingParams(prompt="x", loras=(LoraRef("a", "/a", scale=11.0),))
    with pytest.raises(Exception, match="scale must be a number in"):
        p.validate()
    twice = SamplingParams(prompt="x", loras=(LoraRef("a", "/a"), LoraRef("a", "/a")))
    with pytest.raises(Exception, match="named twice"):
        twice.validate()


def test_grouped_and_segment_paths_agree() -> None:
    from torch import nn

    from ditserve.engine.adapters.files import LoraFactors
    from ditserve.engine.adapters.linear import AdaptedLinear
    from ditserve.engine.adapters.rows import applying

    torch.manual_seed(0)
    base = nn.Linear(24, 40)
    x = torch.randn(6, 5, 24)
    factors = [LoraFactors(down=torch.randn(4, 24), up=torch.randn(40, 4), scaling=0.5 + i)
               for i in range(3)]
    outs = []
    for grouped in (True, False):
        layer = AdaptedLinear("l", base, grouped=grouped)
        for i in range(3):
            layer.add((f"a{i}", 0), factors[i])
        # Three adjacent 2-row segments, one adapter each: the grouped path's case.
        rows = RowAdapters(6, tuple(RowSegment(2 * i, 2 * i + 2, (((f"a{i}", 0), 0.3 * i - 0.2),))
                                    for i in range(3)))
        with applying(rows), torch.no_grad():
            outs.append(base(x))
        layer.remove(("a0", 0)), layer.remove(("a1", 0)), layer.remove(("a2", 0))
    with torch.no_grad():
        plain = base(x)
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    assert (outs[0] - plain).abs().max() > 1e-2


def test_kohya_non_block_keys_are_dropped_as_diffusers_drops_them(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    """Issue 45: a kohya Flux file with ``lora_unet_img_in`` / ``time_in`` keys was refused
    as "text-encoder parts"; ``load_lora_weights`` loads its block layers and ignores those
    (its converter maps them to no component). The same layers load here, and the log names
    what was dropped."""
    import logging

    from adapters.lora_files import kohya_flux_lora  # type: ignore[import-not-found]
    from diffusers import FluxPipeline
    from safetensors.torch import load_file

    from ditserve.engine.adapters.files import read_adapter
    from ditserve.engine.makers.tiny_model import init_tiny

    model = init_tiny(tmp_path / "model", family="flux")
    pipe = FluxPipeline.from_pretrained(model)
    dit = pipe.transformer
    inner = dit.config.num_attention_heads * dit.config.attention_head_dim
    plain = kohya_flux_lora(dit, tmp_path / "k.safetensors", rank=4, alpha=2.0, seed=3)
    tensors = load_file(str(plain))
    for key, fan_in in (("img_in", dit.config.in_channels), ("time_in_in_layer", 256)):
        tensors[f"lora_unet_{key}.lora_down.weight"] = torch.randn(4, fan_in)
        tensors[f"lora_unet_{key}.lora_up.weight"] = torch.randn(inner, 4)
        tensors[f"lora_unet_{key}.alpha"] = torch.tensor(2.0)
    file = write(tmp_path / "k2.safetensors", tensors)
    with caplog.at_level(logging.WARNING):
        weights = read_adapter(file, FluxPipeline, max_rank=64)
    assert "x_embedder" in caplog.text and "dropped" in caplog.text
    pipe.load_lora_weights(str(file), adapter_name="k")
    loaded = {name.removesuffix(".lora_A") for name, _ in dit.named_modules()
              if name.endswith(".lora_A")}
    assert {module for _, module in weights.layers} == loaded
