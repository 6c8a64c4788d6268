"""PromptCache: LRU by entries and by bytes, hit/miss counting, and the encoder hook's key."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ditserve.engine.placement.prompt_cache import PromptCache, install_prompt_cache


def tensor(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.float32)  # 4n bytes


def test_lru_evicts_least_recently_used_past_the_entry_bound() -> None:
    cache = PromptCache(max_entries=2, max_bytes=1 << 20)
    cache.put("a", tensor(1))
    cache.put("b", tensor(1))
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", tensor(1))  # evicts b
    assert cache.get("b") is None
    assert cache.get("a") is not None and cache.get("c") is not None
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.entries, stats.bytes) == (3, 1, 2, 8)


def test_byte_bound_evicts_and_refuses_a_value_larger_than_the_bound() -> None:
    cache = PromptCache(max_entries=10, max_bytes=40)
    cache.put("a", (tensor(4), tensor(1)))  # 20 bytes
    cache.put("b", tensor(4))  # 16 bytes: 36 in all
    cache.put("c", tensor(4))  # 52 > 40: a goes
    assert cache.get("a") is None
    assert cache.stats().bytes == 32
    cache.put("huge", tensor(11))  # 44 bytes: never kept, nothing evicted for it
    assert cache.get("huge") is None
    assert cache.stats().entries == 2


def test_zero_size_disables_and_counts_nothing() -> None:
    cache = PromptCache(max_entries=0, max_bytes=1 << 20)
    cache.put("a", tensor(1))
    assert cache.get("a") is None
    assert (cache.stats().hits, cache.stats().misses, cache.stats().entries) == (0, 0, 0)


class Pipeline:
    """A stand-in pipeline: an encoder module and a length limit, like the real ones."""

    def __init__(self) -> None:
        self.text_encoder = torch.nn.Linear(2, 2)
        self.max_sequence_length = 8
        self.device = torch.device("cpu")
        self.calls: list[tuple[Any, ...]] = []

    def _encode_prompt(self, prompt: str, length: int | None = None) -> torch.Tensor:
        self.calls.append((prompt, length))
        return torch.full((1, self.max_sequence_length), float(len(prompt)))


def test_hook_keys_on_arguments_and_length_limits_and_enters_the_placement_on_misses() -> None:
    pipe = Pipeline()
    cache = PromptCache(max_entries=8, max_bytes=1 << 20)
    entered: list[int] = []

    class Placement:
        def __enter__(self) -> None:
            entered.append(1)

        def __exit__(self, *exc: object) -> None:
            return None

    install_prompt_cache(pipe, cache, encoders_on_device=Placement)
    first = pipe._encode_prompt("a fox")
    assert pipe._encode_prompt("a fox") is first  # the very tensor: bit-identical
    pipe._encode_prompt("a fox", length=4)  # another argument: another key
    pipe._encode_prompt("")
    pipe._encode_prompt("")
    assert pipe.calls == [("a fox", None), ("a fox", 4), ("", None)]
    assert len(entered) == 3  # the encoders visit the device only on misses
    assert (cache.stats().hits, cache.stats().misses) == (2, 3)


def test_negative_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        PromptCache(max_entries=-1, max_bytes=1)
