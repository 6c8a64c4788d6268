"""One encoder pass per step: the prompts of every request admitted in a step, encoded together.

Called by ``engine.placement.whole_pipeline`` around the ModelRunner's per-request
``prepare_encode`` calls. Before them, ``BatchedEncode.step`` collects the prompts those
requests will ask for (the pipeline's ``text_prompts``), looks each up in the prompt cache,
and encodes the misses in one call of the pipeline's ``_encode_prompts`` per text length -
with parked encoders, one visit of the encoders to the device per step instead of one per
request. The results are staged under the prompt cache's own keys, so each request's
``_encode_prompt`` finds them (``prompt_cache.install_prompt_cache``); the stage is emptied
after the step. If the batched pass fails, nothing is staged and every request encodes alone,
so a bad prompt fails only its own request.

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
                 encoders_on_device: Callable[[], AbstractContextManager[Any]]) -> None:
        self.pipeline = pipeline
        self.cache = cache
        self.identity = identity
        self.staged = staged
        self.encoders_on_device = encoders_on_device
        batched = isinstance(pipeline, BatchedPromptEncoder)
        self.enabled = batched
        self._encode_prompts = pipeline._encode_prompts if batched else None
        self.passes = 0  # batched encoder passes run
        self.prompts = 0  # prompts they encoded

    @contextmanager
    def step(self, states: Sequence[Any]) -> Iterator[None]:
        """Stage the embeddings ``states`` need for the body (their ``prepare_encode``)."""
        if self.enabled and states:
            try:
                self._stage(states)
            except Exception:  # encode alone: only a culprit's request fails
                self.staged.clear()
                log.warning("the batched encode of %d requests failed; encoding them one by "
                            "one", len(states), exc_info=True)
        try:
            yield
        finally:
            self.staged.clear()

    def _misses(self, states: Sequence[Any]) -> dict[int, dict[str, Hashable]]:
        """Per text length, the prompts neither staged nor cached, with their keys."""
        misses: dict[int, dict[str, Hashable]] = {}
        for state in states:
            params = state.params
            length = int(params.max_sequence_length or self.pipeline.max_sequence_length)
            for prompt in self.pipeline.text_prompts(params):
                key = prompt_key(self.identity, (prompt, length), {})
                if key in self.staged or prompt in misses.get(length, {}):
                    self.cache.note_hit()  # encoded once in this step, served to both
                    continue
                hit = self.cache.get(key)
                if hit is not None:
                    self.staged[key] = hit
                else:
                    misses.setdefault(length, {})[prompt] = key
        return misses

    def _stage(self, states: Sequence[Any]) -> None:
        misses = self._misses(states)
        if not misses:
            return
        assert self._encode_prompts is not None
        with self.encoders_on_device():
            for length, wanted in misses.items():
                values = self._encode_prompts(list(wanted), length)
                for key, value in zip(wanted.values(), values, strict=True):
                    self.staged[key] = value
                    self.cache.put(key, value)
                self.passes += 1
                self.prompts += len(wanted)
