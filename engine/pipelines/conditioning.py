"""Conditioning images inside the image-conditioned pipelines (edits, image-to-video).

A request's ``ConditionImage`` (decoded RGB bytes, checked at the edge) becomes the PIL image
diffusers' own image processors take, so every family resizes and normalises exactly as its
diffusers pipeline does. ``encode_once`` batches the VAE encode of the conditioning images of
the requests admitted in one step: one VAE forward per group of equally sized inputs, the
result kept on each request's state until its ``prepare_encode`` takes it; ``encode_each``
does the same for requests with several inputs of different sizes (Qwen-Image-Edit Plus).

Called by the family modules (``flux_kontext``, ``wan_i2v``, ``qwen_image_edit``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ditserve.engine.request import ConditionImage

if TYPE_CHECKING:
    from ditserve.engine.step.denoise_state import DenoiseState

ENCODED = "condition_latents"  # DenoiseState.host key of a batched encode's result


def to_pil(image: ConditionImage) -> Any:
    """The conditioning image as an RGB PIL image."""
    from PIL import Image

    return Image.frombytes("RGB", (image.width, image.height), image.rgb)


def encode_once(
    states: Sequence[DenoiseState],
    *,
    prepare: Callable[[DenoiseState], tuple[Hashable, torch.Tensor] | None],
    encode: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Encode the conditioning inputs of ``states`` with one ``encode`` call per group.

    prepare(state): (group key, (k, ...) preprocessed input) or None for a request without
        one; inputs of one key must stack along dim 0. encode: batched input -> batched
        latents (one output row per input row). Each state gets its own rows in
        ``state.host[ENCODED]``.
    """
    groups: dict[Hashable, list[tuple[DenoiseState, torch.Tensor]]] = {}
    for state in states:
        prepared = prepare(state)
        if prepared is not None:
            key, tensor = prepared
            groups.setdefault(key, []).append((state, tensor))
    for members in groups.values():
        encoded = encode(torch.cat([tensor for _, tensor in members]))
        start = 0
        for state, tensor in members:
            state.host[ENCODED] = encoded[start : start + tensor.shape[0]]
            start += tensor.shape[0]


def take_encoded(state: DenoiseState) -> Any:
    """What ``encode_once`` (rows) or ``encode_each`` (a tuple) left for this request (once),
    else None."""
    return state.host.pop(ENCODED, None)


def encode_each(
    states: Sequence[DenoiseState],
    *,
    prepare: Callable[[DenoiseState], Sequence[tuple[Hashable, torch.Tensor]]],
    encode: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """``encode_once`` for requests with several conditioning inputs of different sizes (an
    edit from several images): every input joins the group of its key, one ``encode`` call
    per group across all requests, and each state gets the tuple of its inputs' encodings,
    in its own order, in ``state.host[ENCODED]``."""
    groups: dict[Hashable, list[tuple[int, int, torch.Tensor]]] = {}
    outputs: list[list[torch.Tensor | None]] = []
    for index, state in enumerate(states):
        prepared = prepare(state)
        outputs.append([None] * len(prepared))
        for slot, (key, tensor) in enumerate(prepared):
            groups.setdefault(key, []).append((index, slot, tensor))
    for members in groups.values():
        encoded = encode(torch.cat([tensor for _, _, tensor in members]))
        start = 0
        for index, slot, tensor in members:
            outputs[index][slot] = encoded[start : start + tensor.shape[0]]
            start += tensor.shape[0]
    for state, encoded_inputs in zip(states, outputs, strict=True):
        if encoded_inputs:
            state.host[ENCODED] = tuple(encoded_inputs)
