"""Multi-process data-parallel engine on CPU (gloo): outputs, uneven loads, dead/hung workers."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, ParallelConfig, SchedulerConfig
from ditserve.engine.errors import EngineStoppedError
from ditserve.engine.loop.engine import DiffusionEngine, EnginePhase, WarmUp
from ditserve.engine.request import SamplingParams

pytestmark = pytest.mark.slow

REQUESTS = [SamplingParams(prompt=f"dp prompt {i}", num_inference_steps=s, seed=40 + i,
                           negative_prompt="neg" if i == 2 else None,
                           true_cfg_scale=2.5 if i == 2 else 1.0)
            for i, s in enumerate([2, 5, 3, 7, 1, 4])]


def dp_engine(model_dir, ranks: int, **kw) -> DiffusionEngine:  # type: ignore[no-untyped-def]
    config = EngineConfig(model=str(model_dir), device="cpu",
                          parallel=ParallelConfig(data_parallel_size=ranks),
                          scheduler=SchedulerConfig(max_num_seqs=2), **kw)
    return DiffusionEngine(config).start()


@pytest.fixture(scope="module")
def alone(tiny_runner):  # type: ignore[no-untyped-def]
    out = {}
    for i, params in enumerate(REQUESTS):
        pixels, _ = drive(tiny_runner, {0: [(f"solo{i}", params)]}, max_num_seqs=1)
        out[i] = pixels[f"solo{i}"]
    return out


@pytest.mark.parametrize("ranks", [2, 3])
def test_dp_generation_equals_single_process(tiny_model_dir, alone, ranks: int) -> None:  # type: ignore[no-untyped-def]
    engine = dp_engine(tiny_model_dir, ranks)
    try:
        handles = [engine.add_request(p) for p in REQUESTS]
        results = [h.result(timeout=120) for h in handles]
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert stats.ranks == ranks
    for i, result in enumerate(results):
        assert (result.pixels - alone[i]).abs().max().item() <= 1e-4, f"request {i}"


def test_every_rank_compiles_its_blocks_and_matches_eager(tiny_model_dir, alone) -> None:  # type: ignore[no-untyped-def]
    # --compile with DP: each worker compiles its own copy of the blocks, and the warm-up
    # steps (batch 1, then 2, on every rank) run before the engine reports ready.
    config = EngineConfig(model=str(tiny_model_dir), device="cpu", compile="aot_eager",
                          parallel=ParallelConfig(data_parallel_size=2),
                          scheduler=SchedulerConfig(max_num_seqs=2))
    engine = DiffusionEngine(config, warmup=WarmUp(compile_size=(64, 64)))
    engine.start()
    try:
        assert engine.ready
        handles = [engine.add_request(p) for p in REQUESTS[:4]]
        results = [h.result(timeout=120) for h in handles]
    finally:
        engine.shutdown()
    for i, result in enumerate(results):
        assert (result.pixels - alone[i]).abs().max().item() <= 1e-4, f"request {i}"


def test_uneven_rank_loads_finish_without_deadlock(tiny_model_dir, alone) -> None:  # type: ignore[no-untyped-def]
    engine = dp_engine(tiny_model_dir, 2)
    try:
        # One long request keeps one rank busy while the other idles, then receives a burst
        # of requests with different step counts arriving one after another.
        long = engine.add_request(SamplingParams(prompt="long", num_inference_steps=30, seed=1))
        late = []
        for params in REQUESTS[:4]:
            late.append(engine.add_request(params))
            time.sleep(0.05)
        for i, handle in enumerate(late):
            assert (handle.result(timeout=120).pixels - alone[i]).abs().max().item() <= 1e-4
        assert long.result(timeout=120).images
    finally:
        engine.shutdown()


def stopped_errors(handles, *, timeout: float) -> list[str]:  # type: ignore[no-untyped-def]
    """The EngineStoppedError messages of the handles that failed with one."""
    errors = []
    for handle in handles:
        try:
            handle.result(timeout=timeout)
        except EngineStoppedError as e:
            errors.append(str(e))
    return errors


def test_killed_worker_is_reported_within_bounded_time(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    engine = dp_engine(tiny_model_dir, 2)
    try:
        pid = engine.executor.worker_pids()[1]
        os.kill(pid, signal.SIGKILL)
        # Two requests: the shared queue gives one to each rank; rank 1's fails, naming it.
        handles = [engine.add_request(SamplingParams(prompt="x", num_inference_steps=3, seed=s))
                   for s in (1, 2)]
        errors = stopped_errors(handles, timeout=60)
        assert any("rank 1" in message for message in errors), errors
        with pytest.raises(EngineStoppedError):
            engine.add_request(SamplingParams(prompt="after", seed=2))
    finally:
        engine.shutdown()


def test_idle_dead_worker_is_noticed_without_a_request(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    engine = dp_engine(tiny_model_dir, 2)
    try:
        os.kill(engine.executor.worker_pids()[1], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while engine.ready and time.monotonic() < deadline:
            time.sleep(0.2)  # the heartbeat runs on the engine's own schedule
        assert not engine.ready
        assert engine.phase is EnginePhase.FAILED and "rank 1" in str(engine.failure)
        with pytest.raises(EngineStoppedError, match="rank 1"):
            engine.add_request(SamplingParams(prompt="after", seed=2))
    finally:
        engine.shutdown()


def test_hung_worker_times_out(tiny_model_dir, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("DITSERVE_WORKER_TIMEOUT_S", "30")  # covers a cold worker start
    engine = dp_engine(tiny_model_dir, 2)
    pid = engine.executor.worker_pids()[1]
    try:
        os.kill(pid, signal.SIGSTOP)  # alive but unresponsive
        handles = [engine.add_request(SamplingParams(prompt="x", num_inference_steps=2, seed=s))
                   for s in (1, 2)]  # one per rank
        errors = stopped_errors(handles, timeout=120)
        assert any(re.search("timeout|connection", m) for m in errors), errors
    finally:
        os.kill(pid, signal.SIGKILL)
        engine.shutdown()


def test_requests_go_to_the_rank_that_frees_up_first(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    # One batch slot per rank; one rank is held by a (practically endless) long request.
    # Binding requests to a rank at arrival would queue a short request behind it (ties go
    # to rank 0); the shared queue hands every short request to the other rank as it frees.
    config = EngineConfig(model=str(tiny_model_dir), device="cpu",
                          parallel=ParallelConfig(data_parallel_size=2),
                          scheduler=SchedulerConfig(max_num_seqs=1))
    engine = DiffusionEngine(config).start()
    started = threading.Event()
    try:
        long = engine.add_request(
            SamplingParams(prompt="long", num_inference_steps=1000, seed=1), request_id="long",
            on_event=lambda e: started.set() if e.kind == "step" else None)
        assert started.wait(60)
        shorts = [engine.add_request(
            SamplingParams(prompt="short", num_inference_steps=2, seed=10 + i),
            request_id=f"short{i}") for i in range(3)]
        ranks = {h.result(timeout=120).rank for h in shorts}
        long.cancel()
        # The first request went to the lowest idle rank, 0; every short one ran on rank 1.
        assert ranks == {1}
    finally:
        engine.shutdown()


def test_report_refreshes_from_another_thread_do_not_disturb_steps(tiny_model_dir, alone) -> None:  # type: ignore[no-untyped-def]
    # /ready handlers ask for offload reports while the loops run steps on the same links;
    # the executor must serialize them.
    import threading

    engine = dp_engine(tiny_model_dir, 2)
    stop = threading.Event()
    refreshes = 0

    def poll() -> None:
        nonlocal refreshes
        while not stop.is_set():
            engine.offload_report(refresh=True)
            engine.offload_report()
            refreshes += 1

    poller = threading.Thread(target=poll)
    try:
        poller.start()
        handles = [engine.add_request(p) for p in REQUESTS]
        for i, handle in enumerate(handles):
            assert (handle.result(timeout=120).pixels - alone[i]).abs().max().item() <= 1e-4
    finally:
        stop.set()
        poller.join(timeout=60)
        engine.shutdown()
    assert refreshes > 0


def test_ranks_a_launcher_started_meet_through_the_environment(  # type: ignore[no-untyped-def]
        tiny_model_dir, alone, monkeypatch, tmp_path) -> None:
    # As in a pod: the launcher starts rank 0 (serve's engine) and `ditserve worker` for rank 1
    # with MASTER_ADDR/MASTER_PORT; rank 0 serves the rendezvous store there and the worker,
    # started first, keeps trying until it is up.
    from ports import free_port  # type: ignore[import-not-found]

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "ditserve.engine.cli", "worker", "--model", str(tiny_model_dir),
             "--device", "cpu", "--data-parallel-size", "2"],
            stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, **env, "RANK": "1", "LOCAL_RANK": "1", "HF_HUB_OFFLINE": "1"})
    for name, value in {**env, "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    try:
        engine = dp_engine(tiny_model_dir, 2)
        try:
            handles = [engine.add_request(p) for p in REQUESTS]
            results = [h.result(timeout=120) for h in handles]
            assert engine.stats().ranks == 2
        finally:
            engine.shutdown()
        assert worker.wait(timeout=60) == 0, log.read_text()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    for i, result in enumerate(results):
        assert (result.pixels - alone[i]).abs().max().item() <= 1e-4, f"request {i}"
