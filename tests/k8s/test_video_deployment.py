"""A video model needs no special case in Kubernetes: the CRD's model.family enum is the
engine's MODEL_FAMILIES (no family without a pipeline, such as SD3), the operator refuses an
unsupported family as InvalidSpec, and the Wan example renders an ordinary engine pod whose
video flags the engine's own parser accepts."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from k8s.crd_schema import CHART_CRD_PATH, CRD_PATH, apply_defaults, version_schema

from ditserve.engine.config import MODEL_FAMILIES
from ditserve.operator.errors import InvalidSpecError
from ditserve.operator.judge import judge_engine, validate
from ditserve.operator.render import Owner, render
from ditserve.operator.spec import parse_spec

EXAMPLE = Path(__file__).parents[2] / "examples" / "wan-video.yaml"


def _family_enum(path: Path) -> list[str]:
    crd = yaml.safe_load(path.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return list(schema["properties"]["spec"]["properties"]["model"]["properties"]["family"]
                ["enum"])


def test_the_crd_lists_exactly_the_engines_families() -> None:
    assert _family_enum(CRD_PATH) == _family_enum(CHART_CRD_PATH) == list(MODEL_FAMILIES)
    assert "SD3" not in MODEL_FAMILIES


def _example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def test_an_unsupported_family_is_an_invalid_spec() -> None:
    spec = copy.deepcopy(_example()["spec"])
    spec["model"]["family"] = "SD3"
    with pytest.raises(InvalidSpecError, match="model.family must be one of Auto, Flux, "
                                               "QwenImage, Wan"):
        validate(spec)


def test_the_wan_example_is_an_ordinary_engine_pod() -> None:
    doc = _example()
    spec = apply_defaults(version_schema(), doc)["spec"]
    _, server = judge_engine(parse_spec(spec))
    assert (server.max_frames, server.video_max_jobs, server.video_ttl_s) == (81, 256, 3600)
    assert server.video_max_bytes == 8 << 30 and server.video_dir is None  # /tmp emptyDir
    owner = Owner.from_body({**doc, "metadata": {**doc["metadata"], "uid": "u"}})
    kids = {m["kind"]: m for m in render(parse_spec(spec), owner)}
    pod = kids["Deployment"]["spec"]["template"]["spec"]
    (engine,) = [c for c in pod["containers"] if c["name"] == "engine"]
    assert "/tmp" in [m["mountPath"] for m in engine["volumeMounts"]]
    assert kids["Deployment"]["metadata"]["labels"]["ditserve.io/model-family"] == "Wan"
