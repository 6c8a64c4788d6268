"""What a request (or the server default) asks of the step cache: a policy and its knob.

Pure Python: ``SamplingParams`` carries a ``StepCacheSpec``, the engine config holds the
server default, and both the HTTP layer and the CLI build one with ``parse_step_cache``.

Policies (docs/step_cache.md):
- ``first-block``: the first block always runs; when its output changed less than
  ``threshold`` (relative L1, as diffusers' FirstBlockCache) since the last computed step, the
  other blocks are skipped and their cached residual is added instead.
- ``teacache``: the first block's modulated input (Flux) or timestep projection (Wan) is
  compared with the family's published rescaling polynomial; the rescaled change accumulates
  and every block is skipped while the sum stays under ``threshold``.
- ``every``: a fixed schedule - ``WARMUP_STEPS`` first and ``COOLDOWN_STEPS`` last steps
  computed, and in between one step in ``every``; the others reuse.
- ``none``: off (a request can turn off a server default).

Threshold 0 and ``every`` 1 never reuse: the output is bit-identical to no cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ditserve.engine.errors import InvalidRequestError

POLICIES = ("first-block", "teacache", "every")
OFF = "none"
# diffusers' FirstBlockCacheConfig defaults to 0.05; ParaAttention's FLUX examples use 0.08
# (about 1.5x-2x on FLUX.1-dev at 28 steps with little visible change).
DEFAULT_FIRST_BLOCK_THRESHOLD = 0.08
DEFAULT_EVERY = 2
WARMUP_STEPS = 2  # the layout forms in the first steps, the details in the last
COOLDOWN_STEPS = 2
MAX_EVERY = 100
MAX_THRESHOLD = 10.0


@dataclass(frozen=True)
class StepCacheSpec:
    """policy: one of ``POLICIES`` or ``OFF``. threshold: first-block's and teacache's knob
    (None: the policy's default; teacache's is per family). every: the ``every`` policy's K."""

    policy: str
    threshold: float | None = None
    every: int | None = None

    def validate(self, field: str = "step_cache") -> StepCacheSpec:
        if self.policy not in (*POLICIES, OFF):
            raise InvalidRequestError(field, f"policy must be one of {', '.join(POLICIES)} or "
                                             f"{OFF!r}, got {self.policy!r}")
        t = self.threshold
        if t is not None:
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= MAX_THRESHOLD:
                raise InvalidRequestError(field, f"threshold must be a number in "
                                                 f"[0, {MAX_THRESHOLD:g}], got {t!r}")
            if self.policy not in ("first-block", "teacache"):
                raise InvalidRequestError(field, f"threshold applies to first-block and "
                                                 f"teacache, not to {self.policy!r}")
        k = self.every
        if k is not None:
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_EVERY:
                raise InvalidRequestError(field, f"every must be an integer in [1, {MAX_EVERY}], "
                                                 f"got {k!r}")
            if self.policy != "every":
                raise InvalidRequestError(field, f"every applies to the 'every' policy, not to "
                                                 f"{self.policy!r}")
        return self

    @property
    def never_reuses(self) -> bool:
        """True when this spec can never skip a block (off, threshold 0, every 1): such a
        request runs exactly as without a cache and keeps no residual."""
        return (self.policy == OFF or self.threshold == 0
                or (self.policy == "every" and self.every == 1))


def parse_step_cache(value: Any, field: str = "step_cache") -> StepCacheSpec | None:
    """A spec from plain data: None, a policy name (``"every"``, ``"every=3"``), or a mapping
    ``{"policy": ..., "threshold": ..., "every": ...}``; raises InvalidRequestError."""
    if value is None:
        return None
    if isinstance(value, StepCacheSpec):
        return value.validate(field)
    if isinstance(value, str):
        policy, _, k = value.partition("=")
        if k:
            if policy != "every" or not k.isdigit():
                raise InvalidRequestError(field, f"only 'every=K' takes a value, got {value!r}")
            return StepCacheSpec("every", every=int(k)).validate(field)
        return StepCacheSpec(policy).validate(field)
    if not isinstance(value, dict):
        raise InvalidRequestError(field, "must be an object like {\"policy\": \"first-block\", "
                                         f"\"threshold\": 0.08}}, got {type(value).__name__}")
    unknown = set(value) - {"policy", "threshold", "every"}
    if unknown:
        raise InvalidRequestError(field, f"unknown key(s) {', '.join(sorted(unknown))}; "
                                         "known: policy, threshold, every")
    if not isinstance(value.get("policy"), str):
        raise InvalidRequestError(field, "policy is required: one of "
                                         f"{', '.join(POLICIES)} or {OFF!r}")
    every = value.get("every")
    if isinstance(every, float) and every.is_integer():  # JSON's 3.0 is the integer 3
        every = int(every)
    return StepCacheSpec(value["policy"], value.get("threshold"), every).validate(field)
