"""DiffusionEngine: the threaded loop, request API, errors, abort, events, async use."""

from __future__ import annotations

import asyncio
import threading

import pytest
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, SchedulerConfig
from ditserve.engine.errors import DitServeError, InvalidRequestError, RequestAborted
from ditserve.engine.loop.engine import DiffusionEngine, RequestEvent
from ditserve.engine.request import SamplingParams


@pytest.fixture
def engine(tiny_model_dir):  # type: ignore[no-untyped-def]
    config = EngineConfig(model=str(tiny_model_dir), device="cpu",
                          scheduler=SchedulerConfig(max_num_seqs=4))
    eng = DiffusionEngine(config).start()
    yield eng
    eng.shutdown()


def test_concurrent_requests_equal_alone(engine, tiny_runner) -> None:  # type: ignore[no-untyped-def]
    requests = [SamplingParams(prompt=f"prompt {i}", num_inference_steps=2 + i, seed=100 + i)
                for i in range(6)]
    gate = threading.Event()
    handles = [engine.add_request(p) for p in requests]
    gate.set()
    results = [h.result(timeout=120) for h in handles]
    assert engine.stats().mean_batch_rows > 1
    for params, result in zip(requests, results, strict=True):
        alone, _ = drive(tiny_runner, {0: [("x", params)]}, max_num_seqs=1)
        assert (result.pixels - alone["x"]).abs().max().item() <= 1e-4
        assert result.seed == params.seed and len(result.images) == 1


BAD = [
    (dict(prompt=""), "prompt"),
    (dict(prompt="x", height=30), "height"),
    (dict(prompt="x", width=0), "width"),
    (dict(prompt="x", num_inference_steps=0), "num_inference_steps"),
    (dict(prompt="x", num_images=99), "n"),
    (dict(prompt="x", guidance_scale=-1.0), "guidance_scale"),
    (dict(prompt="x", max_sequence_length=0), "max_sequence_length"),
    (dict(prompt="x", seed=-5), "seed"),
    (dict(prompt="x" * 5000), "prompt"),
]


@pytest.mark.parametrize(("fields", "field"), BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_input_names_the_field_and_engine_keeps_serving(engine, fields, field) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(SamplingParams(**fields))
    assert info.value.field == field
    assert info.value.message
    ok = engine.add_request(SamplingParams(prompt="still fine", num_inference_steps=1, seed=1))
    assert ok.result(timeout=60).images


def test_size_error_suggests_valid_sizes(engine) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRequestError, match="multiple of 4.*try 28 or 32"):
        engine.add_request(SamplingParams(prompt="x", height=30))


