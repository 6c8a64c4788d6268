"""Attach sequence parallelism to a loaded DiT: its forward then runs on this rank's tokens.

Per DiT class, a few torch hooks around modules the forward already calls, and the family's
Ulysses processor on every attention (``processors``); diffusers' code is not modified:

- the DiT's root pre-hook reads the full inputs, decides this forward's shards
  (``SequenceForward``) and replaces the token inputs by this rank's slice; where the token
  sequence only exists inside the forward (Wan's patch embedding), the first block's
  pre-hook slices it instead;
- the RoPE tables are computed for the whole sequence and sliced to the shard by a hook on
  the module that makes them (Qwen-Image's ``pos_embed``, Wan's ``rope``); Flux computes
  them from position ids, which the root hook slices;
- a hook on ``proj_out`` (the last token-wise layer) gathers every rank's output tokens, so
  the DiT returns the full output - the same on every rank - and everything after it (Wan's
  unpatchify, the sampler step) runs unchanged.

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
from ditserve.engine.parallel.processors import (
    FluxUlyssesProcessor,
    QwenImageUlyssesProcessor,
    SequenceForward,
    WanUlyssesProcessor,
)
from ditserve.engine.parallel.tokens import key_mask
from ditserve.engine.parallel.ulysses import SequenceGroup, check_heads, gather_tokens

Hooks = Callable[[Any, SequenceForward], None]  # (a diffusers DiT, its forward's state)


def _token_input(kwargs: dict[str, Any], name: str) -> torch.Tensor:
    value = kwargs.get(name)
    if not isinstance(value, torch.Tensor):
        raise ConfigError(f"a sequence-parallel DiT must be called with {name}= as a keyword "
                          "tensor argument (the pipelines do)")
    return value


def _flux(model: Any, forward: SequenceForward) -> None:
    sp = forward.group

    def split_inputs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        hidden = _token_input(kwargs, "hidden_states")  # (B, N, C) image tokens
        text = _token_input(kwargs, "encoder_hidden_states")  # (B, T, D) text tokens
        image_ids, text_ids = _token_input(kwargs, "img_ids"), _token_input(kwargs, "txt_ids")
        # diffusers accepts deprecated (1, L, 3) ids and uses their first row.
        image_ids, text_ids = (ids[0] if ids.ndim == 3 else ids for ids in (image_ids, text_ids))
        image, txt = sp.shard(hidden.shape[1]), sp.shard(text.shape[1])
        # RoPE comes from the ids, so slicing them slices RoPE: rank r's [text_r, image_r].
        kwargs.update(hidden_states=image.take(hidden, 1), encoder_hidden_states=txt.take(text, 1),
                      img_ids=image.take(image_ids, 0), txt_ids=txt.take(text_ids, 0))
        forward.begin(output=image, key_mask=key_mask([(txt, None), (image, None)],
                                                      rows=hidden.shape[0], device=hidden.device))
        return args, kwargs

    model.register_forward_pre_hook(split_inputs, with_kwargs=True)
    model.set_attn_processor(FluxUlyssesProcessor(forward))


def _qwen_image(model: Any, forward: SequenceForward) -> None:
    sp = forward.group
    if getattr(model, "zero_cond_t", False):
        raise ConfigError("sequence parallelism does not support Qwen-Image DiTs with zero_cond_t "
                          "(image editing); run them with sequence_parallel_size 1")

    def split_inputs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        hidden = _token_input(kwargs, "hidden_states")  # (B, N, C)
        text = _token_input(kwargs, "encoder_hidden_states")  # (B, T, D)
        text_mask = kwargs.get("encoder_hidden_states_mask")  # (B, T) or None
        image, txt = sp.shard(hidden.shape[1]), sp.shard(text.shape[1])
        kwargs.update(hidden_states=image.take(hidden, 1), encoder_hidden_states=txt.take(text, 1))
        if text_mask is not None:
            kwargs["encoder_hidden_states_mask"] = txt.take(text_mask.to(torch.bool), 1)
        mask = key_mask([(txt, text_mask), (image, None)], rows=hidden.shape[0],
                        device=hidden.device)
        forward.begin(output=image, key_mask=mask, image=image, text=txt)
        return args, kwargs

    def full_text_rope(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # The DiT asks for RoPE of its (local) text length; ask for the whole text's, and
        # slice both tables to this rank's tokens below.
        kwargs["max_txt_seq_len"] = forward.extras["text"].total
        return args, kwargs

    def slice_rope(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        image_freqs, text_freqs = output  # (N, D/2), (T, D/2) complex
        return (forward.extras["image"].take(image_freqs, 0),
                forward.extras["text"].take(text_freqs, 0))

    model.register_forward_pre_hook(split_inputs, with_kwargs=True)
    model.pos_embed.register_forward_pre_hook(full_text_rope, with_kwargs=True)
    model.pos_embed.register_forward_hook(slice_rope, with_kwargs=True)
    model.set_attn_processor(QwenImageUlyssesProcessor(forward))


def _wan(model: Any, forward: SequenceForward) -> None:
    sp = forward.group
    patch = tuple(int(p) for p in model.config.patch_size)  # (t, h, w)

    def plan_shards(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        latents = _token_input(kwargs, "hidden_states")  # (B, C, F, H, W)
        _, _, frames, height, width = latents.shape
        tokens = (frames // patch[0]) * (height // patch[1]) * (width // patch[2])
        image = sp.shard(tokens)
        timestep = kwargs.get("timestep")
        if isinstance(timestep, torch.Tensor) and timestep.ndim == 2:
            # Wan 2.2 TI2V: a timestep per token (rows, tokens), embedded per token.
            kwargs["timestep"] = image.take(timestep, 1)
        forward.begin(output=image, key_mask=key_mask([(image, None)], rows=latents.shape[0],
                                                      device=latents.device))
        return args, kwargs

    def split_tokens(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # The first block's input is the first place Wan's tokens exist: (B, N, C).
        assert forward.output is not None, "the root pre-hook plans the shards"
        if args:
            return (forward.output.take(args[0], 1), *args[1:]), kwargs
        kwargs["hidden_states"] = forward.output.take(kwargs["hidden_states"], 1)
        return args, kwargs

    def slice_rope(module: nn.Module, args: Any, output: Any) -> Any:
        assert forward.output is not None
        cos, sin = output  # (1, N, 1, D) each
        return forward.output.take(cos, 1), forward.output.take(sin, 1)

    model.register_forward_pre_hook(plan_shards, with_kwargs=True)
    model.blocks[0].register_forward_pre_hook(split_tokens, with_kwargs=True)
    model.rope.register_forward_hook(slice_rope)
    model.set_attn_processor(WanUlyssesProcessor(forward))


# DiT class name -> the hooks that shard it (as diffusers keys its _cp_plan by model class).
HOOKS: dict[str, Hooks] = {
    "FluxTransformer2DModel": _flux,
    "QwenImageTransformer2DModel": _qwen_image,
    "WanTransformer3DModel": _wan,
}


def shard_dit(dit: nn.Module, sp: SequenceGroup) -> SequenceForward:
    """Make ``dit``'s forward run on this rank's tokens of the SP group ``sp``."""
    model: Any = dit  # a diffusers DiT: its submodules and config are attributes
    name = type(model).__name__
    hooks = HOOKS.get(name)
    if hooks is None:
        raise ConfigError(f"sequence parallelism has no plan for {name}; supported: "
                          f"{', '.join(HOOKS)}")
    check_heads(int(model.config.num_attention_heads), sp.size, what=name)
    forward = SequenceForward(sp)
    hooks(model, forward)

    def gather_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        assert forward.output is not None, "proj_out runs inside a sharded forward"
        return gather_tokens(output, forward.output, sp, dim=1)

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
