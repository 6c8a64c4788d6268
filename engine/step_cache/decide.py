"""The step cache's decisions at a DiT's head block, for every request of one forward.

``every`` and ``teacache`` decide before the head runs (their reusing rows skip it);
``first-block`` after it, from the head's own change. The changes of all requests are read
back in one host sync per forward (``tolist``), never one per request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ditserve.engine.step_cache.policies import relative_l1
from ditserve.engine.step_cache.rows import Member


def _changes(pairs: Sequence[tuple[Member, torch.Tensor, torch.Tensor | None]]) -> list[float | None]:
    """Per (member, current, previous): the largest per-row relative L1 change (None without
    a previous tensor of the same shape); one host sync for all."""
    compared = [relative_l1(cur, prev).max() for _, cur, prev in pairs
                if prev is not None and prev.shape == cur.shape]
    values = iter(torch.stack(compared).tolist() if compared else [])
    return [next(values) if prev is not None and prev.shape == cur.shape else None
            for _, cur, prev in pairs]


def before_head(dit: str, found: Sequence[Member],
                indicator: Callable[[str], torch.Tensor]) -> None:
    """``every`` and ``teacache`` decisions; ``indicator(kind)``: TeaCache's watched input for
    every row of the forward (computed only if a request uses teacache)."""
    tea = []
    for m in found:
        c = m.cache
        if c is None:
            continue
        if c.policy == "every":
            m.reuse = m.skips_head = c.every_reuses(
                dit, m.state.step_index, m.state.params.num_inference_steps)
        elif c.policy == "teacache":
            tea.append(m)
    if not tea:
        return
    rule = tea[0].cache.rule if tea[0].cache is not None else None
    assert rule is not None
    watched = indicator(rule.indicator)
    pairs = []
    for m in tea:
        assert m.cache is not None
        current = watched[m.rows]
        pairs.append((m, current, m.cache.indicator.get(dit)))
        m.cache.indicator[dit] = current.clone()  # TeaCache keeps the latest, reused or not
    for (m, _, _), change in zip(pairs, _changes(pairs), strict=True):
        assert m.cache is not None
        m.reuse = m.skips_head = m.cache.teacache_reuses(
            dit, m.state.step_index, m.state.params.num_inference_steps, change)


def after_head(dit: str, found: Sequence[Member], hidden_in: torch.Tensor,
               hidden_out: torch.Tensor) -> None:
    """``first-block`` decisions on the head's residual; it is kept only from computed steps
    (as diffusers' FirstBlockCache), so the change is measured since the last computed step."""
    pairs = []
    for m in found:
        if m.cache is not None and m.cache.policy == "first-block":
            residual = hidden_out[m.rows] - hidden_in[m.rows]
            pairs.append((m, residual, m.cache.head_residual.get(dit)))
    for (m, residual, _), change in zip(pairs, _changes(pairs), strict=True):
        assert m.cache is not None
        m.reuse = m.cache.first_block_reuses(dit, change)
        if not m.reuse:
            m.cache.head_residual[dit] = residual
