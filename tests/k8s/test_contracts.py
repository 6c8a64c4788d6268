"""What the operator renders is what the other components accept: the engine's `serve`
command line and config file, and `cachectl ensure`, parsed by their real parsers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ditserve.cachectl.cli import build_parser as cachectl_parser
from ditserve.engine.cli.main import build_parser as engine_parser
from ditserve.operator.judge import engine_config
from ditserve.operator.render import Owner, render
from ditserve.operator.spec import parse_spec

OWNER = Owner(name="flux", namespace="ml", uid="u", generation=1)
SPECS = {
    "hostpath-dlo": {"model": {"hostPath": "/mnt/models/flux", "sizeGiB": 24},
                     "parallelism": {"data": 2},
                     "offload": {"enabled": True, "runtimeCache": {"enabled": True}},
                     "engine": {"port": 9000, "args": ["--log-level", "debug"]}},
    "engine-options-in-args": {"model": {"hostPath": "/mnt/models/flux", "sizeGiB": 24},
                               "engine": {"args": ["--max-bypass", "0",
                                                   "--default-steps", "20"]}},
    "pvc": {"model": {"persistentVolumeClaim": {"claimName": "m", "subPath": "x"},
                      "dtype": "float16"},
            "cache": {"persistentVolumeClaim": {"claimName": "cache"}}},
}


def _kids(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["kind"]: m for m in render(parse_spec(spec), OWNER)}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_engine_reads_the_rendered_command_and_config(name: str, tmp_path: Path) -> None:
    from ditserve.engine.server.main import configs_from_args

    kids = _kids(SPECS[name])
    engine = kids["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    config_file = tmp_path / "engine.yaml"
    config_file.write_text(kids["ConfigMap"]["data"]["engine.yaml"])
    command = [*engine["command"], *engine.get("args", [])]
    assert command[0] == "ditserve"
    argv = [config_file.as_posix() if a == "/etc/ditserve/engine.yaml" else a for a in command[1:]]
    args = engine_parser().parse_args(argv)
    assert args.command == "serve"
    engine_cfg, server_cfg = configs_from_args(args)
    assert engine_cfg == engine_config(parse_spec(SPECS[name]))
    assert (server_cfg.host, server_cfg.port) == ("0.0.0.0", engine["ports"][0]["containerPort"])


@pytest.mark.parametrize("name", sorted(SPECS))
def test_cachectl_accepts_the_init_container(name: str) -> None:
    (init,) = _kids(SPECS[name])["Deployment"]["spec"]["template"]["spec"]["initContainers"]
    assert init["command"][0] == "cachectl"
    args = cachectl_parser().parse_args(init["command"][1:])
    assert args.command == "ensure"
    assert str(args.root) == "/var/cache/ditserve"
    assert args.dtype == parse_spec(SPECS[name]).model.dtype
    assert args.no_daemon == (name == "pvc")


def test_judging_a_spec_imports_nothing_heavy() -> None:
    """The operator judges engine.args with the engine's own parser (engine.server.options),
    which must stay light: no torch, no diffusers, no FastAPI, no uvicorn, and neither the
    engine's CLI nor its server runtime in the operator process."""
    import subprocess
    import sys

    heavy = ("torch", "diffusers", "transformers", "fastapi", "starlette", "uvicorn",
             "ditserve.engine.cli.main", "ditserve.engine.server.main", "ditserve.engine.server.app")
    code = ("import sys; import ditserve.operator.judge; import ditserve.operator.handlers; "
            "from ditserve.operator.judge import validate; "
            "validate({'model': {'hostPath': '/mnt/models/m'}, "
            "'engine': {'args': ['--log-level', 'info', '--shutdown-grace', '90']}}); "
            f"print(sorted(m for m in sys.modules if m in {heavy!r} "
            "or m.split('.')[0] in {'torch', 'diffusers', 'fastapi', 'uvicorn'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=60)
    assert out.stdout.strip() == "[]"


def test_the_serve_parser_the_operator_judges_with_is_the_clis() -> None:
    """One parser: `ditserve serve` and the operator's judgement accept the same flags."""
    import argparse

    from ditserve.engine.server.options import build_serve_parser

    sub = next(a for a in engine_parser()._actions if isinstance(a, argparse._SubParsersAction))
    cli_flags = {f for a in sub.choices["serve"]._actions for f in a.option_strings}
    assert cli_flags == {f for a in build_serve_parser()._actions for f in a.option_strings}
