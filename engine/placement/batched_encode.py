"""One encoder pass per step: the prompts of every request admitted in a step, encoded together,
with those of the requests next in line.

Called by ``engine.placement.whole_pipeline`` around the ModelRunner's per-request
``prepare_encode`` calls. Before them, ``BatchedEncode.step`` collects the prompts those
requests will ask for (the pipeline's ``text_prompts``), looks each up in the prompt cache,
and encodes the misses in one call of the pipeline's ``_encode_prompts`` per text length -
with parked encoders, one visit of the encoders to the device per step instead of one per
request. The results are staged under the prompt cache's own keys, so each request's
``_encode_prompt`` finds them (``prompt_cache.install_prompt_cache``); the stage is emptied
after the step. If the batched pass fails, nothing is staged and every request encodes alone,
so a bad prompt fails only its own request.

Encoding ahead (issue 45): a streamed or parked encoder moves all its weights over PCIe for a
pass, whatever the pass holds (T5-XXL: 9.5 GB, ~0.2 s on an H200, while the DiT's compute
waits). Under load requests are admitted one or two a step as others finish, so each paid a
whole pass. When a step runs a pass anyway, it also encodes the uncached prompts of the
requests next in line (``StepPlan.upcoming``, in admission order) into the prompt cache, up to
``max_prompts`` in the pass (the batch the memory plan counts encode activations for) and half
the cache's entries; admitted later, they hit the cache. A step whose admitted requests all hit
runs no pass, so encoding ahead never adds one. Only prompts of a text length the pass already
encodes join it.

A prompt's embedding does not depend on the other prompts of its pass: each family pads and
masks as it does alone (see each ``_encode_prompts``); tests/families/test_batched_encode.py
compares batched and per-prompt embeddings on the tiny models.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from ditserve.engine.pipelines.capabilities import BatchedPromptEncoder
from ditserve.engine.placement.prompt_cache import PromptCache, prompt_key

log = logging.getLogger(__name__)


class BatchedEncode:
    """Stages one batched encoder pass per step (module docstring)."""

    def __init__(self, pipeline: Any, cache: PromptCache, *, identity: Hashable,
                 staged: dict[Hashable, Any],
                 encoders_on_device: Callable[[], AbstractContextManager[Any]],
                 max_prompts: int | None = None) -> None:
        """max_prompts: the most prompts one pass encodes ahead up to (the admitted requests'
        own misses always run, whatever their count); None: no bound."""
        self.pipeline = pipeline
        self.cache = cache
        self.identity = identity
        self.staged = staged
        self.encoders_on_device = encoders_on_device
        self.max_prompts = max_prompts
        batched = isinstance(pipeline, BatchedPromptEncoder)
        self.enabled = batched
        self._encode_prompts = pipeline._encode_prompts if batched else None
        self.passes = 0  # batched encoder passes run
        self.prompts = 0  # prompts they encoded (those encoded ahead included)
        self.ahead = 0  # prompts encoded ahead, for requests not yet admitted

    @contextmanager
    def step(self, states: Sequence[Any], ahead: Sequence[Any] = ()) -> Iterator[None]:
        """Stage the embeddings ``states`` need for the body (their ``prepare_encode``);
        ``ahead``: the requests next in line (``NewRequest``s: anything with ``params``),
        encoded into the cache if a pass runs."""
        if self.enabled and states:
            try:
                self._stage(states, ahead)
            except Exception:  # encode alone: only a culprit's request fails
                self.staged.clear()
                log.warning("the batched encode of %d requests failed; encoding them one by "
                            "one", len(states), exc_info=True)
        try:
            yield
        finally:
            self.staged.clear()

    def _prompts(self, params: Any) -> Iterator[tuple[int, str, Hashable]]:
        """(text length, prompt, cache key) of each prompt ``params`` asks for."""
        length = int(params.max_sequence_length or self.pipeline.max_sequence_length)
        for prompt in self.pipeline.text_prompts(params):
            yield length, prompt, prompt_key(self.identity, (prompt, length), {})

    def _misses(self, states: Sequence[Any]) -> dict[int, dict[str, Hashable]]:
        """Per text length, the prompts neither staged nor cached, with their keys."""
        misses: dict[int, dict[str, Hashable]] = {}
        for state in states:
            for length, prompt, key in self._prompts(state.params):
                if key in self.staged or prompt in misses.get(length, {}):
                    self.cache.note_hit()  # encoded once in this step, served to both
                    continue
                hit = self.cache.get(key)
                if hit is not None:
                    self.staged[key] = hit
                else:
                    misses.setdefault(length, {})[prompt] = key
        return misses

    def _ahead(self, misses: dict[int, dict[str, Hashable]], ahead: Sequence[Any]) -> int:
        """Add to ``misses`` the uncached prompts of ``ahead`` that fit the pass (module
        docstring); returns how many. Looking them up counts no hit or miss: no request
        asked."""
        room = min(self.cache.max_entries // 2 if self.cache.enabled else 0,
                   self.max_prompts if self.max_prompts is not None else 1 << 30)
        room -= sum(len(wanted) for wanted in misses.values())
        added = 0
        for request in ahead:
            for length, prompt, key in self._prompts(request.params):
                wanted = misses.get(length)
                if room <= 0 or wanted is None or prompt in wanted or key in self.cache:
                    continue
                wanted[prompt] = key
                added += 1
                room -= 1
        return added

    def _stage(self, states: Sequence[Any], ahead: Sequence[Any]) -> None:
        misses = self._misses(states)
        if not misses:
            return  # every admitted prompt hit: no pass, and none just to encode ahead
        early = self._ahead(misses, ahead)
        assert self._encode_prompts is not None
        with self.encoders_on_device():
            for length, wanted in misses.items():
                values = self._encode_prompts(list(wanted), length)
                for key, value in zip(wanted.values(), values, strict=True):
                    self.staged[key] = value
                    self.cache.put(key, value)
                self.passes += 1
                self.prompts += len(wanted)
        self.ahead += early
