"""A pipeline's call defaults read from its source equal its imported signature's; where the
source cannot tell, nothing is guessed (the signature answers)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from ditserve.engine.families import FAMILIES
from ditserve.engine.pipeline_defaults import (
    call_defaults,
    signature_call_defaults,
    source_call_defaults,
)

WITH_MODULE = [f for f in FAMILIES if f.pipeline_module is not None]


@pytest.mark.parametrize("family", WITH_MODULE, ids=[f.name for f in WITH_MODULE])
def test_the_source_gives_the_signatures_defaults(family) -> None:  # type: ignore[no-untyped-def]
    import diffusers

    assert family.pipeline_module is not None
    # The record names the module diffusers really defines the class in ...
    assert getattr(diffusers, family.pipeline_class).__module__ == family.pipeline_module
    # ... and its source spells every default the imported signature has (Flux Kontext's
    # ``max_area: int = 1024**2`` included).
    from_source = source_call_defaults(family.pipeline_class, family.pipeline_module)
    assert from_source == signature_call_defaults(family.pipeline_class)
    assert dict(call_defaults(family.pipeline_class, family.pipeline_module)) == from_source


FAKE = '''
SIZE = 64

class Literal:
    def __call__(self, prompt=None, *, steps: int = 28, scale=-1.5, area=2**10,
                 names=("a", "b"), latents=None, generator=None):
        pass

class FromAName:
    def __call__(self, prompt=None, size=SIZE):
        pass

class Inherits(Literal):
    pass
'''


@pytest.fixture
def fake_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    package = tmp_path / "ditserve_fake_pipelines"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('never imported')\n")
    (package / "pipes.py").write_text(FAKE)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return "ditserve_fake_pipelines.pipes"


def test_literals_and_number_arithmetic_are_read_without_importing(fake_package: str) -> None:
    # The package's __init__ raises: reading the source never imports it.
    assert source_call_defaults("Literal", fake_package) == {
        "prompt": None, "steps": 28, "scale": -1.5, "area": 1024, "names": ("a", "b"),
        "latents": None, "generator": None}


def test_what_the_source_cannot_tell_is_left_to_the_signature(fake_package: str) -> None:
    assert source_call_defaults("FromAName", fake_package) is None  # a name's value
    assert source_call_defaults("Inherits", fake_package) is None  # an inherited __call__
    assert source_call_defaults("Missing", fake_package) is None
    assert source_call_defaults("Literal", "ditserve_fake_pipelines.gone") is None
    assert source_call_defaults("Literal", "no_such_package_anywhere.pipes") is None
