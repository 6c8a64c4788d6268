"""The Dockerfile, checked without a Docker engine: the entry points it runs exist as console
scripts, it copies only sources that exist, runs as non-root with the CUDA build of the pinned
torch, bakes in no weights, and the image tag the docs say to build is the chart's and the
operator's default."""

from __future__ import annotations

import re

import tomllib
import yaml
from k8s.crd_schema import REPO

from ditserve.operator.render import DEFAULT_IMAGE

DOCKERFILE = (REPO / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_entry_points_it_runs_are_console_scripts() -> None:
    scripts = PYPROJECT["project"]["scripts"]
    smoke = [rest for word, rest in _instructions() if word == "RUN" and "--help" in rest]
    assert smoke, "the Dockerfile should smoke-test its entry points"
    named = re.findall(r"([\w-]+) --help", smoke[0])
    assert sorted(named) == ["cachectl", "ditserve", "ditserve-operator"]
    assert set(named) <= set(scripts)
    assert scripts["ditserve-operator"] == "ditserve.operator.main:main"
    (cmd,) = [rest for word, rest in _instructions() if word == "CMD"]
    assert yaml.safe_load(cmd)[0] in scripts


def test_copies_existing_sources_only_and_no_weights() -> None:
    for word, rest in _instructions():
        if word == "COPY":
            *sources, _dest = rest.split()
            for source in sources:
                assert (REPO / source).exists(), source
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", ".git", "tests", "**/*.safetensors"} <= set(ignored)


def test_cuda_torch_and_non_root_user() -> None:
    # The base is plain Python; torch is requirements.txt's pin, and the build refuses a torch
    # without CUDA (tests/test_setup.py checks the pin against the tested one).
    base = next(rest for word, rest in _instructions() if word == "ARG" and "BASE_IMAGE" in rest)
    assert base.startswith("BASE_IMAGE=python:")
    installs = [rest for word, rest in _instructions() if word == "RUN" and "pip install" in rest]
    assert any("-r requirements.txt" in rest and "torch.version.cuda" in rest
               for rest in installs)
    users = [rest for word, rest in _instructions() if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    # The chart's and the operator's pods assume uid 1000.
    assert users[-1] == "1000:1000"


def test_a_runtime_base_gets_the_compiler_that_compile_needs() -> None:
    # A CUDA runtime base has no C compiler, and inductor's Triton kernels need one
    # (spec.compile / --compile); installing it must happen as root, before USER.
    words = [word for word, _ in _instructions()]
    installs = [i for i, (word, rest) in enumerate(_instructions())
                if word == "RUN" and "apt-get install" in rest and " gcc" in rest]
    assert installs and installs[0] < words.index("USER")


def test_documented_build_tag_is_the_chart_and_operator_default() -> None:
    chart = yaml.safe_load((REPO / "charts/ditserve/Chart.yaml").read_text())
    values = yaml.safe_load((REPO / "charts/ditserve/values.yaml").read_text())
    chart_default = f"{values['image']['repository']}:{values['image']['tag'] or chart['appVersion']}"
    assert chart_default == DEFAULT_IMAGE
    assert chart["appVersion"] == PYPROJECT["project"]["version"]
    docs = (REPO / "docs/kubernetes.md").read_text()
    assert f"docker build -t {DEFAULT_IMAGE} ." in docs
    assert f"docker build -t {DEFAULT_IMAGE} ." in DOCKERFILE
    version = next(rest for word, rest in _instructions() if word == "ARG" and "VERSION=" in rest)
    assert version.split("=")[1] == chart["appVersion"]
