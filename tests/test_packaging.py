"""The distribution maps its folders under `ditserve` and never shadows the stdlib."""

import importlib
import subprocess
import sys


def test_subpackages_import_under_ditserve() -> None:
    for name in ("ditserve.engine", "ditserve.cachectl", "ditserve.operator"):
        module = importlib.import_module(name)
        assert module.__doc__


def test_operator_folder_never_shadows_stdlib_operator() -> None:
    # A fresh interpreter started from the repository root must still see the stdlib module.
    out = subprocess.run(
        [sys.executable, "-c", "import operator; print(hasattr(operator, 'itemgetter'))"],
        capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip() == "True"


def test_pure_modules_import_no_torch() -> None:
    code = "import sys, ditserve.engine.config, ditserve.engine.request, ditserve.engine.sched.scheduler; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_cli_parses_without_torch() -> None:
    # `ditserve --help`, the operator's judge and every command's flags parse before any
    # heavy import; torch comes with the command that needs it.
    code = "import sys, ditserve.engine.cli.main; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
