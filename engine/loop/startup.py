"""Start-up of an engine replica: everything between LOADING and READY.

Called once by ``DiffusionEngine.start``: ``ModelLeases`` keeps the node cache from removing a
pulled model the engine serves from; ``open_executor`` resolves the model directory,
builds the executor (loading the weights on every rank) and warms it up. The warm-up runs one
real one-step request through every stage on every rank, so the first request does not pay
for lazy initialization and every rank proves it can run; with ``--compile`` it then compiles
the DiT blocks at the size the engine is told to expect (``WarmUp.compile_size``), calling
``on_compiling`` first so the engine can say so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ditserve.engine.config import (
    EngineConfig,
    ParallelConfig,
    ResolvedOffload,
    RunnerConfig,
    SchedulerConfig,
)
from ditserve.engine.config.types import CompileBackend
from ditserve.engine.errors import DitServeError
from ditserve.engine.executor import Executor, LocalExecutor, RankWork
from ditserve.engine.request import ConditionImage, NewRequest, SamplingParams
from ditserve.engine.runner.start_phases import StartTimeline, timed
from ditserve.engine.sched.scheduler import StepScheduler
from ditserve.engine.sched.work import ResolvedScheduling

if TYPE_CHECKING:
    from ditserve.cachectl.locks import HeldLock
    from ditserve.engine.runner.compile_cache import CompileKey

from ditserve.engine.errors import ModelLoadError
from ditserve.engine.families import FLUX, Family
from ditserve.engine.weights.loader import import_pipeline_class, model_family

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmUp:
    """What the engine runs before it is ready, beyond the one small warm-up step.

    compile_size: with ``config.compile``, (height, width) to compile the DiT blocks at
        before ready, so no request after ready waits for a compile (the HTTP server passes
        its default size, ``generate`` the requested one); None leaves the compiles to the
        first requests.
    """

    compile_size: tuple[int, int] | None = None


def resolve_model(config: EngineConfig) -> Path:
    """The model directory: ``config.model``, or the embedded tiny model (built on first use).

    With a checkpoint file, the file is checked against the directory's DiT here (format, every
    tensor in the file, keys and shapes), before any executor or device memory exists."""
    if config.model is not None:
        if config.checkpoint is not None:
            from ditserve.engine.weights.dit_file import check_checkpoint

            info = check_checkpoint(config.checkpoint, config.model)
            log.info("serving the DiT of %s (%s, %s) with the other components of %s",
                     info.path, info.format.value, "/".join(info.quant_types), config.model)
        return Path(config.model)
    from ditserve.engine.makers.tiny_model import ensure_tiny

    model_dir = ensure_tiny()
    log.warning("no --model given: serving the embedded tiny model (random weights) from %s",
                model_dir)
    return model_dir


class ModelLeases:
    """Shared leases on the node cache's pulled entries the model is served from.

    ``--model`` (and a checkpoint file) may lie in a model ``cachectl pull`` downloaded
    (``<root>/v1/models/<key>/model``, usually through the pod's ``/models/model`` symlink);
    while this engine holds the lease, ``cachectl rm`` and ``gc`` leave that entry alone. A
    model anywhere else takes no lease. Taken before the load, held until ``release`` (the
    engine's shutdown, or a failed start); the kernel drops it if the process dies.
    """

    def __init__(self) -> None:
        self.held: list[HeldLock] = []

    def take(self, config: EngineConfig) -> None:
        from ditserve.cachectl.errors import LockTimeoutError
        from ditserve.cachectl.model_lease import lease_pulled_model

        try:
            for path in (p for p in (config.model, config.checkpoint) if p is not None):
                try:
                    lease = lease_pulled_model(path)
                except (FileNotFoundError, LockTimeoutError) as e:
                    # cachectl rm / gc took the entry between the pod's pull and this start
                    raise ModelLoadError(
                        f"the pulled model {path} was removed from the node cache (or is "
                        f"being removed) as this replica started ({e}); restart the pod so "
                        "its init container pulls it again") from e
                if lease is not None:
                    log.info("serving from the pulled model %s (leased)", lease.path.name)
                    self.held.append(lease)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        for lease in self.held:
            lease.release()
        self.held = []


def make_executor(runner: RunnerConfig, *, parallel: ParallelConfig, model_dir: Path,
                  timeline: StartTimeline | None = None) -> Executor:
    """One in-process runner, or rank 0 of a multi-process replica (``world_size`` > 1).
    ``runner``: every rank's runner options (``RunnerConfig.of``); ``parallel``: the
    replica's DP x SP layout."""
    if parallel.world_size > 1:
        from ditserve.engine.distributed.executor import MultiProcessExecutor

        # The ranks load in their own processes: here it is one phase, all ranks' load.
        with timed(timeline, "load"):
            return MultiProcessExecutor(runner, parallel=parallel, model_dir=model_dir)
    return LocalExecutor(runner, model_dir=model_dir, timeline=timeline)


def open_executor(
    config: EngineConfig, warmup: WarmUp, *, offload: ResolvedOffload,
    on_compiling: Callable[[], object], timeline: StartTimeline | None = None,
) -> tuple[Executor, Path]:
    """Load the model on every rank and warm it up; returns the executor and model directory.
    ``offload``: ``config``'s offload, resolved once by the caller; ``timeline`` records the
    start phases (see ``runner.start_phases``)."""
    model_dir = resolve_model(config)
    # Below here the ranks see only their part of the config.
    executor = make_executor(RunnerConfig.of(config, offload=offload), parallel=config.parallel,
                             model_dir=model_dir, timeline=timeline)
    try:
        shared = None
        if config.compile is not None and config.parallel.world_size == 1:
            shared = _shared_compiles(
                executor, warmup, model_dir, backend=config.compile, dtype=str(config.dtype),
                offload=offload, max_num_seqs=config.scheduler.max_num_seqs,
                sp_size=config.parallel.sequence_parallel_size)
        loaded = shared is not None and shared.load()
        warm_up(executor, warmup, scheduler=config.scheduler, compile=config.compile,
                on_compiling=on_compiling, timeline=timeline)
        if shared is not None and not loaded:
            shared.save()
    except BaseException:
        executor.shutdown()
        raise
    return executor, model_dir


@dataclass(frozen=True)
class _SharedCompiles:
    """The node cache's compiled artifacts for this replica (``runner.compile_cache``)."""

    root: Path
    key: CompileKey

    def load(self) -> bool:
        from ditserve.engine.runner import compile_cache

        return compile_cache.load(self.root, self.key)

    def save(self) -> bool:
        from ditserve.cachectl.layout import default_socket
        from ditserve.engine.runner import compile_cache

        return compile_cache.save(self.root, self.key, socket_path=default_socket(self.root))


def _shared_compiles(executor: Executor, warmup: WarmUp, model_dir: Path, *, backend: str,
                     dtype: str, offload: ResolvedOffload, max_num_seqs: int,
                     sp_size: int) -> _SharedCompiles | None:
    """With --compile (``backend``) on a single-process replica where a node cache exists:
    the key of the warm-up's compiles (loaded before them, saved after them when new)."""
    from ditserve.cachectl.layout import default_root
    from ditserve.engine.runner import compile_cache

    root = Path(offload.cache_root or default_root())
    if not (root / "v1").is_dir():  # no node cache here: nowhere to share compiles
        return None
    runner = executor.runner
    small = int(runner.pixel_multiple) * 2
    shapes = [(small, small, 1)]
    if warmup.compile_size is not None:
        height, width = warmup.compile_size
        shapes.append((height, width, 1))
        if max_num_seqs > 1:
            shapes.append((height, width, 2))
    key = compile_cache.CompileKey(
        model=compile_cache.model_fingerprint(model_dir), shapes=tuple(shapes),
        backend=backend, dtype=dtype, offload=offload.enabled, sp_size=sp_size,
        torch_version=compile_cache.torch_version(),
        device=compile_cache.device_name(runner.device),
        blocks=compile_cache.block_structure(runner.pipeline.transformer))
    return _SharedCompiles(root, key)


def warm_up(
    executor: Executor, warmup: WarmUp, *, scheduler: SchedulerConfig,
    compile: CompileBackend | None, on_compiling: Callable[[], object],
    timeline: StartTimeline | None = None,
) -> None:
    """One small step on every rank; with ``compile``, the compiles at ``warmup``'s size
    for batch one and, when ``scheduler`` batches, two."""
    multiple = int(executor.runner.pixel_multiple)
    with timed(timeline, "warm_up"):
        _warm_step(executor, scheduler, multiple * 2, multiple * 2, requests=1)
    size = warmup.compile_size
    if compile is None or size is None:
        return
    # Compiled blocks recompile when a shape first changes: the token count (resolution),
    # then the batch (a batch of 1 is always its own graph). Two more warm-up steps leave a
    # graph for batch 1 and one for any larger batch, both for any resolution, so no request
    # after ready waits for a compile.
    height, width = size
    log.info("--compile: compiling the DiT blocks for %dx%d before ready (can take minutes)",
             width, height)
    on_compiling()
    with timed(timeline, "compile"):
        _warm_step(executor, scheduler, height, width, requests=1)
        if scheduler.max_num_seqs > 1:
            _warm_step(executor, scheduler, height, width, requests=2)


def _warm_step(executor: Executor, scheduler: SchedulerConfig, height: int, width: int, *,
               requests: int) -> None:
    """One one-step step with ``requests`` requests on every rank, waited for and checked."""
    # A model that needs input images (image-to-video) warms up on plain grey ones.
    grey = ConditionImage(width, height, bytes([128]) * (width * height * 3))
    fewest = int(executor.runner.condition_images[0])
    # A model with a shortest clip (MiniMax-H3: 5 s) warms up on it; an omni-reference
    # model (MiniMax-H3's ref2va replica), which needs a reference, on a grey image one.
    frames = int(executor.runner.limits.min_frames)
    references = (grey,) if executor.runner.limits.references is not None else ()
    params = SamplingParams(prompt="warm up", height=height, width=width,
                            num_inference_steps=1, seed=0, images=(grey,) * fewest,
                            num_frames=frames, references=references)
    work = {}
    for rank in range(executor.num_ranks):
        # Every warm-up request in one step, whatever the work budget: the compile must see
        # the batch of ``requests``, so the budget is exactly their work.
        request_work = executor.runner.work_rule.of(params)
        everyone = replace(scheduler, max_num_seqs=max(requests, 1),
                           max_batch_tokens=max(requests * request_work.tokens, 1))
        rank_scheduler = StepScheduler(ResolvedScheduling.for_family(everyone))
        ids = [f"warmup-{rank}-{i}" for i in range(requests)]
        for rid in ids:
            rank_scheduler.add(rid, params, request_work)
        work[rank] = RankWork(rank_scheduler.schedule(), tuple(NewRequest(rid, params, 0)
                                                          for rid in ids))
    outputs = executor.step(work)
    # An idle step waits for what the first one queued (decoded pixels come back late on a
    # GPU), so the warm-up covers the whole request path, the hand-back included.
    flushed = executor.step({rank: RankWork.idle() for rank in work})
    for rank, rank_work in work.items():
        out, late = outputs[rank], flushed[rank]
        failed = {**out.failed, **late.failed}
        if failed:
            raise DitServeError(f"warm-up step failed on rank {rank}: {failed}")
        asked = {new.request_id for new in rank_work.new}
        missing = asked - {**out.finished, **late.finished}.keys()
        if missing:
            raise DitServeError(f"warm-up step on rank {rank} returned no image for "
                                f"{', '.join(sorted(missing))}")


def import_model_libraries(model_dir: str | None, timeline: StartTimeline) -> None:
    """Import the served model's diffusers pipeline class (diffusers, transformers, its model
    classes) now, on the calling thread, as start phase ``imports``; the engine's start then
    finds them imported. ``ditserve serve`` calls it on the main thread before the server
    runs: on the worker thread that runs the start the same imports cost more CPU time
    (docs/benchmarks.md, "Issue 50"). A directory that is no model imports nothing here:
    loading it says why."""
    family = served_family(model_dir)
    if family is not None:
        with timeline.phase("imports"):
            import_pipeline_class(family)


def served_family(model_dir: str | None) -> Family | None:
    """The family the engine will load (None without a model: the embedded tiny Flux), or
    None when the directory is not a valid model - loading it says why, in more detail."""
    if model_dir is None:
        return FLUX
    try:
        return model_family(model_dir)
    except ModelLoadError:
        return None
