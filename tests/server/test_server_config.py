"""`ditserve serve` configuration: YAML file + flags -> (EngineConfig, ServerConfig)."""

from __future__ import annotations

import pytest

from ditserve.engine.cli.main import build_parser
from ditserve.engine.errors import ConfigError
from ditserve.engine.server.config import ServerConfig
from ditserve.engine.server.main import configs_from_args


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def write(tmp_path, text: str):
    path = tmp_path / "engine.yaml"
    path.write_text(text)
    return str(path)


def test_yaml_supplies_options_and_flags_override(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DITSERVE_API_KEY", "from-env")
    path = write(tmp_path, """
scheduler: {max_num_seqs: 2, max_queue: 5}
dtype: bfloat16
server: {host: 0.0.0.0, port: 8000, request_timeout_s: 30, shutdown_grace_s: 12}
""")
    engine, server = configs_from_args(parse("--config", path, "--max-num-seqs", "3",
                                             "--port", "9001"))
    assert engine.scheduler.max_num_seqs == 3 and engine.scheduler.max_queue == 5
    assert engine.dtype == "bfloat16"
    assert (server.host, server.port) == ("0.0.0.0", 9001)
    assert server.request_timeout_s == 30 and server.shutdown_grace_s == 12
    assert server.api_key == "from-env"


def test_api_key_flag_and_custom_env(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MY_KEY", "k2")
    monkeypatch.delenv("DITSERVE_API_KEY", raising=False)
    path = write(tmp_path, "server: {api_key_env: MY_KEY}\n")
    assert configs_from_args(parse("--config", path))[1].api_key == "k2"
    assert configs_from_args(parse("--api-key", "k1"))[1].api_key == "k1"
    assert configs_from_args(parse())[1].api_key is None


@pytest.mark.parametrize(("text", "message"), [
    ("server: {hots: 1.2.3.4}\n", "unknown option(s) in server: hots"),
    ("schedular: {}\n", "unknown option(s): schedular"),
    ("scheduler: {max_num_seq: 2}\n", "unknown option(s) in scheduler: max_num_seq"),
    # Every typo of a file at once, wherever it is: not one per restart.
    ("schedular: {}\noffload: {slotz: 3}\nserver: {prot: 1}\n",
     "unknown option(s): schedular, offload.slotz, server.prot; known at the top level: "),
    ("scheduler: {policy: fifo}\nserver: {prot: 1}\n", "unknown option(s) in server: prot"),
    ("base_model: /nowhere\n", "--base-model goes with --model FILE"),
    ("server: {api_key: x}\n", "server.api_key must not be written in a config file"),
    ("server: {port: 70000}\n", "server.port must be an integer in [0, 65535], got 70000"),
    ("server: {default_size: big}\n", "server.default_size must look like '1024x1024'"),
    ("server: {default_size: 256x256, max_side: 64}\n",
     "server.default_size 256x256 exceeds server.max_side 64"),
    ("server: [1]\n", "server: expected a mapping, got list"),
    ("server: {allowed_origins: [ftp://x]}\n", "server.allowed_origins must be a list of"),
    ("server: {max_side: 0}\n", "server.max_side must be an integer >= 1, got 0"),
    ("server: {max_body_bytes: 10}\n", "server.max_body_bytes must be an integer >= 1024"),
    ("server: {docs: maybe}\n", "server.docs must be true or false, got 'maybe'"),
])
def test_bad_config_names_the_problem(tmp_path, text, message) -> None:
    with pytest.raises(ConfigError) as info:
        configs_from_args(parse("--config", write(tmp_path, text)))
    assert message in str(info.value)


def test_defaults() -> None:
    config = ServerConfig()
    assert (config.host, config.port, config.api_key) == ("127.0.0.1", 8000, None)
    assert (config.docs, config.allowed_origins, config.max_body_bytes) == (True, (), 1 << 20)


def test_http_limits_cors_and_docs_from_flags_and_yaml(tmp_path) -> None:
    path = write(tmp_path, "server: {allowed_origins: ['https://a.example'], max_side: 2048,\n"
                           "         max_steps: 50, docs: false}\n")
    _, server = configs_from_args(parse("--config", path, "--max-body-bytes", "4096"))
    assert server.allowed_origins == ("https://a.example",)
    assert (server.max_side, server.max_steps, server.docs) == (2048, 50, False)
    assert server.max_body_bytes == 4096
    _, flags = configs_from_args(parse("--allowed-origins", "https://a.example, *",
                                       "--disable-docs", "--max-steps", "8"))
    assert flags.allowed_origins == ("https://a.example", "*")
    assert (flags.docs, flags.max_steps) == (False, 8)


def test_serve_refuses_a_missing_model_dir_before_binding(tmp_path, capsys) -> None:
    from ditserve.engine.cli.main import main

    assert main(["serve", "--model", str(tmp_path / "nope"), "--port", "0"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_the_job_store_from_flag_yaml_and_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("DITSERVE_JOB_STORE", raising=False)
    assert configs_from_args(parse())[1].job_store is None  # SQLite under --video-dir
    path = write(tmp_path, "server: {video_dir: /v, job_store: 'redis://yaml:6379/0', "
                           "job_lease_s: 9}\n")
    _, server = configs_from_args(parse("--config", path))
    assert (server.job_store, server.job_lease_s) == ("redis://yaml:6379/0", 9)
    _, server = configs_from_args(parse("--config", path, "--job-store", "redis://flag:1/2",
                                        "--job-lease", "4"))
    assert (server.job_store, server.job_lease_s) == ("redis://flag:1/2", 4)
    # Kubernetes passes the URL (it may hold a password) from a Secret in the environment.
    monkeypatch.setenv("DITSERVE_JOB_STORE", "redis://:pw@env:6379/0")
    _, server = configs_from_args(parse("--video-dir", "/v"))
    assert server.job_store == "redis://:pw@env:6379/0"
    _, server = configs_from_args(parse("--job-store", f"sqlite:///{tmp_path}/jobs.db",
                                        "--video-dir", "/v"))
    assert server.job_store == f"sqlite:///{tmp_path}/jobs.db"  # the flag wins
    monkeypatch.setenv("DITSERVE_JOB_NAMESPACE", "models/wan")  # the operator's
    assert configs_from_args(parse("--video-dir", "/v"))[1].job_namespace == "models/wan"
    assert configs_from_args(parse("--video-dir", "/v", "--job-namespace", "other")
                             )[1].job_namespace == "other"


def test_results_in_a_bucket_from_flag_yaml_and_environment(tmp_path, monkeypatch) -> None:
    """A Redis job store needs no shared --video-dir when the videos go to a bucket."""
    monkeypatch.delenv("DITSERVE_JOB_STORE", raising=False)
    monkeypatch.delenv("DITSERVE_JOB_RESULTS", raising=False)
    path = write(tmp_path, "server: {job_store: 'redis://h:6379/0', job_results: "
                           "'s3://videos/wan'}\n")
    _, server = configs_from_args(parse("--config", path))
    assert (server.job_results, server.video_dir) == ("s3://videos/wan", None)
    _, server = configs_from_args(parse("--config", path, "--job-results", "s3://other"))
    assert server.job_results == "s3://other"
    monkeypatch.setenv("DITSERVE_JOB_RESULTS", "s3://from-env/p")  # the operator's
    assert configs_from_args(parse())[1].job_results == "s3://from-env/p"


@pytest.mark.parametrize(("argv", "message"), [
    (("--job-store", "postgres://db/jobs"), "server.job_store must be sqlite:///ABSOLUTE/PATH"),
    (("--job-store", "redis://:secret@host:6379/0"), "a Redis job store is shared by replicas"),
    (("--job-store", "mysql://:secret@host/0"), "'mysql://***@host/0'"),
    (("--job-store", "redis://:secret@host:6379/abc", "--video-dir", "/v"),
     "names its database by number"),
    # Its records outlive a restart; the videos of a private temporary directory would not.
    (("--job-store", "sqlite:///var/jobs.db"), "a SQLite file keeps jobs across restarts"),
    # What redis-py (the engines' client) cannot parse: refused here, not a traceback at start.
    (("--job-store", "redis://127.0.0.1:notaport/0", "--video-dir", "/v"),
     "Port could not be cast to integer"),
    (("--job-store", "redis://127.0.0.1:99999/0", "--video-dir", "/v"), "Port out of range"),
    (("--job-store", "redis://h:6379/0?socket_timeout=abc", "--video-dir", "/v"),
     "Invalid value for 'socket_timeout'"),
    (("--job-lease", "0"), "server.job_lease_s must be"),
    (("--job-lease", "0.1"), "server.job_lease_s must be a number >= 1"),
    (("--job-namespace", "a b"), "server.job_namespace must be"),
    (("--job-results", "https://bucket/videos"), "server.job_results must be s3://BUCKET"),
    (("--job-results", "s3://B/x"), "server.job_results must be s3://BUCKET"),
])
def test_bad_job_stores_are_refused(monkeypatch, argv, message) -> None:
    monkeypatch.delenv("DITSERVE_JOB_STORE", raising=False)
    monkeypatch.delenv("DITSERVE_JOB_RESULTS", raising=False)
    with pytest.raises(ConfigError) as info:
        configs_from_args(parse(*argv))
    assert message in str(info.value) and "secret" not in str(info.value)


def test_a_refused_value_from_the_environment_names_its_variable(monkeypatch) -> None:
    # No flag or file set server.job_store: the message says where the value came from.
    monkeypatch.setenv("DITSERVE_JOB_STORE", "mysql://:secret@host/0")
    with pytest.raises(ConfigError) as info:
        configs_from_args(parse())
    text = str(info.value)
    assert "server.job_store must be" in text and "$DITSERVE_JOB_STORE" in text
    assert "secret" not in text
