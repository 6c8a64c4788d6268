"""The code's shape, checked: no module over 350 lines, no function over 80 lines, every
engine module in a layer of the import contracts.

Small modules that own one concept and functions that fit on a screen are what keeps the engine
readable as families and features are added (docs/architecture.md). Import cycles have their
own test (test_import_cycles.py).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"engine": "ditserve.engine", "cachectl": "ditserve.cachectl",
            "operator": "ditserve.operator"}
MAX_MODULE_LINES = 350
MAX_FUNCTION_LINES = 80


def _sources() -> dict[str, Path]:
    """Every module of the three packages, by its dotted name."""
    found: dict[str, Path] = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


SOURCES = _sources()


def test_no_module_is_longer_than_the_limit() -> None:
    long = {name: n for name, path in SOURCES.items()
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines (split them by concept): {long}"


def test_no_function_is_longer_than_the_limit() -> None:
    long = []
    for name, path in SOURCES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name} ({lines} lines)")
    assert long == [], f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def _engine_layers() -> list[str]:
    """The modules and packages the "engine layers" contract lists, with the family code that
    scripts/family_contracts.py adds to the pipelines layer."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    contract = next(c for c in config["tool"]["importlinter"]["contracts"]
                    if c["name"].startswith("engine layers"))
    spec = importlib.util.spec_from_file_location("family_contracts",
                                                  ROOT / "scripts" / "family_contracts.py")
    assert spec is not None and spec.loader is not None
    generated = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generated)
    entries = [*contract["layers"], generated.pipelines_layer(ROOT)]
    return [name.strip() for layer in entries for name in layer.replace("|", ":").split(":")]


def _imports_nothing(path: Path) -> bool:
    """A package ``__init__`` that is only its docstring (its modules are layered one by one)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return path.name == "__init__.py" and not any(
        isinstance(node, (ast.Import, ast.ImportFrom)) for node in ast.walk(tree))


def test_every_engine_module_is_in_a_layer() -> None:
    # The family records and the registry are the one exception: pure data that every layer
    # reads, kept pure by their own (generated) contract.
    records = {"ditserve.engine", "ditserve.engine.families", "ditserve.engine.families.base",
               "ditserve.engine.families.defaults"} | {
        f"ditserve.engine.families.{p.parent.name}"
        for p in (ROOT / "engine" / "families").glob("*/__init__.py")}
    layers = _engine_layers()
    outside = [name for name, path in SOURCES.items()
               if name.startswith("ditserve.engine") and name not in records
               and not _imports_nothing(path)
               and not any(name == layer or name.startswith(layer + ".") for layer in layers)]
    assert outside == [], ("engine modules in no layer of the \"engine layers\" contract "
                           f"(pyproject.toml): {outside}")
