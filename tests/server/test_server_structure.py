"""The server's shape, checked: one package per endpoint family, each making its router in its
``routes.py`` and named in the import-linter contract that keeps those packages independent;
routes share helpers through public modules (no private name imported from another server
module, nor reached through an imported module); and the engine is always held as the typed
``EngineClient``, never as ``Any``."""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "engine" / "server"
CONTRACT = "server layers"


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


def _server_modules_bound(tree: ast.AST) -> set[str]:
    """The names a module binds to server modules (``from ditserve.engine.server.x import
    y``, where y may be a module, and ``import ditserve.engine.server.x as y``)."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "ditserve.engine.server"):
            bound.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            bound.update(alias.asname for alias in node.names
                         if alias.asname and alias.name.startswith("ditserve.engine.server"))
    return bound


def test_no_server_module_reaches_a_private_name_through_a_module() -> None:
    reached = [f"{name}:{node.lineno} {node.value.id}.{node.attr}"
               for name, tree in _trees().items() if (bound := _server_modules_bound(tree))
               for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
               and node.value.id in bound and node.attr.startswith("_")
               and not node.attr.startswith("__")]
    assert reached == [], f"make the shared helper public in a shared module: {reached}"


def test_the_engine_is_never_typed_any() -> None:
    untyped = [f"{name}:{node.lineno}" for name, tree in _trees().items()
               for node in ast.walk(tree)
               if isinstance(node, ast.arg) and node.arg == "engine"
               and isinstance(node.annotation, ast.Name) and node.annotation.id == "Any"]
    assert untyped == [], f"annotate the engine as engine.loop.client.EngineClient: {untyped}"


def _layers() -> list[str]:
    """The server contract's layers, top first, as written in pyproject.toml."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    contract = next(c for c in config["tool"]["importlinter"]["contracts"]
                    if c["name"].startswith(CONTRACT))
    return list(contract["layers"])


def _names(layer: str) -> set[str]:
    return {name.strip() for name in layer.replace(":", "|").split("|")}


def test_every_server_module_is_in_a_layer_of_the_contract() -> None:
    modules = {path.stem for path in SERVER.glob("*.py") if path.stem != "__init__"} | {
        path.parent.name for path in SERVER.glob("*/__init__.py")}
    placed = set().union(*map(_names, _layers()))
    assert modules - placed == set(), (
        f"place each server module and package in a layer of the {CONTRACT!r} contract "
        f"(pyproject.toml): {sorted(modules - placed)}")


def test_every_endpoint_package_is_an_independent_layer_of_the_contract() -> None:
    endpoints = {path.parent.name for path in SERVER.glob("*/routes.py")}
    assert {"images", "edits", "videos", "adapters", "models", "probes"} <= endpoints
    layer = next(layer for layer in _layers() if "images" in _names(layer))
    assert ":" not in layer, "the endpoint packages must be independent (|), not siblings (:)"
    assert _names(layer) == endpoints, (
        f"name each endpoint package (a folder with routes.py) in the {CONTRACT!r} contract's "
        "endpoint layer of pyproject.toml, joined by '|'")


def test_routers_are_made_only_in_an_endpoint_packages_routes() -> None:
    makers = [name for name, tree in _trees().items() for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "APIRouter"
              and not (name.endswith("/routes.py") and name.count("/") == 1)]
    assert makers == [], f"a route belongs in its endpoint package's routes.py: {makers}"
