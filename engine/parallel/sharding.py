"""Attach sequence parallelism to a loaded DiT: its forward then runs on this rank's tokens.

The mechanics shared by every family; what is family-specific - a few torch hooks around
modules the forward already calls, and the family's Ulysses processor on every attention -
is the family's own (``Family.sp_hooks``, e.g. ``engine.families.flux.sp.attach``), looked
up by the DiT's class through the family registry. diffusers' code is not modified:

- the family's root pre-hook reads the full inputs, decides this forward's shards
  (``SequenceForward``) and replaces the token inputs by this rank's slice (or, where the
  token sequence only exists inside the forward, the first block's pre-hook slices it);
- RoPE tables are computed for the whole sequence and sliced to the shard by the family's
  hooks (or computed from sliced position ids);
- here, a hook on ``proj_out`` (the last token-wise layer) gathers every rank's output
  tokens, so the DiT returns the full output - the same on every rank - and everything
  after it (unpatchify, the sampler step) runs unchanged. A DiT without one (Z-Image, whose
  forward builds a sequence per block list) is gathered by its family's hooks instead.

Every rank runs the same forward on the same inputs (the SP ranks of a DP rank get the same
plan), so each keeps the full latents and the whole sampler state; only the DiT's tokens
are split. This is what diffusers' own ``_cp_plan`` hooks do, plus padding: any token count
runs, the padded tokens masked as keys (``tokens``).

Called once by the model runner (``shard_pipeline``) after loading, before offload and
compilation attach theirs; the hooks stay for the process's lifetime.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ditserve.engine.errors import ConfigError
from ditserve.engine.families import FAMILIES, family_of_dit, resolve
from ditserve.engine.parallel.processors import SequenceForward
from ditserve.engine.parallel.ulysses import SequenceGroup, check_heads, gather_tokens

# (a diffusers DiT, its forward's state) -> True when the family's hooks gather the DiT's
# output tokens themselves (Cosmos3, whose proj_out reads positions of the whole sequence);
# otherwise (None) the output of proj_out is gathered here.
Hooks = Callable[[Any, SequenceForward], bool | None]


def token_input(kwargs: dict[str, Any], name: str) -> torch.Tensor:
    """A token tensor the DiT was called with (``name=`` keyword), for a family's hooks."""
    value = kwargs.get(name)
    if not isinstance(value, torch.Tensor):
        raise ConfigError(f"a sequence-parallel DiT must be called with {name}= as a keyword "
                          "tensor argument (the pipelines do)")
    return value


def family_hooks(dit_class: str) -> Hooks:
    """The hooks that shard a DiT of this class (its family's ``sp_hooks``)."""
    family = family_of_dit(dit_class)
    if family is None or family.sp_hooks is None:
        supported = ", ".join(dict.fromkeys(f.dit_class for f in FAMILIES if f.sp_hooks))
        raise ConfigError(f"sequence parallelism has no plan for {dit_class}; supported: "
                          f"{supported}")
    hooks: Hooks = resolve(family.sp_hooks)
    return hooks


# How diffusers' attention modules spell their head counts: ``Attention`` its ``heads``,
# a grouped-query attention (Cosmos3's) its query and key-value heads.
HEAD_COUNTS = ("heads", "num_attention_heads", "num_key_value_heads")


def attention_heads(model: nn.Module) -> tuple[int, ...]:
    """The head counts of a DiT's attentions (every module with an attention processor and
    an integer head count, ``HEAD_COUNTS``), which Ulysses splits over the ranks."""
    counts: set[int] = set()
    for module in model.modules():
        if hasattr(module, "processor"):
            counts.update(heads for name in HEAD_COUNTS
                          if isinstance(heads := getattr(module, name, None), int))
    if not counts:
        raise ConfigError(f"{type(model).__name__} has no attention with a head count to split")
    return tuple(sorted(counts))


def shard_dit(dit: nn.Module, sp: SequenceGroup) -> SequenceForward:
    """Make ``dit``'s forward run on this rank's tokens of the SP group ``sp``."""
    model: Any = dit  # a diffusers DiT: its submodules and config are attributes
    name = type(model).__name__
    hooks = family_hooks(name)
    for heads in attention_heads(model):
        check_heads(heads, sp.size, what=name)
    forward = SequenceForward(sp)
    gathers_itself = hooks(model, forward)

    def gather_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        assert forward.output is not None, "proj_out runs inside a sharded forward"
        return gather_tokens(output, forward.output, sp, dim=1)

    if not gathers_itself and isinstance(getattr(model, "proj_out", None), nn.Module):
        model.proj_out.register_forward_hook(gather_output)
    # always_call: a forward that raises must not leave its shards to the next one.
    model.register_forward_hook(lambda module, args, output: forward.end(), always_call=True)
    return forward


def shard_pipeline(pipeline: Any, sp: SequenceGroup) -> None:
    """Shard every DiT of a StepPipeline (Wan 2.2's experts each) over ``sp``."""
    transformer = pipeline.transformer
    names = getattr(transformer, "names", None)  # an ExpertStack of several DiTs
    dits = [transformer.expert(i) for i in range(len(names))] if names else [transformer]
    for dit in dits:
        shard_dit(dit, sp)
