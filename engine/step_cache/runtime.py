"""StepCache: the model runner's one handle on step caching.

Built by the runner after the DiT is loaded, offloaded and compiled (the block wrappers sit
beneath every hook). It resolves each admitted request's spec against the server default
into the request's own ``RequestCache`` (``attach``), refuses what the served model cannot
do (``check``: teacache without published coefficients, any cache under sequence
parallelism or where the pipeline says why it cannot serve one, ``step_cache_refusal``), scopes each step and each shape-group forward, tells offload which blocks a
step needs, and reports what a step skipped into its ``RunnerOutput``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ditserve.engine.config.step_cache import OFF, POLICIES, StepCacheSpec
from ditserve.engine.errors import ConfigError, InvalidRequestError
from ditserve.engine.families import family_of_dit
from ditserve.engine.step.denoise_state import DenoiseState
from ditserve.engine.step_cache.blocks import StepCacheBlocks
from ditserve.engine.step_cache.policies import (
    RequestCache,
    TeaCacheRule,
    request_cache,
    teacache_rule,
)

if TYPE_CHECKING:
    from ditserve.engine.step.input_batch import InputBatch
    from ditserve.engine.step.plan import RunnerOutput



@runtime_checkable
class RefusesStepCache(Protocol):
    """A pipeline whose DiT's blocks take no rows (Cosmos3's packed sequences) says why the
    step cache cannot serve it (None: it can). An optional pipeline capability, declared here
    below the pipelines (``pipelines.capabilities`` lists the others)."""

    step_cache_refusal: str | None


@runtime_checkable
class CachedBlockLists(Protocol):
    """The block lists whose residual the step cache caches, when not all of them (Z-Image:
    its main layers; the refiners before them run every step on their own streams)."""

    step_cache_block_lists: tuple[str, ...]


SEQUENCE_PARALLEL_REFUSAL = ("the step cache is not available with sequence parallelism (each "
                             "rank would decide on its own share of the tokens)")


class StepCache:
    """See the module docstring. ``offload``: the DLO handle (None: resident weights)."""

    def __init__(self, pipeline: Any, *, default: StepCacheSpec | None, offload: Any = None,
                 sequence_parallel: bool = False) -> None:
        self.default = default
        self._refusal: str | None = SEQUENCE_PARALLEL_REFUSAL if sequence_parallel else (
            pipeline.step_cache_refusal if isinstance(pipeline, RefusesStepCache) else None)
        self._rule = teacache_rule(pipeline.family.name, pipeline.transformer)
        self._offload = offload
        self._live: dict[str, RequestCache] = {}  # request id -> its cache, while it runs
        self.blocks: StepCacheBlocks | None = None
        if default is not None:
            try:
                self.check(default)
            except InvalidRequestError as e:
                raise ConfigError(f"--step-cache {default.policy}: {e.message}") from e
        if self._refusal is not None:
            return
        # Blocks return what their DiT's blocks return: a derived family (an edit or
        # image-to-video layout) runs its base family's DiT (FLUX.1 Kontext: Flux's blocks).
        dit_family = family_of_dit(pipeline.family.dit_class) or pipeline.family
        # The lists whose residual is cached: all of them, or the pipeline's choice.
        cached = (pipeline.step_cache_block_lists if isinstance(pipeline, CachedBlockLists)
                  else pipeline.block_lists)
        self.blocks = StepCacheBlocks(pipeline.transformer, cached, dit_family.name)
        if offload is not None:
            offload.skip_unneeded(self.blocks.needs)

    def close(self) -> None:
        if self._offload is not None and getattr(self._offload, "active", True):
            self._offload.skip_unneeded(None)
        if self.blocks is not None:
            self.blocks.close()

    def resolve(self, spec: StepCacheSpec | None) -> StepCacheSpec | None:
        return self.default if spec is None else spec

    def check(self, spec: StepCacheSpec | None) -> None:
        """InvalidRequestError if this model cannot serve ``spec`` (None: the default)."""
        spec = self.resolve(spec)
        if spec is None or spec.policy == OFF:
            return
        if spec.policy not in self.policies:  # even at threshold 0: the policy is not here
            reason = self._refusal or str(self._rule)
            raise InvalidRequestError("step_cache", reason)

    @property
    def policies(self) -> tuple[str, ...]:
        """The policies this model serves (the API schema lists only these)."""
        if self._refusal is not None:
            return ()
        return tuple(p for p in POLICIES if p != "teacache" or isinstance(self._rule, TeaCacheRule))

    def attach(self, state: DenoiseState) -> None:
        """Give an admitted request its own cache (None when it can never reuse)."""
        spec = self.resolve(state.params.step_cache)
        state.step_cache = None if self.blocks is None else request_cache(spec, self._rule)
        if state.step_cache is not None:
            self._live[state.request_id] = state.step_cache

    def stepped(self, state: DenoiseState) -> None:
        """After a request's step: its residuals go once its last step is done."""
        if state.step_index >= state.params.num_inference_steps:
            state.step_cache = None
            self.forget(state.request_id)

    def forget(self, request_id: str) -> None:
        """A request left (finished, failed, aborted): drop its cache."""
        self._live.pop(request_id, None)

    def scope(self, inputs: InputBatch) -> contextlib.AbstractContextManager[None]:
        """Around one shape group's forward (in its own lane under block-major offload)."""
        if self.blocks is None:
            return contextlib.nullcontext()
        return self.blocks.forward(inputs.states, inputs.row_slices)

    @contextlib.contextmanager
    def step(self, out: RunnerOutput) -> Iterator[None]:
        """One step's forwards; adds what they skipped to ``out``."""
        if self.blocks is None:
            yield
            return
        before = self._offload.skipped_bytes if self._offload is not None else 0
        with self.blocks.step() as run:
            yield
        out.step_cache_skipped_blocks += run.skipped_blocks
        out.step_cache_block_runs += run.block_runs
        if self._offload is not None:
            out.step_cache_skipped_bytes += self._offload.skipped_bytes - before

    def resident_bytes(self) -> int:
        """Device bytes the running requests' caches hold (residuals, policy memory); 0 once
        they ended."""
        return sum(cache.nbytes for cache in self._live.values())
