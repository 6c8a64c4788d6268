"""One folder per family: each family's record is its folder's ``__init__`` under
engine/families/<family>/, beside its step pipeline, sequence-parallel hooks and builders; the
folder is the only place of engine/, cachectl/ and operator/ that spells the family's
diffusers class names; the records' lazy references reach the torch-side parts in the folder;
the registry imports no torch."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ditserve.engine import families

REPO = Path(__file__).resolve().parents[2]
SEARCHED = ("engine", "cachectl", "operator")


def family_folder(family: families.Family) -> str:
    """The family's folder, by the naming rule of docs/architecture.md ("Adding a family")."""
    return f"engine/families/{family.name.replace('-', '_')}"


def family_module(family: families.Family) -> str:
    """The record's module: the folder's ``__init__``."""
    return f"{family_folder(family)}/__init__.py"


def owner(class_name: str) -> families.Family:
    """The family whose module spells a class name: the first to declare it (a family derived
    from another, with the same DiT, takes the name from its base's record)."""
    return next(f for f in families.FAMILIES if class_name in (f.dit_class, f.pipeline_class))


def files_naming(name: str) -> set[str]:
    word = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])")
    found = set()
    for top in SEARCHED:
        for path in (REPO / top).rglob("*"):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # not a text file
            if word.search(text):
                found.add(path.relative_to(REPO).as_posix())
    return found


@pytest.mark.parametrize("family", families.FAMILIES, ids=lambda f: f.name)
def test_only_the_family_folder_names_its_classes(family: families.Family) -> None:
    for name in (family.dit_class, family.pipeline_class):
        home = family_folder(owner(name))
        outside = {f for f in files_naming(name) if not f.startswith(home + "/")}
        assert family_module(owner(name)) in files_naming(name)
        assert not outside, (
            f"{name} is spelled outside {home}/ (in {sorted(outside)}): write \"the family's "
            "DiT\" (or pipeline) instead, or read the name off the family record")


@pytest.mark.parametrize("family", families.FAMILIES, ids=lambda f: f.name)
def test_lazy_references_point_into_the_familys_own_folder(family: families.Family) -> None:
    # A derived family may name its base's parts (the same DiT's hooks); nothing else.
    allowed = {f"ditserve.engine.families.{f.name.replace('-', '_')}."
               for f in families.FAMILIES
               if f is family or f.dit_class == family.dit_class}
    for reference in (family.step_pipeline, family.builders, family.sp_hooks):
        if reference is not None:
            assert any(reference.startswith(prefix) for prefix in allowed), reference


@pytest.mark.parametrize("family", families.FAMILIES, ids=lambda f: f.name)
def test_each_record_lives_in_its_own_module(family: families.Family) -> None:
    module = importlib.import_module("ditserve." + family_folder(family).replace("/", "."))
    records = [v for v in vars(module).values() if isinstance(v, families.Family)]
    assert family in records
    # Besides its own, a derived family's module holds only its base's record (the same DiT).
    assert all(r.dit_class == family.dit_class for r in records)
    assert owner(family.dit_class) in records
    assert family.variants[0] == family.name  # the family's own variant builds first
    assert {families.MODEL_VARIANTS[v] for v in family.variants} == {family.name}


@pytest.mark.parametrize("family", families.FAMILIES, ids=lambda f: f.name)
def test_lazy_references_reach_the_torch_side_parts(family: families.Family) -> None:
    assert families.resolve(family.step_pipeline).family is family
    if family.sp_hooks is not None:
        assert callable(families.resolve(family.sp_hooks))
    builders = families.resolve(family.builders)
    assert callable(builders.build_pipeline) and callable(builders.build_tiny)
    assert families.family_of_dit(family.dit_class) is owner(family.dit_class)


def test_the_registry_imports_no_torch() -> None:
    names = ", ".join(f"ditserve.{family_folder(f).replace('/', '.')}"
                      for f in families.FAMILIES)
    code = (f"import sys, ditserve.engine.families, {names}; "
            "print(sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=REPO / "tests")
    assert out.stdout.strip() == "[]"


def test_unknown_dits_and_variants_are_not_any_familys() -> None:
    assert families.family_of_dit("SD3Transformer2DModel") is None
    assert families.declared_block_lists("SD3Transformer2DModel") is None
    assert families.family_of_variant("sd3") is None
    assert families.family_of_variant("wan2.2") is families.WAN


def test_sequence_parallelism_finds_hooks_through_the_family_and_names_each_dit_once() -> None:
    from ditserve.engine.errors import ConfigError
    from ditserve.engine.parallel.sharding import family_hooks

    for family in families.FAMILIES:
        assert family_hooks(family.dit_class) is families.resolve(owner(family.dit_class).sp_hooks)
    with pytest.raises(ConfigError) as refused:
        family_hooks("SD3Transformer2DModel")
    supported = str(refused.value).split("supported: ")[1].split(", ")
    assert sorted(supported) == sorted({f.dit_class for f in families.FAMILIES})
