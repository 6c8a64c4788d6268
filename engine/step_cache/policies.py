"""Per-request step-cache state and decisions: what a request reuses at a step, and why.

Owned by a request's ``DenoiseState`` (``state.step_cache``), created by the model runner when
the request is admitted and dropped when its last step is done. It holds, per DiT (a Wan 2.2
expert has its own), the residual its blocks added at the last computed step - one row per
model row, so each CFG branch and each image keeps its own - and the policy's memory
(first-block: the first block's residual at the last computed step; teacache: the previous
indicator and the accumulated rescaled change). ``engine.step_cache.blocks`` asks it.

TeaCache's rescaling polynomials are the published ones, per family (see ``teacache_rule``);
a family without published coefficients is refused with the policies that work everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ditserve.engine.config.step_cache import (
    COOLDOWN_STEPS,
    DEFAULT_EVERY,
    DEFAULT_FIRST_BLOCK_THRESHOLD,
    WARMUP_STEPS,
    StepCacheSpec,
)
from ditserve.engine.errors import InvalidRequestError

# TeaCache's fitted polynomials (highest degree first), rescaling the indicator's relative L1
# change into an estimate of the model output's change. Sources:
# - FLUX.1: ali-vilab/TeaCache, TeaCache4FLUX/teacache_flux.py (the same numbers are in
#   vllm-omni's diffusion/cache/teacache/config.py and ComfyUI-TeaCache); indicator: block 0's
#   norm1 output (the modulated input); first and last step computed.
# - Wan2.1 T2V 1.3B / 14B, "retention" mode (use_ret_steps=True): ali-vilab/TeaCache,
#   TeaCache4Wan2.1/teacache_generate.py (SGLang's WanTeaCacheParams defaults to this mode);
#   indicator: the timestep projection the blocks get (e0); the first 5 steps computed.
FLUX_COEFFICIENTS = (4.98651651e02, -2.83781631e02, 5.58554382e01, -3.82021401e00, 2.64230861e-01)
WAN_RET_COEFFICIENTS = {
    1536: (-5.21862437e04, 9.23041404e03, -5.28275948e02, 1.36987616e01, -4.99875664e-02),  # 1.3B
    5120: (-3.03318725e05, 4.90537029e04, -2.65530556e03, 5.87365115e01, -3.15583525e-01),  # 14B
}


@dataclass(frozen=True)
class TeaCacheRule:
    """A family's TeaCache: its polynomial, which input it watches, the steps always computed
    (the first ``warmup``, the last ``cooldown``) and the published default threshold."""

    coefficients: tuple[float, ...]
    indicator: str  # "norm1": the head block's modulated input; "temb": its timestep input
    warmup: int
    cooldown: int
    default_threshold: float

    def rescale(self, x: float) -> float:
        value = 0.0
        for c in self.coefficients:  # Horner
            value = value * x + c
        return value


def teacache_rule(family: str, transformer: Any) -> TeaCacheRule | str:
    """The served model's TeaCache rule, or why there is none (the refusal's text)."""
    if family == "flux":
        # TeaCache4FLUX: 0.25 ~1.5x, 0.4 ~1.8x, 0.6 ~2.0x, 0.8 ~2.25x on FLUX.1-dev.
        return TeaCacheRule(FLUX_COEFFICIENTS, "norm1", 1, 1, 0.4)
    if family == "wan":
        config = getattr(transformer, "config", None)
        if config is None or getattr(config, "expand_timesteps", False):
            return ("teacache has published coefficients for Wan2.1 T2V 1.3B and 14B only, "
                    "not for Wan 2.2's experts or TI2V; use first-block or every")
        width = int(config.num_attention_heads) * int(config.attention_head_dim)
        if width not in WAN_RET_COEFFICIENTS:
            return (f"teacache has published coefficients for Wan2.1 T2V 1.3B (width 1536) and "
                    f"14B (width 5120); this DiT is {width} wide; use first-block or every")
        # TeaCache4Wan2.1's retention-mode examples range 0.05-0.2 by size and speed.
        return TeaCacheRule(WAN_RET_COEFFICIENTS[width], "temb", 5, 0, 0.2)
    return (f"teacache has no published rescaling coefficients for the {family} family; "
            "use first-block or every")


def relative_l1(current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """Per row: mean |current - previous| / mean |previous|, float32, shape (rows,)."""
    cur, prev = current.flatten(1).float(), previous.flatten(1).float()
    return (cur - prev).abs().mean(1) / prev.abs().mean(1).clamp(min=1e-12)


@dataclass
class RequestCache:
    """One request's step cache (see module docstring). Keys are DiT names."""

    policy: str
    threshold: float
    every: int
    rule: TeaCacheRule | None = None
    residual: dict[str, torch.Tensor] = field(default_factory=dict)
    head_residual: dict[str, torch.Tensor] = field(default_factory=dict)
    indicator: dict[str, torch.Tensor] = field(default_factory=dict)
    accumulated: dict[str, float] = field(default_factory=dict)
    skipped_blocks: int = 0
    block_runs: int = 0

    @property
    def nbytes(self) -> int:
        tensors = [*self.residual.values(), *self.head_residual.values(),
                   *self.indicator.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    # -- decisions, each for one step of one DiT ------------------------------------------------
    def every_reuses(self, key: str, step: int, total: int) -> bool:
        if key not in self.residual or step < WARMUP_STEPS or step >= total - COOLDOWN_STEPS:
            return False
        return (step - WARMUP_STEPS) % self.every != 0

    def teacache_reuses(self, key: str, step: int, total: int, change: float | None) -> bool:
        """``change``: the indicator's relative L1 change since the previous step (None: no
        previous). Accumulates the rescaled change; reuse while it stays under threshold."""
        assert self.rule is not None
        if (change is None or key not in self.residual or step < self.rule.warmup
                or step >= total - self.rule.cooldown):
            self.accumulated[key] = 0.0
            return False
        self.accumulated[key] = self.accumulated.get(key, 0.0) + self.rule.rescale(change)
        if self.accumulated[key] < self.threshold:
            return True
        self.accumulated[key] = 0.0
        return False

    def first_block_reuses(self, key: str, change: float | None) -> bool:
        """``change``: the head block's residual's relative L1 change since the last computed
        step (None: nothing to compare with)."""
        return change is not None and key in self.residual and change < self.threshold


def request_cache(spec: StepCacheSpec | None, rule: TeaCacheRule | str | None) -> RequestCache | None:
    """The state for a request with ``spec`` (already resolved against the server default);
    None when it can never reuse (off, threshold 0, every 1) - it then runs as without a cache.
    Raises InvalidRequestError for teacache where the family has no rule."""
    if spec is None or spec.never_reuses:
        return None
    if spec.policy == "teacache":
        if not isinstance(rule, TeaCacheRule):
            raise InvalidRequestError("step_cache", str(rule or "teacache is not available"))
        threshold = rule.default_threshold if spec.threshold is None else float(spec.threshold)
        return RequestCache("teacache", threshold, 1, rule)
    if spec.policy == "first-block":
        threshold = DEFAULT_FIRST_BLOCK_THRESHOLD if spec.threshold is None else spec.threshold
        return RequestCache("first-block", float(threshold), 1)
    return RequestCache("every", 0.0, spec.every or DEFAULT_EVERY)
