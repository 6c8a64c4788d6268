"""Writes the import-linter contracts that follow from the family folders (engine/families/*/).

A family lives in one folder (docs/architecture.md, "Adding a family"), so the contracts that
keep families apart are derived from the folders rather than listed by hand: adding a family
touches its folder and the registry, never pyproject.toml. Called by scripts/lint-imports.sh,
which appends the output to the contracts of pyproject.toml.

- "family records are pure": each folder's ``__init__`` (the record) and the registry import
  no torch, diffusers, fastapi or kubernetes.
- "family folders are independent": one family's modules never import another's, except
  that a family whose record imports another family's record is derived from it (the same
  DiT in another layout) and may use that family's modules. The registry
  (``ditserve.engine.families``) is the sanctioned way to look any record up, so imports of
  it are not paths between families.
- "family torch-side modules sit in the pipelines layer": every module of a folder other
  than its record goes beside ``ditserve.engine.pipelines`` in the engine layers contract.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = "ditserve.engine.families"


def family_folders(root: Path) -> list[Path]:
    families = root / "engine" / "families"
    return sorted(p for p in families.iterdir() if (p / "__init__.py").is_file())


def bases_of(folder: Path, names: set[str]) -> list[str]:
    """The families whose records this family's record imports (the families it derives from)."""
    tree = ast.parse((folder / "__init__.py").read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE + "."):
            name = node.module.split(".")[3]
            if name in names and name != folder.name and name not in found:
                found.append(name)
    return found


def torch_side_modules(folder: Path) -> list[str]:
    return [f"{PACKAGE}.{folder.name}.{p.stem}" for p in sorted(folder.glob("*.py"))
            if p.stem != "__init__"]


def quoted(items: list[str]) -> str:
    return "[" + ", ".join(f'"{i}"' for i in items) + "]"


def contracts(root: Path) -> str:
    folders = family_folders(root)
    names = {f.name for f in folders}
    records = [PACKAGE, f"{PACKAGE}.base", f"{PACKAGE}.defaults"] + [
        f"{PACKAGE}.{f.name}" for f in folders]
    ignores = ["ditserve.** -> ditserve.engine.families"]
    for folder in folders:
        for base in bases_of(folder, names):
            ignores.append(f"{PACKAGE}.{folder.name}.** -> {PACKAGE}.{base}.**")
            ignores.append(f"{PACKAGE}.{folder.name}.** -> {PACKAGE}.{base}")
            ignores.append(f"{PACKAGE}.{folder.name} -> {PACKAGE}.{base}")
    return "\n".join([
        "",
        "[[tool.importlinter.contracts]]",
        'name = "family records are pure (generated from engine/families/)"',
        'type = "forbidden"',
        f"source_modules = {quoted(records)}",
        'forbidden_modules = ["torch", "fastapi", "diffusers", "transformers", "kubernetes"]',
        "as_packages = false",
        "",
        "[[tool.importlinter.contracts]]",
        'name = "family folders are independent (generated from engine/families/)"',
        'type = "independence"',
        f"modules = {quoted([f'{PACKAGE}.{f.name}' for f in folders])}",
        f"ignore_imports = {quoted(ignores)}",
        # Derived families differ in which of their modules reach their base.
        'unmatched_ignore_imports_alerting = "none"',
        "",
    ])


def pipelines_layer(root: Path) -> str:
    """The engine layers contract's pipelines layer, with every family's torch-side modules."""
    modules = ["ditserve.engine.pipelines"]
    for folder in family_folders(root):
        modules += torch_side_modules(folder)
    return " : ".join(modules)


if __name__ == "__main__":
    repo = Path(sys.argv[1])
    if sys.argv[2:] == ["--pipelines-layer"]:
        print(pipelines_layer(repo))
    else:
        print(contracts(repo))
