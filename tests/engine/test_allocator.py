"""Engine processes default the CUDA allocator to expandable segments, never over the user's."""

from __future__ import annotations

import os

import pytest

from ditserve.engine.allocator import DEFAULT_ALLOCATOR_SETTINGS, prefer_expandable_segments
from ditserve.engine.cli.main import main


def test_an_unconfigured_allocator_gets_expandable_segments() -> None:
    environ: dict[str, str] = {}
    assert prefer_expandable_segments(environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": DEFAULT_ALLOCATOR_SETTINGS}


@pytest.mark.parametrize("name", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_a_users_allocator_settings_are_kept(name: str) -> None:
    environ = {name: "max_split_size_mb:512"}
    assert not prefer_expandable_segments(environ)
    assert environ == {name: "max_split_size_mb:512"}


def test_the_cli_applies_the_default_before_a_command_runs(monkeypatch, tmp_path) -> None:
    # setenv first so monkeypatch restores the variable's absence afterwards.
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    missing = tmp_path / "no-model"
    assert main(["generate", "--model", str(missing), "--prompt", "x",
                 "--out", str(tmp_path / "x.png")]) == 2
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == DEFAULT_ALLOCATOR_SETTINGS
