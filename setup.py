"""Maps the top-level folders onto the `ditserve` namespace.

pyproject.toml's package-dir says where each top-level package lives; this file lists every
subpackage under its `ditserve.` name, so new subpackages need no packaging edit. Package
data (the CRD YAML, chart templates) is not needed at run time and is not shipped.
"""

from pathlib import Path

from setuptools import setup

ROOTS = {"ditserve": "ditserve", "ditserve.engine": "engine",
         "ditserve.cachectl": "cachectl", "ditserve.operator": "operator"}


def _packages() -> list[str]:
    names = []
    for name, folder in ROOTS.items():
        for init in sorted(Path(folder).rglob("__init__.py")):
            rel = init.parent.relative_to(folder).parts
            names.append(".".join((name, *rel)))
    return names


setup(packages=_packages(), package_dir=ROOTS)
