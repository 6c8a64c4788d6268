"""The cachectl CLI: its frozen flag set, its exit codes, and build/list/verify/gc/rm on a real
tiny model."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cachectl_support import (
    LIGHT_LOADER,
    cachectl_argv,
    make_identity,
    make_light_model,
    synthetic_tensors,
)

from ditserve.cachectl.cli import build_parser, engine_loader, main, parse_size
from ditserve.cachectl.store import CacheStore


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for a in parser._actions for opt in a.option_strings if opt not in ("-h", "--help")} | {
        a.dest for a in parser._actions if not a.option_strings and a.dest != "command"}


def test_the_cli_surface_is_the_documented_one() -> None:
    # Other components (Helm chart, engine init container) call these exact flags.
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert _flags(parser) == {"--root"}
    assert {name: _flags(p) for name, p in sub.choices.items()} == {
        "build": {"--root", "--model", "--base-model", "--dtype", "--revision", "--component", "--sp-size", "--sp-impl",
                  "--json", "--timeout"},
        "ensure": {"--root", "--model", "--base-model", "--dtype", "--revision", "--component", "--sp-size", "--sp-impl",
                   "--json", "--timeout", "--socket", "--no-daemon", "--daemon-only"},
        "pull": {"--root", "uri", "--workers", "--link", "--socket", "--timeout", "--json",
                 "--no-daemon", "--daemon-only"},
        "verify": {"--root", "keys", "--json", "--threads"},
        "list": {"--root", "--json"},
        "gc": {"--partial-age", "--root", "--max-bytes", "--dry-run", "--json"},
        "rm": {"--root", "keys"},
        "serve": {"--root", "--socket", "--tcp", "--metrics-port", "--metrics-host",
                  "--scrub-interval", "--scrub-rate-mib", "--max-builds", "--grace-period"},
    }


@pytest.mark.parametrize(("text", "value"), [("1024", 1024), ("10G", 10 * 2**30),
                                             ("512MiB", 512 * 2**20), ("1.5k", 1536)])
def test_sizes_parse_in_binary_units(text: str, value: int) -> None:
    assert parse_size(text) == value


def test_root_before_or_after_the_subcommand_or_from_the_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = CacheStore(tmp_path / "c")
    store.publish(make_identity(), synthetic_tensors()).close()
    keys = []
    for argv in (["--root", str(store.root), "list", "--json"],
                 ["list", "--root", str(store.root), "--json"]):
        assert main(argv) == 0
        keys.append([e["key"] for e in json.loads(capsys.readouterr().out)])
    monkeypatch.setenv("DITSERVE_CACHE_ROOT", str(store.root))
    assert main(["list", "--json"]) == 0
    keys.append([e["key"] for e in json.loads(capsys.readouterr().out)])
    assert keys == [[make_identity().key]] * 3


def test_build_list_verify_gc_rm_on_a_tiny_model(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    root = str(tmp_path / "cache")
    assert main(["build", "--root", root, "--model", str(tiny_model), "--dtype", "float32",
                 "--json"]) == 0
    built = json.loads(capsys.readouterr().out)
    assert built["built"] and built["status"] == "ready"

    # The entry holds the loader's final DiT tensors, bit for bit.
    from ditserve.engine.weights.loader import load_dit_state_dict

    expected = load_dit_state_dict(tiny_model, dtype="float32")
    with CacheStore(root).join(built["key"]) as entry:
        got = entry.tensors()
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], v) for k, v in expected.items())

    # Second build: the recipe hits, nothing is hashed or loaded.
    assert main(["build", "--root", root, "--model", str(tiny_model), "--dtype", "float32",
                 "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["key"] == built["key"] and again["via_recipe"] and not again["built"]

    # Another dtype is another entry.
    assert main(["ensure", "--no-daemon", "--root", root, "--model", str(tiny_model),
                 "--dtype", "bfloat16", "--json"]) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert bf16["key"] != built["key"]

    assert main(["list", "--root", root, "--json"]) == 0
    listed = {e["key"]: e for e in json.loads(capsys.readouterr().out)}
    assert set(listed) == {built["key"], bf16["key"]}
    assert listed[bf16["key"]]["identity"]["dtype"] == "bfloat16"

    assert main(["verify", "--root", root]) == 0
    assert capsys.readouterr().out.count("OK ") == 2

    assert main(["gc", "--root", root, "--max-bytes", "0", "--dry-run", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["removed"]) == 2
    assert main(["rm", "--root", root, bf16["key"]]) == 0
    assert main(["gc", "--root", root, "--max-bytes", "1G"]) == 0
    assert CacheStore(root).keys() == [built["key"]]


def test_console_script_runs_as_a_real_process(tmp_path: Path) -> None:
    store = CacheStore(tmp_path / "c")
    ident = make_identity()
    with store.publish(ident, synthetic_tensors()) as e:
        shard = e.files()[0]
    shard.chmod(0o644)
    shard.write_bytes(shard.read_bytes()[:-1] + b"\x7f")
    script = Path(sys.executable).with_name("cachectl")  # the installed console script
    out = subprocess.run([str(script), "--root", str(store.root), "verify", ident.key],
                         capture_output=True, text=True)
    assert out.returncode == 1
    assert f"CORRUPT {ident.key}" in out.stdout and shard.name in out.stdout


def test_errors_exit_3_with_a_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["build", "--root", str(tmp_path / "c"), "--model", str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert rc == 3 and "model directory" in err and "does not exist" in err
    # The missing directory is the error, not the dtype it could not be read from; and the
    # engine's "omit --model" advice does not apply (cachectl needs --model).
    assert "dtype" not in err and "omit --model" not in err


def test_ensure_builds_here_when_the_daemon_cannot_see_the_model(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ditserve.cachectl.client import DaemonClient

    # A daemon that answers but cannot open the path (a PVC mounted only in this pod).
    monkeypatch.setattr(DaemonClient, "available", lambda self: True)
    monkeypatch.setattr(DaemonClient, "ensure", lambda self, *a, **k: (
        400, {"status": "failed", "reason": "bad_request", "error": "model directory missing"}))
    assert main(["ensure", "--root", str(tmp_path / "c"), "--model", str(tiny_model),
                 "--dtype", "float32"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("ready ") and captured.out.rstrip().endswith("(built)")
    assert "building or joining here under the lock instead" in captured.err


def test_an_sp_engine_finds_what_ensure_built_for_its_topology(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    from ditserve.cachectl.identity import Placement
    from ditserve.cachectl.model_build import ModelRequest, ensure_model

    root = tmp_path / "c"
    base = ["ensure", "--no-daemon", "--root", str(root), "--model", str(tiny_model),
            "--dtype", "float32", "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)["key"]
    assert main([*base, "--sp-size", "2", "--sp-impl", "ulysses"]) == 0
    sp = json.loads(capsys.readouterr().out)["key"]
    assert sp != plain

    # Any DP replica and any SP rank of that topology maps the same entry, without loading.
    store = CacheStore(root)
    for dp_rank, sp_rank in ((0, 0), (1, 1)):
        placement = Placement(dp_size=2, dp_rank=dp_rank, sp_size=2, sp_rank=sp_rank,
                              sp_impl="ulysses")
        request = ModelRequest(tiny_model, "float32", placement=placement)
        with ensure_model(store, request, engine_loader()) as entry:
            assert entry.key == sp and entry.via_recipe and not entry.built


def test_exit_codes_are_distinct_and_documented(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    store = CacheStore(tmp_path / "c")
    ident = make_identity()
    with store.publish(ident, synthetic_tensors()) as e:
        shard = e.files()[0]
    root = ["--root", str(store.root)]
    missing = make_identity(seed=9).key
    assert main([*root, "verify", ident.key]) == 0
    # 3: missing or unavailable, for verify and rm alike.
    assert main([*root, "verify", missing]) == 3
    assert f"MISSING {missing}" in capsys.readouterr().out
    assert main([*root, "rm", missing]) == 3
    # 2: usage errors.
    assert main([*root, "verify", "not-a-key"]) == 2
    assert "64 lowercase hex" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main([*root, "gc"])
    assert usage.value.code == 2 and "--max-bytes 0 removes" in capsys.readouterr().err
    # 1: corruption.
    shard.chmod(0o644)
    shard.write_bytes(shard.read_bytes()[:-1] + b"\x7f")
    assert main([*root, "verify"]) == 1
    assert main([*root, "verify", ident.key, missing]) == 1  # corruption wins over missing
    assert "exit status: 0 ok, 1 corruption found, 2 usage error, 3 missing or unavailable" \
        in build_parser().format_help()


@pytest.mark.parametrize("command", [["list"], ["verify"], ["gc", "--max-bytes", "0"],
                                     ["rm", "0" * 64]])
def test_a_mistyped_root_is_an_error_not_an_empty_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str],
) -> None:
    CacheStore(tmp_path / "cache")  # the real one
    typo = tmp_path / "cahce"
    assert main(["--root", str(typo), *command]) == 3
    assert f"no cache at {typo}" in capsys.readouterr().err
    assert not typo.exists()  # nothing was created


def test_a_closed_stdout_ends_quietly(tmp_path: Path) -> None:
    # As `cachectl list | head -1` once head has exited: every write meets a closed pipe.
    store = CacheStore(tmp_path / "c")
    for seed in range(3):
        store.publish(make_identity(seed), synthetic_tensors(seed)).close()
    read, write = os.pipe()
    os.close(read)
    try:
        out = subprocess.run(cachectl_argv("--root", str(store.root), "list"), stdout=write,
                             stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert out.returncode == 141 and out.stderr == ""


def test_build_and_ensure_take_the_loader_they_are_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # $DITSERVE_CACHECTL_LOADER replaces the engine's loader (out-of-tree loaders, tests).
    monkeypatch.setenv("DITSERVE_CACHECTL_LOADER", "cachectl_support:LIGHT_LOADER")
    assert engine_loader() is LIGHT_LOADER
    model = make_light_model(tmp_path / "model")
    assert main(["build", "--root", str(tmp_path / "c"), "--model", str(model),
                 "--dtype", "float32", "--json"]) == 0
    built = json.loads(capsys.readouterr().out)
    with CacheStore(tmp_path / "c").join(built["key"]) as entry:
        assert entry.manifest.identity["loader"]["name"] == "tests.light_loader"
    monkeypatch.setenv("DITSERVE_CACHECTL_LOADER", "cachectl_support:NO_SUCH_LOADER")
    assert main(["build", "--root", str(tmp_path / "c"), "--model", str(model)]) == 3
    assert "names no loader" in capsys.readouterr().err


def test_ensure_all_components_caches_every_dit_of_a_two_expert_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Wan 2.2 A14B has two DiTs (transformer, transformer_2): an engine pod with a read-only
    cache maps both only if both entries exist, so the init container asks for all."""
    from ditserve.engine.makers.tiny_model import init_tiny

    model = init_tiny(tmp_path / "wan22", family="wan2.2")
    root = tmp_path / "c"
    assert main(["ensure", "--no-daemon", "--root", str(root), "--model", str(model),
                 "--dtype", "float32", "--component", "all", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["status"] for r in lines] == ["ready", "ready"]
    assert len({r["key"] for r in lines}) == 2  # one entry per DiT
    manifests = [json.loads((Path(r["path"]) / "manifest.json").read_text()) for r in lines]
    assert sum("transformer_2" in json.dumps(m) for m in manifests) == 1
    # Without --dtype: the stored dtype (the first DiT's), as for one component.
    assert main(["build", "--root", str(root), "--model", str(model), "--component", "all",
                 "--json"]) == 0
    built = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {r["key"] for r in built} == {r["key"] for r in lines}  # tiny Wan is float32


def test_a_loader_that_cannot_be_found_is_not_called_a_dtype_problem(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DITSERVE_CACHECTL_LOADER", "nope:nothing")
    assert main(["build", "--root", str(tmp_path / "c"), "--model", str(tiny_model)]) == 3
    err = capsys.readouterr().err
    assert "names no loader" in err and "dtype" not in err


def test_daemon_only_ensure_never_writes_the_cache_and_says_why(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ditserve.cachectl.client as daemon_client

    monkeypatch.setattr(daemon_client, "DAEMON_POLL_S", 0.01)
    root = tmp_path / "c"
    rc = main(["ensure", "--daemon-only", "--root", str(root), "--model", str(tiny_model),
               "--dtype", "float32", "--timeout", "0.05"])
    err = capsys.readouterr().err
    assert rc == 3 and "no cachectl daemon answered" in err
    assert "never writes the cache itself" in err
    assert not (root / "v1").exists()  # nothing was built here


def test_serve_on_a_socket_path_too_long_says_so_and_exits_3(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    too_long = tmp_path / ("s" * 120)
    assert main(["--root", str(tmp_path / "cache"), "serve", "--socket", str(too_long),
                 "--scrub-interval", "0"]) == 3
    err = capsys.readouterr().err
    assert "a Unix socket's path may be at most 107 bytes" in err and "--socket" in err


def test_the_daemon_of_a_relative_root_hands_out_absolute_paths(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ditserve.cachectl import daemon

    served: list[daemon.DaemonConfig] = []
    monkeypatch.setattr(daemon, "serve", lambda config, *_a: served.append(config) or 0)
    monkeypatch.chdir(tmp_path)
    assert main(["--root", "cache", "serve"]) == 0
    assert served[0].root == tmp_path / "cache" and served[0].root.is_absolute()
    assert served[0].socket_path.is_absolute()


def test_a_directory_that_is_no_model_is_one_line_and_exit_3(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    not_a_model = tmp_path / "mnt-models"  # e.g. a hostPath naming the models' parent folder
    not_a_model.mkdir()
    root = str(tmp_path / "cache")
    assert main(["--root", root, "ensure", "--model", str(not_a_model), "--dtype", "bfloat16",
                 "--component", "all", "--no-daemon"]) == 3
    assert "is not a usable model directory" in capsys.readouterr().err
    (not_a_model / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    assert main(["--root", root, "build", "--model", str(not_a_model)]) == 3
    err = capsys.readouterr().err
    assert "missing component(s) transformer" in err and "--dtype" not in err
