"""Module discovery: which parts of a DiT are streamed blocks and which stay resident.

Blocks come from the model's block lists, in list order (never from tracing a forward): the
lists the caller passes (the pipeline's, e.g. both experts' of a Wan 2.2 ``ExpertStack``),
else the lists its family declares for the DiT class (``engine.families``: Flux's
``transformer_blocks`` then ``single_transformer_blocks``, Qwen-Image's
``transformer_blocks``, Wan's ``blocks``); for other diffusers DiTs, the outermost
``nn.ModuleList``s whose entries are all of one class and which hold a real share of the
weights. Everything else in the
transformer (embeddings, norms, projections, the root's own parameters) is resident: it
moves to the device once. Other pipeline components (text encoders, VAE) are not seen here;
the engine places them.

Called by ``backend.enable_offload``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from ditserve.engine.errors import OffloadError
from ditserve.engine.families import declared_block_lists

# A ModuleList holding less than this share of the weights is not worth streaming
# (e.g. a list of small embedders): it stays resident.
MIN_LIST_SHARE = 0.05


@dataclass(frozen=True)
class Discovery:
    """Streamed block candidates (in call order) and the resident rest."""

    blocks: tuple[tuple[str, nn.Module], ...]  # ("transformer_blocks.0", module)
    resident: tuple[tuple[str, nn.Module], ...]  # modules outside every block list
    root: nn.Module  # owns parameters/buffers of its own that are resident too


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _generic_block_lists(model: nn.Module) -> list[str]:
    total = _numel(model) or 1
    found: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if (
                isinstance(child, nn.ModuleList)
                and len(child) >= 2
                and len({type(m) for m in child}) == 1
                and all(_numel(m) > 0 for m in child)
                and _numel(child) >= MIN_LIST_SHARE * total
            ):
                found.append(path)  # outermost: do not look inside a block list
            else:
                visit(path + ".", child)

    visit("", model)
    return found


def discover(model: nn.Module, block_lists: Sequence[str] | None = None) -> Discovery:
    """Split ``model`` into block lists and resident modules; raise if it has no block list."""
    list_names = tuple(block_lists or ()) or declared_block_lists(type(model).__name__) or tuple(
        _generic_block_lists(model))
    if not list_names:
        raise OffloadError(
            f"{type(model).__name__} has no block list to stream (an nn.ModuleList of repeated "
            "blocks holding most of the weights); layerwise offload supports diffusers DiTs "
            "such as the registered families' (engine.families) - run this model without "
            "--offload"
        )
    blocks: list[tuple[str, nn.Module]] = []
    for list_name in list_names:
        block_list = model.get_submodule(list_name)
        blocks.extend((f"{list_name}.{i}", m) for i, m in enumerate(block_list.children()))

    lists = set(list_names)
    resident: list[tuple[str, nn.Module]] = []

    def collect(prefix: str, module: nn.Module) -> None:
        # Resident = the largest subtrees that contain no block list.
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if path in lists:
                continue
            if any(lst.startswith(path + ".") for lst in lists):
                collect(path + ".", child)
            else:
                resident.append((path, child))

    collect("", model)
    return Discovery(tuple(blocks), tuple(resident), model)
