"""What ``ditserve serve`` imports (issue 50, time to ready): the server side of a replica is
built without the model's libraries, and a started engine has imported its own family only.

Each check runs in a fresh interpreter (``python -P``; this test process has imported
everything long ago) and reads its ``sys.modules``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
from ditserve.engine.loop.startup import start_model_imports
from ditserve.engine.runner.model_imports import wait_for_model_imports
from ditserve.engine.weights.loader import model_family
start_model_imports(sys.argv[1])  # `serve` starts them first, on their own thread
wait_for_model_imports(model_family(sys.argv[1]), engine.start_timeline)  # the engine's join
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


def _run(script: str, model_dir: Path | str) -> object:
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
    # Then they are imported on their own thread and joined, with phases of their own
    # (before any step pipeline).
    assert {"diffusers", "transformers"} <= set(found["imported"])
    assert {"imports", "imports_wait"} <= set(found["phases"])
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


# `serve`'s start without uvicorn: the background import first (``run_server``), the server's
# build, then the engine's start (the lifespan's, on a worker thread). Records the threads
# that imported a module of the model's libraries before the engine's join (while the
# background import is pending).
SERVE_START = """
import json, sys, threading
BEFORE_JOIN = set()
class Watch:
    def find_spec(self, name, path=None, target=None):
        imports = sys.modules.get("ditserve.engine.runner.model_imports")
        if (name.split(".")[0] in ("diffusers", "transformers")
                and getattr(imports, "_pending", None) is not None):
            BEFORE_JOIN.add(threading.current_thread().name)
sys.meta_path.insert(0, Watch())
from ditserve.engine.cli.main import build_parser
from ditserve.engine.loop.startup import start_model_imports
from ditserve.engine.server.main import build_server, configs_from_args
model = ["--model", sys.argv[1]] if sys.argv[1] else []  # none: the embedded tiny model
args = build_parser().parse_args(["serve", *model, "--port", "0", "--device", "cpu"])
engine_config, server_config = configs_from_args(args)
start_model_imports(engine_config.model)
server, engine = build_server(engine_config, server_config, on_start_failed=print)
worker = threading.Thread(target=engine.start, name="engine-start")
worker.start(); worker.join()
try:
    phases = engine.start_report()["phases"]
    ready = engine.ready
finally:
    engine.shutdown()
json.dump({"threads": sorted(BEFORE_JOIN), "phases": sorted(phases), "ready": ready},
          sys.stdout)
"""


@pytest.mark.parametrize("family", ["flux", "wan", "embedded"])
def test_serve_imports_the_model_libraries_on_their_own_thread(
        family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ditserve.engine.makers.tiny_model import init_tiny

    if family == "embedded":
        # No --model: the engine's start builds the embedded tiny Flux (with diffusers'
        # classes) before it loads it, in a fresh home.
        monkeypatch.setenv("DITSERVE_HOME", str(tmp_path / "home"))
        model: Path | str = ""
    else:
        model = init_tiny(tmp_path / family, family=family)
    found = _run(SERVE_START, model)
    assert isinstance(found, dict)
    assert found["ready"] is True
    # Nothing but the background thread imported diffusers or transformers: the server's
    # build and the engine's start before its join imported none of their modules.
    assert found["threads"] == ["model-imports"]
    assert {"imports", "imports_wait", "read", "warm_up"} <= set(found["phases"])


# Imported by ``serve`` before the background thread starts, then what each side imports on
# top: the server's build and the model's libraries may share standard-library modules only
# (everything else both need is in ``model_imports.SHARED_FIRST``).
SIDE = """
import importlib, json, sys
from ditserve.engine.runner import model_imports
for name in model_imports.SHARED_FIRST:
    importlib.import_module(name)
before = set(sys.modules)
if sys.argv[2] == "server":
    from ditserve.engine.cli.main import build_parser
    from ditserve.engine.server.main import build_server, configs_from_args
    args = build_parser().parse_args(["serve", "--model", sys.argv[1], "--port", "0"])
    build_server(*configs_from_args(args), on_start_failed=print)
else:
    from ditserve.engine.weights.loader import import_pipeline_class, model_family
    import_pipeline_class(model_family(sys.argv[1]))
json.dump(sorted(set(sys.modules) - before), sys.stdout)
"""


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_the_server_and_the_model_libraries_share_only_the_standard_library(
        family: str, tmp_path: Path) -> None:
    from ditserve.engine.makers.tiny_model import init_tiny

    model_dir = init_tiny(tmp_path / family, family=family)
    sides = []
    for side in ("server", "model"):
        done = subprocess.run([sys.executable, "-P", "-c", SIDE, str(model_dir), side],
                              capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-4000:]
        sides.append(set(json.loads(done.stdout.splitlines()[-1])))
    server, model = sides
    assert "fastapi" in server and "diffusers" in model
    shared = {name.split(".")[0] for name in server & model}
    # (``_sysconfigdata_*``: the standard library's build-time settings, named per platform)
    assert sorted(name for name in shared - set(sys.stdlib_module_names)
                  if not name.startswith("_sysconfigdata_")) == []


# `serve` where the family's pipeline module cannot be imported (``None`` in sys.modules
# makes its import fail; the server's build reads that module's source, never imports it):
# the start fails with the import's own error, logged, and serve exits 1.
SERVE_WITHOUT_PIPELINE = """
import logging, sys
sys.modules["diffusers.pipelines.flux.pipeline_flux"] = None
logging.basicConfig(level=logging.INFO)
from ditserve.engine.cli.main import build_parser
from ditserve.engine.server.main import run_server, configs_from_args
args = build_parser().parse_args(["serve", "--model", sys.argv[1], "--host", "127.0.0.1",
                                  "--port", "0", "--device", "cpu"])
sys.exit(run_server(*configs_from_args(args)))
"""


def test_a_failed_background_import_fails_the_start_with_its_message(
        tiny_model_dir: Path) -> None:
    done = subprocess.run([sys.executable, "-P", "-c", SERVE_WITHOUT_PIPELINE,
                           str(tiny_model_dir)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 1, done.stderr[-4000:]
    failed = [line for line in done.stderr.splitlines()
              if "the engine failed to start:" in line]
    assert failed, done.stderr[-4000:]
    # diffusers' own message (its lazy module wraps the import's error), as without the thread
    assert "Failed to import diffusers.pipelines.flux.pipeline_flux" in failed[0]
    assert "import of diffusers.pipelines.flux.pipeline_flux halted" in done.stderr


def test_a_failed_server_build_waits_for_the_import_thread_then_raises(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ditserve.engine.config import EngineConfig
    from ditserve.engine.runner import model_imports
    from ditserve.engine.server import main
    from ditserve.engine.server.config import ServerConfig

    def broken_build(*args: object, **kwargs: object) -> None:
        assert model_imports._pending is not None  # the import thread was started first
        raise RuntimeError("cannot build the app")

    monkeypatch.setattr(main, "build_server", broken_build)
    with pytest.raises(RuntimeError, match="cannot build the app"):
        main.run_server(EngineConfig(model=str(tiny_model_dir), device="cpu"), ServerConfig())
    assert model_imports._pending is None  # joined before the error left run_server
