"""No import cycles inside the ditserve package: no module reaches itself through imports.

Counts every import grimp sees - module level, inside functions (lazy), and under
TYPE_CHECKING - since each of them ties the modules' designs together the same way. The
layer contracts (pyproject.toml, ``make lint``) say which direction is allowed; this test
catches a cycle between modules that no contract names.

grimp (import-linter's graph builder) reads packages from the filesystem and cannot follow
setup.py's folder mapping, so the sources are laid out as the installed package would look
and the graph is built in a child interpreter without site hooks, as scripts/lint-imports.sh
does.
"""

from __future__ import annotations

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
index, low, on_stack, stack, cycles = {}, {}, set(), [], []
for root in sorted(graph.modules):
    if root in index:
        continue
    # Tarjan's strongly connected components, iteratively (import chains are deep).
    work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
    index[root] = low[root] = len(index)
    stack.append(root); on_stack.add(root)
    while work:
        node, children = work[-1]
        child = next(children, None)
        if child is not None:
            if child not in index:
                index[child] = low[child] = len(index)
                stack.append(child); on_stack.add(child)
                work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
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


def test_no_module_of_the_package_imports_itself_through_others(tmp_path: Path) -> None:
    package = tmp_path / "ditserve"
    package.mkdir()
    shutil.copy(ROOT / "ditserve" / "__init__.py", package)
    for folder in ("engine", "cachectl", "operator"):
        shutil.copytree(ROOT / folder, package / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    site = sysconfig.get_paths()["purelib"]
    done = subprocess.run(
        [sys.executable, "-S", "-c", FIND_CYCLES], cwd=tmp_path, capture_output=True,
        text=True, timeout=120, env={"PYTHONPATH": f"{tmp_path}:{site}"}, check=True,
    )
    cycles = json.loads(done.stdout)
    assert cycles == [], "import cycles (each a set of modules that import each other):\n" + \
        "\n".join(" <-> ".join(c) for c in cycles)
