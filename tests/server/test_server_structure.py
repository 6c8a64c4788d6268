"""The server's shape, checked: routes share helpers through public modules (no private name
imported from another server module), and the engine is always held as the typed
``EngineClient``, never as ``Any``."""

from __future__ import annotations

import ast
from pathlib import Path

SERVER = Path(__file__).resolve().parents[2] / "engine" / "server"


def _trees() -> dict[str, ast.AST]:
    return {str(path.relative_to(SERVER)): ast.parse(path.read_text(encoding="utf-8"))
            for path in sorted(SERVER.rglob("*.py"))}


def test_no_server_module_imports_a_private_name_of_another() -> None:
    private = [f"{name}: {node.module}.{alias.name}"
               for name, tree in _trees().items() for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and node.module
               and node.module.startswith("ditserve.engine.server")
               for alias in node.names if alias.name.startswith("_")]
    assert private == [], f"make the shared helper public in a shared module: {private}"


def test_the_engine_is_never_typed_any() -> None:
    untyped = [f"{name}:{node.lineno}" for name, tree in _trees().items()
               for node in ast.walk(tree)
               if isinstance(node, ast.arg) and node.arg == "engine"
               and isinstance(node.annotation, ast.Name) and node.annotation.id == "Any"]
    assert untyped == [], f"annotate the engine as engine.loop.client.EngineClient: {untyped}"
