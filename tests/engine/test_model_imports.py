"""The model's libraries imported on a thread of their own (``runner.model_imports``): the
join waits for them and records both phases, a failed import is raised again by the join with
its own message, and a start after a failed background import imports in place. A fake
importer stands in for diffusers where the test needs one."""

from __future__ import annotations

import threading

import pytest

from ditserve.engine.families import FLUX
from ditserve.engine.runner import model_imports
from ditserve.engine.runner.model_imports import (
    ModelImports,
    import_in_background,
    join_model_imports,
    wait_for_model_imports,
)
from ditserve.engine.runner.start_phases import StartTimeline


def _timeline() -> StartTimeline:
    return StartTimeline(process_age=lambda: None)


def test_the_import_runs_on_its_own_thread_and_the_join_records_both_phases() -> None:
    release, seen = threading.Event(), []

    def importer(family: object) -> None:
        # Finishes only once the caller is past start(): the two run at once.
        assert release.wait(timeout=60)
        seen.append((family, threading.current_thread().name))

    imports = ModelImports(FLUX, importer=importer).start()
    release.set()
    timeline = _timeline()
    imports.join(timeline)
    assert seen == [(FLUX, "model-imports")]
    phases = timeline.report()["phases"]
    assert {"imports", "imports_wait"} <= phases.keys()
    assert imports.seconds is not None and phases["imports"] == imports.seconds


def test_a_failed_import_is_raised_by_the_join_with_its_message() -> None:
    def missing(family: object) -> None:
        raise ModuleNotFoundError("No module named 'diffusers'", name="diffusers")

    imports = ModelImports(FLUX, importer=missing).start()
    timeline = _timeline()
    with pytest.raises(ModuleNotFoundError, match="No module named 'diffusers'") as raised:
        imports.join(timeline)
    assert raised.value.name == "diffusers"
    assert "imports_wait" in timeline.report()["phases"]  # the wait is reported all the same


def test_the_start_joins_the_pending_import_once_then_imports_in_place() -> None:
    def broken(family: object) -> None:
        raise ImportError("cannot import name 'FluxPipeline' from 'diffusers'")

    import_in_background(FLUX, importer=broken)
    with pytest.raises(ImportError, match="cannot import name 'FluxPipeline'"):
        wait_for_model_imports(FLUX, _timeline())
    assert model_imports._pending is None  # joined once; nothing left to join
    # The next start imports in place (the real diffusers here), as phase ``imports``.
    timeline = _timeline()
    wait_for_model_imports(FLUX, timeline)
    assert "imports" in timeline.report()["phases"]
    assert "imports_wait" not in timeline.report()["phases"]


def test_the_start_imports_in_place_when_nothing_was_started() -> None:
    timeline = _timeline()
    wait_for_model_imports(FLUX, timeline)
    assert list(timeline.report()["phases"]) == ["imports"]



def test_the_engines_start_joins_first_and_reading_the_weights_imports_nothing_more() -> None:
    imported = []
    import_in_background(FLUX, importer=imported.append)
    timeline = _timeline()
    assert join_model_imports(timeline) is True  # the engine's start (open_executor)
    assert join_model_imports(timeline) is False  # once
    assert imported == [FLUX]
    assert {"imports", "imports_wait"} <= timeline.report()["phases"].keys()
