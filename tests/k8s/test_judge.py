"""judge: engine.args through the real `ditserve serve` parser and the engine's own rules,
the flags the operator manages refused, and names every child can take."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from ditserve.engine.cli.main import build_parser
from ditserve.operator.errors import InvalidSpecError
from ditserve.operator.judge import MANAGED_FLAGS, engine_config, judge_engine, validate
from ditserve.operator.render import Owner, render
from ditserve.operator.spec import parse_spec


def spec_with(args: list[str], **overrides: Any) -> dict[str, Any]:
    return {"model": {"hostPath": "/mnt/models/flux", "sizeGiB": 4},
            "engine": {"args": args}, **overrides}


def test_every_managed_flag_is_a_real_serve_flag() -> None:
    """The table follows the engine's CLI: a renamed flag would silently escape the check."""
    import contextlib
    import io

    parsed = build_parser().parse_args(["serve"])
    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    for dest, (flag, _) in MANAGED_FLAGS.items():
        assert hasattr(parsed, dest), dest
        assert f"{flag} " in help_text.getvalue() or f"{flag}\n" in help_text.getvalue(), flag


@pytest.mark.parametrize(("args", "owner"), [
    (["--data-parallel-size", "4"], "parallelism.data"),
    (["--data-par", "4"], "parallelism.data"),  # argparse takes unambiguous prefixes
    (["--port=9000"], "engine.port"),
    (["--host", "127.0.0.1"], "the operator"),
    (["--api-key", "secret"], "engine.apiKeySecret"),
    (["--model", "/elsewhere"], "model.hostPath"),
    (["--offload", "dlo"], "offload.enabled"),
    (["--dlo-no-use-allgather"], "offload.useAllGather"),
    (["--config", "/tmp/x.yaml"], "ConfigMap"),
])
def test_flags_the_operator_sets_are_refused(args: list[str], owner: str) -> None:
    with pytest.raises(InvalidSpecError, match=f"engine.args must not set --.*{owner}"):
        validate(spec_with(args))


def test_arguments_the_engine_does_not_know_are_refused_with_its_own_words() -> None:
    with pytest.raises(InvalidSpecError, match="unrecognized arguments: --no-such-flag"):
        validate(spec_with(["--no-such-flag"]))
    with pytest.raises(InvalidSpecError, match="invalid choice: 'int8'"):
        validate(spec_with(["--dtype", "int8"]))
    with pytest.raises(InvalidSpecError, match="not valid `ditserve serve` arguments"):
        validate(spec_with(["--help"]))


def test_engine_options_in_args_are_judged_with_the_spec() -> None:
    # An HBM budget keeps blocks resident, which AllGather sharding over DP 2 cannot do.
    bad = spec_with(["--dlo-hbm-budget-gib", "10"], parallelism={"data": 2},
                    offload={"enabled": True})
    with pytest.raises(InvalidSpecError, match="resident layers are not supported with AllGather"):
        validate(bad)
    with pytest.raises(InvalidSpecError, match="server.default_size must look like"):
        validate(spec_with(["--default-size", "huge"]))


def test_allowed_options_reach_every_rank_through_the_config_file() -> None:
    spec = parse_spec(spec_with(["--max-bypass", "2",
                                 "--dlo-gather", "copy-engine", "--log-level", "debug"],
                                parallelism={"data": 2}, offload={"enabled": True}))
    config = engine_config(spec)
    assert config.scheduler.max_bypass == 2
    assert config.offload.gather == "copy-engine"
    _, server = judge_engine(spec)
    assert (server.log_level, server.host, server.port) == ("debug", "0.0.0.0", 8000)
    kids = {m["kind"]: m for m in render(spec, Owner("flux", "ml", "u"))}
    written = yaml.safe_load(kids["ConfigMap"]["data"]["engine.yaml"])
    assert written["scheduler"]["max_bypass"] == 2 and written["offload"]["gather"] == "copy-engine"


def test_the_api_key_is_never_read_while_judging(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DITSERVE_API_KEY", "operator-side-secret")
    _, server = judge_engine(parse_spec(spec_with([])))
    assert server.api_key is None


@pytest.mark.parametrize(("name", "ok"), [("flux", True), ("flux-dev-2", True), ("x" * 52, True),
                                          ("x" * 53, False), ("flux.dev", False),
                                          ("Flux", False), ("1flux", False), ("flux-", False)])
def test_names_every_child_can_take(name: str, ok: bool) -> None:
    spec = spec_with([])
    if ok:
        validate(spec, name=name)
    else:
        with pytest.raises(InvalidSpecError, match="metadata.name"):
            validate(spec, name=name)
