"""No import cycles inside the ditserve package: no module reaches itself through imports.

Counts every import grimp sees - module level, inside functions (lazy), and under
TYPE_CHECKING - since each of them ties the modules' designs together the same way. The
layer contracts (pyproject.toml, ``make lint``) say which direction is allowed; this test
catches a cycle between modules that no contract names.

Two coarser checks sit beside it: no loop between the engine's folders (a family's folder
counts as two: its pure record and its torch-side code), and no package-init cycle - a module
that its package's ``__init__`` imports, importing names from that half-initialised package
(``from pkg import submodule``), which grimp records as an import of the submodule and so
cannot see.

grimp (import-linter's graph builder) reads packages from the filesystem and cannot follow
setup.py's folder mapping, so the sources are laid out as the installed package would look
and the graph is built in a child interpreter without site hooks, as scripts/lint-imports.sh
does.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FIND_CYCLES = r"""
import json, sys
import grimp

graph = grimp.build_graph("ditserve")
edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
""" + r"""
def unit(module):
    # A folder (or root module) of the engine; a family's folder is its record and its code.
    parts = module.split(".")
    if len(parts) < 3 or parts[1] != "engine":
        return None
    if parts[2] == "families":
        return "families (code)" if len(parts) >= 5 else "families (records)"
    return parts[2]

if sys.argv[1:] == ["folders"]:
    folded = {}
    for module, targets in edges.items():
        if unit(module) is not None:
            folded.setdefault(unit(module), set()).update(
                unit(t) for t in targets if unit(t) not in (None, unit(module)))
    edges = folded
""" + r"""
index, low, on_stack, stack, cycles = {}, {}, set(), [], []
for root in sorted(edges):
    if root in index:
        continue
    # Tarjan's strongly connected components, iteratively (import chains are deep).
    work = [(root, iter(sorted(edges.get(root, ()))))]
    index[root] = low[root] = len(index)
    stack.append(root); on_stack.add(root)
    while work:
        node, children = work[-1]
        child = next(children, None)
        if child is not None:
            if child not in index:
                index[child] = low[child] = len(index)
                stack.append(child); on_stack.add(child)
                work.append((child, iter(sorted(edges.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
            continue
        work.pop()
        if work:
            low[work[-1][0]] = min(low[work[-1][0]], low[node])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop(); on_stack.discard(member); component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))
json.dump(cycles, sys.stdout)
"""


def strongly_connected(tmp_path: Path, *args: str) -> list[list[str]]:
    package = tmp_path / "ditserve"
    package.mkdir()
    shutil.copy(ROOT / "ditserve" / "__init__.py", package)
    for folder in ("engine", "cachectl", "operator"):
        shutil.copytree(ROOT / folder, package / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    site = sysconfig.get_paths()["purelib"]
    done = subprocess.run(
        [sys.executable, "-S", "-c", FIND_CYCLES, *args], cwd=tmp_path, capture_output=True,
        text=True, timeout=120, env={"PYTHONPATH": f"{tmp_path}:{site}"}, check=True,
    )
    cycles: list[list[str]] = json.loads(done.stdout)
    return cycles


def test_no_module_of_the_package_imports_itself_through_others(tmp_path: Path) -> None:
    cycles = strongly_connected(tmp_path)
    assert cycles == [], "import cycles (each a set of modules that import each other):\n" + \
        "\n".join(" <-> ".join(c) for c in cycles)


def test_no_loop_between_the_engines_folders(tmp_path: Path) -> None:
    loops = strongly_connected(tmp_path, "folders")
    assert loops == [], "folders of engine/ that reach each other through imports:\n" + \
        "\n".join(" <-> ".join(c) for c in loops)


TOPS = {"engine": "ditserve.engine", "cachectl": "ditserve.cachectl",
        "operator": "ditserve.operator"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts[0] = TOPS[parts[0]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_level_imports(path: Path) -> list[ast.ImportFrom | ast.Import]:
    """The imports a module runs when it is imported (not those inside functions)."""
    found: list[ast.ImportFrom | ast.Import] = []
    pending: list[ast.stmt] = list(ast.parse(path.read_text(encoding="utf-8")).body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, (ast.If, ast.Try)):
            pending.extend(node.body + node.orelse + getattr(node, "handlers", []))
        elif isinstance(node, ast.ExceptHandler):
            pending.extend(node.body)
    return found


def test_no_module_imports_names_from_its_half_initialised_package() -> None:
    files = {module_name(p): p for top in TOPS for p in (ROOT / top).rglob("*.py")}
    imported = {name: {n.module if isinstance(n, ast.ImportFrom) else a.name
                       for n in module_level_imports(path)
                       for a in (n.names if isinstance(n, ast.Import) else [n])
                       if (n.module if isinstance(n, ast.ImportFrom) else a.name)}
                for name, path in files.items()}
    cycles = []
    for package, path in files.items():
        if path.name != "__init__.py":
            continue
        # The package's own modules its __init__ runs, directly or through each other.
        running, todo = set(), [package]
        while todo:
            for target in imported.get(todo.pop(), ()):
                if target.startswith(package + ".") and target in files and target not in running:
                    running.add(target)
                    todo.append(target)
        for module in running:
            for node in module_level_imports(files[module]):
                if isinstance(node, ast.ImportFrom) and node.module == package:
                    cycles.append(f"{module} (line {node.lineno}) imports from {package}, "
                                  "whose __init__ is still running")
    assert cycles == [], "\n".join(cycles) + "\nimport the submodule by its full name instead"
