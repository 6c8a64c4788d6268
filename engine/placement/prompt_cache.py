"""PromptCache: a bounded LRU of prompt embeddings, and the hook that puts it in front of a
pipeline's prompt encoder.

Built by ``engine.placement.whole_pipeline`` (one cache per ModelRunner). Repeated prompts and
the empty negative prompt that nearly every CFG request carries are encoded once: a hit
returns the very tensors the encoder returned the first time, so outputs with the cache are
bit-identical to outputs without it. The cache is bounded twice: by entries (LRU) and by the
bytes its tensors take on the device.

The key holds everything that changes an embedding: the encoders' identity, the prompt and
every other argument of the encode call, the pipeline's token-length limits
(``*max*length*`` attributes, e.g. ``max_sequence_length``), and the output dtype and device.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

ENCODER_ATTRS: tuple[str, ...] = ("text_encoder", "text_encoder_2", "text_encoder_3")


@dataclass(frozen=True)
class PromptCacheStats:
    """Counters since start (hits, misses) and the current fill."""

    hits: int
    misses: int
    entries: int
    bytes: int
    max_entries: int
    max_bytes: int

    def to_json(self) -> dict[str, int]:
        return dict(self.__dict__)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def nbytes(value: Any) -> int:
    """Bytes of every tensor in ``value`` (a tensor, or tuples/lists/dicts of them)."""
    return sum(t.numel() * t.element_size() for t in _tensors(value))


class PromptCache:
    """LRU of encode results, bounded by ``max_entries`` and ``max_bytes`` (0 entries: off).

    Not thread-safe: the engine thread is its only caller."""

    def __init__(self, *, max_entries: int, max_bytes: int) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError("prompt cache bounds must be >= 0")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    def get(self, key: Hashable) -> Any | None:
        """The cached value (now the most recently used) or None; counts a hit or a miss."""
        if not self.enabled:
            return None
        found = self._entries.get(key)
        if found is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return found[0]

    def __contains__(self, key: Hashable) -> bool:
        """Whether ``key`` is cached; counts nothing and leaves the LRU order as it is."""
        return key in self._entries

    def note_hit(self) -> None:
        """Count a hit served outside ``get`` (a prompt repeated within one batched encode)."""
        if self.enabled:
            self.hits += 1

    def put(self, key: Hashable, value: Any) -> None:
        """Keep ``value``, evicting the least recently used entries past either bound; a value
        larger than the whole byte bound is not kept."""
        size = nbytes(value)
        if not self.enabled or size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old[1]
        self._entries[key] = (value, size)
        self._bytes += size
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self._bytes -= evicted

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def stats(self) -> PromptCacheStats:
        return PromptCacheStats(hits=self.hits, misses=self.misses, entries=len(self._entries),
                                bytes=self._bytes, max_entries=self.max_entries,
                                max_bytes=self.max_bytes)


def encoder_identity(pipeline: Any) -> tuple[Hashable, ...]:
    """Which encoders (by object and class) and which length limits produce the embeddings."""
    encoders = tuple((name, type(module).__name__, id(module))
                     for name in ENCODER_ATTRS
                     if (module := getattr(pipeline, name, None)) is not None)
    limits = tuple(sorted((name, value) for name, value in vars(pipeline).items()
                          if "max" in name and "length" in name and isinstance(value, int)))
    return (type(pipeline).__name__, encoders, limits,
            str(getattr(pipeline, "dtype", None)), str(getattr(pipeline, "device", None)))


def _hashable(value: Any) -> Hashable:
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, torch.Tensor):
        raise TypeError("tensor arguments are not cacheable")
    return value if isinstance(value, Hashable) else repr(value)


def prompt_key(identity: Hashable, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    """The cache key of one ``_encode_prompt(*args, **kwargs)`` call; TypeError when an
    argument cannot be keyed on (a tensor)."""
    return (identity, _hashable(args), _hashable(kwargs))


def install_prompt_cache(
    pipeline: Any,
    cache: PromptCache,
    *,
    encoders_on_device: Callable[[], AbstractContextManager[Any]] = nullcontext,
    staged: dict[Hashable, Any] | None = None,
) -> Hashable:
    """Put ``cache`` in front of ``pipeline._encode_prompt`` (every family's per-prompt
    encoder); returns the encoders' identity that every key starts with.
    ``encoders_on_device``: a context that places the text encoders on the device for one
    encode (parking); entered only on a miss, so a hit moves no weights. ``staged``: results
    of this step's batched encoder pass (``batched_encode``), served before the cache and
    counted there already.

    Encoder outputs are never written in place by the pipelines (they are repeated, cat'ed or
    copied into padded rows), so one tensor may serve every request that asks for it."""
    original = pipeline._encode_prompt
    identity = encoder_identity(pipeline)
    staged = {} if staged is None else staged

    @functools.wraps(original)
    def encode(*args: Any, **kwargs: Any) -> Any:
        try:
            key: Hashable | None = prompt_key(identity, args, kwargs)
        except TypeError:
            key = None  # an argument we cannot key on: encode, do not cache
        if key is not None:
            hit = staged.get(key)
            if hit is None:
                hit = cache.get(key)
            if hit is not None:
                return hit
        with encoders_on_device():
            value = original(*args, **kwargs)
        if key is not None:
            cache.put(key, value)
        return value

    pipeline._encode_prompt = encode
    return identity
