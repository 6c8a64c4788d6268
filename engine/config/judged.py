"""Which configs passed the rules: so the rules run once per config.

The CLI's ``EngineConfig.from_mapping`` judges a config (``rules.validate``) and hands that very
object to the engine, whose own ``validate`` then returns it as it is; the offload backend
skips the option rules for the ``OffloadConfig`` of a judged config (``judged``), asserting
only what its call needs. Configs are frozen, so a judged one stays valid; they are
remembered by identity while they live (a weak map: nothing is kept alive by it). A config
built anew - a ``replace``, a copy unpickled in a worker process - is judged on its own
(a worker remembers the offload options rank 0 judged: ``remember_judged_offload``).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ditserve.engine.config.types import EngineConfig, OffloadConfig

_judged: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def judged(config: object) -> bool:
    """Whether ``config`` (an ``EngineConfig`` or one of its option groups) was judged."""
    return _judged.get(id(config)) is config


def remember_judged(config: EngineConfig) -> None:
    """``config`` passed every rule (``rules.validate``): it and its offload options (which
    the offload backend asks about)."""
    for judged_object in (config, config.offload):
        _judged[id(judged_object)] = judged_object


def remember_judged_offload(options: OffloadConfig) -> None:
    """Offload options rank 0 judged, as a worker process received them (unpickled: a new
    object, which the offload backend would otherwise judge again)."""
    _judged[id(options)] = options
