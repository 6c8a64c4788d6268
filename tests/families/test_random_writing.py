"""`init-random` writes a pipeline a component at a time (engine.makers.writing).

Each large module - a DiT, a released-shape encoder or VAE - is written as soon as it is
built and its tensors freed before the next one is built, so a build's peak memory is about
its largest component (FLUX.2 [dev]'s DiT and Mistral encoder do not fit one GPU together).
Checked on tiny and scaled-down builds on the CPU: the folder is byte for byte what a whole
build's ``save_pretrained`` writes and loads with the family's diffusers pipeline class; every
earlier component's storage is gone (weak references dead) when the next one starts
allocating; a component whose folder is a symlink (the bench's ``--spill-dir``) is written
through it."""

from __future__ import annotations

import gc
import hashlib
import json
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from families.test_released_components import scaled  # type: ignore[import-not-found]

from ditserve.engine.families import family_of_variant
from ditserve.engine.makers import released, writing
from ditserve.engine.makers.builders import build_pipeline
from ditserve.engine.makers.random_model import init_random, write_pipeline


def _files(root: Path) -> dict[str, str]:
    """Every file under ``root`` by relative path: its bytes' digest (``root`` itself, which a
    modular pipeline's index records, replaced by a placeholder)."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            data = path.read_bytes().replace(str(root).encode(), b"<root>")
            found[str(path.relative_to(root))] = hashlib.sha256(data).hexdigest()
    return found


# The whole-build comparison: scaled released tables (every component written as built), a
# second DiT (Wan 2.2's experts), a modular pipeline with a reference DiT (MiniMax-H3).
CASES = [("flux", "all", "float32"), ("flux2", "all", "bfloat16"),
         ("wan-i2v", "all", "bfloat16"), ("wan2.2", "dit", "bfloat16"),
         ("minimax-h3", "dit", "float32"), ("cosmos3", "dit", "bfloat16")]


@pytest.mark.parametrize(("variant", "components", "dtype"), CASES)
def test_written_files_are_the_whole_builds(variant: str, components: str, dtype: str,
                                            tmp_path: Path) -> None:
    shapes = scaled(variant) if components == "all" else None
    torch_dtype = getattr(torch, dtype)
    whole = build_pipeline(variant, "tiny", dtype=torch_dtype, device="cpu", seed=3,
                           components=components, shapes=shapes)
    whole.save_pretrained(str(tmp_path / "a"), max_shard_size="5GB")
    write_pipeline(tmp_path / "b", variant, "tiny", dtype=dtype, device=torch.device("cpu"),
                   seed=3, components=components, shapes=shapes)
    assert _files(tmp_path / "b") == _files(tmp_path / "a")
    assert any(p.suffix == ".safetensors" for p in (tmp_path / "b" / "transformer").iterdir())


def test_each_component_is_freed_before_the_next_is_built(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[tuple[str, list[weakref.ref[Any]]]] = []
    alive_at_start: list[list[str]] = []  # per allocation: the earlier components still held
    real_allocating, real_finished = released.allocating, writing.finished

    def alive() -> list[str]:
        gc.collect()
        return [name for name, refs in built if any(r() is not None for r in refs)]

    def allocating(dtype: Any, device: Any) -> Any:  # every large module is built in one
        alive_at_start.append(alive())
        return real_allocating(dtype, device)

    def finished(name: str, module: Any) -> Any:
        refs = [weakref.ref(t.untyped_storage()) for t in module.state_dict().values()]
        built.append((name, refs))
        return real_finished(name, module)

    monkeypatch.setattr(released, "allocating", allocating)
    monkeypatch.setattr(writing, "finished", finished)
    shapes = scaled("flux")
    # A whole build holds every component: the check sees them (it can fail).
    build_pipeline("flux", "tiny", dtype=torch.float32, device="cpu", seed=0,
                   components="all", shapes=shapes)
    assert alive_at_start[-1] == ["text_encoder", "text_encoder_2", "vae"]
    built.clear()
    alive_at_start.clear()
    write_pipeline(tmp_path, "flux", "tiny", dtype="float32", device=torch.device("cpu"),
                   seed=0, components="all", shapes=shapes)
    assert [name for name, _ in built] == ["text_encoder", "text_encoder_2", "vae",
                                           "transformer"]
    assert alive_at_start == [[], [], [], []]
    assert alive() == []  # the last one too, once written


def test_the_folder_loads_with_the_familys_pipeline_class(tmp_path: Path) -> None:
    import diffusers

    path = init_random(tmp_path / "m", family="wan2.2", size="tiny", dtype="float32",
                       device="cpu")
    pipe = diffusers.DiffusionPipeline.from_pretrained(str(path))
    family = family_of_variant("wan2.2")
    assert family is not None and type(pipe).__name__ == family.pipeline_class
    whole = build_pipeline("wan2.2", "tiny", dtype=torch.float32, device="cpu", seed=0)
    for name in ("transformer", "transformer_2", "text_encoder", "vae"):
        got, want = getattr(pipe, name).state_dict(), getattr(whole, name).state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), name
    marker = json.loads((path / ".ditserve-random-complete").read_text())
    assert set(marker["parameters"]) == {"transformer", "transformer_2", "text_encoder", "vae"}
    assert marker["transformer_parameters"] == (marker["parameters"]["transformer"]
                                                + marker["parameters"]["transformer_2"])
    assert marker["parameters"]["transformer"] == sum(
        p.numel() for p in whole.transformer.parameters())


def test_a_symlinked_component_folder_is_written_through(tmp_path: Path) -> None:
    # bench/whole_pipeline.py --spill-dir: the text encoder's folder links to another disk.
    model, disk = tmp_path / "shm" / "m", tmp_path / "disk" / "text_encoder"
    model.mkdir(parents=True)
    disk.mkdir(parents=True)
    (model / "text_encoder").symlink_to(disk, target_is_directory=True)
    write_pipeline(model, "flux", "tiny", dtype="float32", device=torch.device("cpu"), seed=0,
                   components="all", shapes=scaled("flux"))
    assert (model / "text_encoder").is_symlink()
    assert (disk / "config.json").is_file()
    assert any(p.suffix == ".safetensors" for p in disk.iterdir())
