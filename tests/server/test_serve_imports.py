"""What ``ditserve serve`` imports (issue 50, time to ready): the server side of a replica is
built without the model's libraries, and a started engine has imported its own family only.

Each check runs in a fresh interpreter (``python -P``; this test process has imported
everything long ago) and reads its ``sys.modules``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# The model's libraries and what they drag in: the engine imports them as it starts (start
# phase ``imports``), never the server while it is built.
MODEL_LIBRARIES = ("diffusers", "transformers", "peft", "accelerate", "torch._dynamo")
# Video codecs: an image model's replica never needs them.
VIDEO_CODECS = ("av", "imageio")

BUILD_SERVER = """
import json, sys
from ditserve.engine.cli.main import build_parser
from ditserve.engine.server.main import build_server, configs_from_args
args = build_parser().parse_args(["serve", "--model", sys.argv[1], "--port", "0"])
server, engine = build_server(*configs_from_args(args), on_start_failed=print)
built = sorted(sys.modules)
from ditserve.engine.loop.startup import import_model_libraries
import_model_libraries(sys.argv[1], engine.start_timeline)  # `serve`, before the server runs
json.dump({"built": built, "imported": sorted(sys.modules),
           "phases": sorted(engine.start_report()["phases"])}, sys.stdout)
"""

START_ENGINE = """
import json, sys
from ditserve.engine.config import EngineConfig, SchedulerConfig
from ditserve.engine.loop.engine import DiffusionEngine
engine = DiffusionEngine(EngineConfig(model=sys.argv[1], device="cpu",
                                      scheduler=SchedulerConfig(max_num_seqs=1))).start()
try:
    phases = engine.start_report()["phases"]
finally:
    engine.shutdown()
json.dump({"modules": sorted(sys.modules), "phases": sorted(phases)}, sys.stdout)
"""


def _run(script: str, model_dir: Path) -> object:
    done = subprocess.run([sys.executable, "-P", "-c", script, str(model_dir)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


def _loaded(modules: list[str], names: tuple[str, ...]) -> list[str]:
    return [n for n in names if n in modules]


def step_pipeline_modules(modules: list[str]) -> list[str]:
    """The families' step-wise pipeline modules (``engine.families.<name>.pipeline``)."""
    return [m for m in modules
            if m.startswith("ditserve.engine.families.") and m.endswith(".pipeline")]


def test_building_the_server_imports_no_model_library(tiny_model_dir: Path) -> None:
    found = _run(BUILD_SERVER, tiny_model_dir)
    assert isinstance(found, dict)
    modules = found["built"]
    # The serve path was really taken: the engine, the HTTP app and uvicorn are there.
    assert {"ditserve.engine.loop.engine", "ditserve.engine.server.app", "fastapi",
            "uvicorn"} <= set(modules)
    assert _loaded(modules, MODEL_LIBRARIES) == []
    assert _loaded(modules, VIDEO_CODECS) == []
    assert step_pipeline_modules(modules) == []
    # Then the engine imports them, as a start phase of its own (before any step pipeline).
    assert {"diffusers", "transformers"} <= set(found["imported"])
    assert "imports" in found["phases"]
    assert step_pipeline_modules(found["imported"]) == []


def test_a_video_replica_builds_its_server_without_model_libraries_too(tmp_path: Path) -> None:
    from ditserve.engine.makers.tiny_model import init_tiny

    found = _run(BUILD_SERVER, init_tiny(tmp_path / "wan", family="wan"))
    assert isinstance(found, dict)
    modules = found["built"]
    assert "ditserve.engine.server.videos.routes" in modules
    assert _loaded(modules, MODEL_LIBRARIES) == []
    assert step_pipeline_modules(modules) == []


def test_a_started_flux_engine_imported_flux_alone(tiny_model_dir: Path) -> None:
    started = _run(START_ENGINE, tiny_model_dir)
    assert isinstance(started, dict)
    modules = started["modules"]
    assert step_pipeline_modules(modules) == ["ditserve.engine.families.flux.pipeline"]
    assert "diffusers" in modules  # imported by the engine, in its own start phase:
    assert "imports" in started["phases"]
    assert _loaded(modules, VIDEO_CODECS) == []
