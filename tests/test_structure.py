"""The code's shape, checked: no module over 350 lines, no function over 80 lines.

Small modules that own one concept and functions that fit on a screen are what keeps the engine
readable as families and features are added (docs/architecture.md). Import cycles have their
own test (test_import_cycles.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

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