def test_failure_in_one_request_is_isolated(engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    pipeline = engine.runner.pipeline
    original = pipeline.prepare_encode

    def flaky(state):  # type: ignore[no-untyped-def]
        if state.params.prompt == "explode":
            raise RuntimeError("boom")
        return original(state)

    monkeypatch.setattr(pipeline, "prepare_encode", flaky)
    good = engine.add_request(SamplingParams(prompt="fine", num_inference_steps=3, seed=2))
    bad = engine.add_request(SamplingParams(prompt="explode", num_inference_steps=3, seed=3))
    with pytest.raises(DitServeError, match="boom"):
        bad.result(timeout=60)
    assert good.result(timeout=60).images


def test_abort_running_request_frees_its_slot(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    config = EngineConfig(model=str(tiny_model_dir), device="cpu",
                          scheduler=SchedulerConfig(max_num_seqs=1))
    engine = DiffusionEngine(config).start()
    try:
        started = threading.Event()

        def on_event(event: RequestEvent) -> None:
            if event.kind == "step":
                started.set()

        long = engine.add_request(SamplingParams(prompt="long", num_inference_steps=500, seed=1),
                                  on_event=on_event)
        queued = engine.add_request(SamplingParams(prompt="next", num_inference_steps=1, seed=2))
        assert started.wait(60)
        assert long.cancel()
        with pytest.raises(RequestAborted):
            long.result(timeout=60)
        assert queued.result(timeout=60).images  # admitted once the slot was freed
    finally:
        engine.shutdown()


def test_events_arrive_in_order(engine) -> None:  # type: ignore[no-untyped-def]
    events: list[RequestEvent] = []
    handle = engine.add_request(SamplingParams(prompt="x", num_inference_steps=3, seed=1),
                                on_event=events.append)
    handle.result(timeout=60)
    kinds = [e.kind for e in events]
    assert kinds[0] == "queued" and kinds[-1] == "finished"
    assert [e.step for e in events if e.kind == "step"] == [1, 2, 3]


def test_async_generate(engine) -> None:  # type: ignore[no-untyped-def]
    async def main() -> list[int]:
        results = await asyncio.gather(*[
            engine.generate(SamplingParams(prompt="a", num_inference_steps=2, seed=s))
            for s in (1, 2, 3)
        ])
        return [r.seed for r in results]

    assert asyncio.run(main()) == [1, 2, 3]


def test_shutdown_refuses_new_requests(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.errors import EngineStoppedError

    engine = DiffusionEngine(EngineConfig(model=str(tiny_model_dir), device="cpu")).start()
    engine.shutdown()
    with pytest.raises(EngineStoppedError):
        engine.add_request(SamplingParams(prompt="late"))


def test_queue_position_events_only_when_the_position_changes(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    config = EngineConfig(model=str(tiny_model_dir), device="cpu",
                          scheduler=SchedulerConfig(max_num_seqs=1))
    engine = DiffusionEngine(config).start()
    try:
        events: list[RequestEvent] = []
        handles = [engine.add_request(SamplingParams(prompt="x", num_inference_steps=3, seed=s))
                   for s in (1, 2)]
        third = engine.add_request(SamplingParams(prompt="x", num_inference_steps=1, seed=3),
                                   on_event=events.append)
        for handle in (*handles, third):
            handle.result(timeout=60)
    finally:
        engine.shutdown()
    positions = [e.queue_position for e in events if e.kind == "queued"]
    # Told once per move (2 ahead, then 1, then 0), never repeated while it waits.
    assert positions == sorted(set(positions), reverse=True) and positions[-1] == 0
    assert positions[0] in (1, 2)


def test_a_step_in_flight_is_reported_after_its_request_is_aborted(tiny_model_dir, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Issue 45: a step is never cut short; a request aborted during it no longer counts as
    running, so the stats (and /ready) report the step itself until it ends."""
    engine = DiffusionEngine(EngineConfig(model=str(tiny_model_dir), device="cpu")).start()
    try:
        runner = engine.runner
        execute = runner.execute
        entered, release = threading.Event(), threading.Event()

        def held(plan, new, **kwargs):  # type: ignore[no-untyped-def]
            if plan.denoise and not release.is_set():
                entered.set()
                assert release.wait(60)
            return execute(plan, new, **kwargs)

        monkeypatch.setattr(runner, "execute", held)
        assert engine.stats().step_in_flight_s is None
        long = engine.add_request(SamplingParams(prompt="long", num_inference_steps=50, seed=1))
        assert entered.wait(60)
        assert long.cancel()
        during = engine.stats()
        assert during.running == 0  # aborted: not running any more ...
        assert during.step_in_flight_s is not None and during.step_in_flight_s >= 0
        assert during.requests_in_flight == 1  # ... but its step still computes it
        release.set()
        engine.add_request(SamplingParams(prompt="next", num_inference_steps=1)).result(60)
        after = engine.stats()
        assert (after.step_in_flight_s, after.requests_in_flight) == (None, 0)
    finally:
        engine.shutdown()


def test_a_request_over_the_step_budget_is_refused_up_front(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """Issue 45: a request of any size ran alone, in steps nothing could cut short; by
    default one request may bring at most four step budgets (--max-request-tokens)."""
    config = EngineConfig(model=str(tiny_model_dir), device="cpu",
                          scheduler=SchedulerConfig(max_batch_tokens=256))
    engine = DiffusionEngine(config).start()
    try:
        assert engine.max_request_tokens == 4 * 256
        fits = engine.runner.work_rule.of(SamplingParams(prompt="x", height=128, width=128))
        assert 256 < fits.tokens <= 1024  # larger than a step's budget: runs alone
        engine.validate_params(SamplingParams(prompt="x", height=128, width=128))
        with pytest.raises(InvalidRequestError, match="--max-request-tokens") as refused:
            engine.validate_params(SamplingParams(prompt="x", height=512, width=512))
        assert refused.value.field == "size"
    finally:
        engine.shutdown()
    raised = DiffusionEngine(EngineConfig(model=str(tiny_model_dir), device="cpu",
                                          scheduler=SchedulerConfig(max_batch_tokens=1024,
                                                                    max_request_tokens=10**6)))
    assert raised.max_request_tokens == 10**6


def test_shutdown_lets_the_model_go_while_handles_live(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """A handle keeps the engine (its cancel() calls the engine's abort); shutting down must
    still let the model's modules be collected, or an engine started next in the same
    process finds the old one's resident weights under its HBM budget."""
    import gc
    import weakref

    engine = DiffusionEngine(EngineConfig(model=str(tiny_model_dir), device="cpu")).start()
    handle = engine.add_request(SamplingParams(prompt="x", num_inference_steps=1, seed=1))
    handle.result(timeout=60)
    runner = weakref.ref(engine.runner)
    engine.shutdown()
    gc.collect()
    assert runner() is None
    assert engine.runner is None and engine.pipeline_report() is None
    assert not handle.cancel()  # finished: nothing to abort, and no error after shutdown
