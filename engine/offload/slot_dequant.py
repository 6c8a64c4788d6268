"""Slot dequantization (``--dlo-dequant slot``): a streamed block's GGUF layers dequantized
into a bf16 slot region on the decode stream, so the block's compute is plain linears.

Under DLO a ``GGUFBlockLinear`` dequantizes its stored bytes at every call, on the compute
stream: a block then costs max(copy, compute + dequantization), and the dequantization is
what keeps a GGUF step above its streamed-bytes floor. Here the stored bytes still stream as
they are (the block's uint8 region, unchanged in host memory and in the slot), and the
decoding transfer (``movement.decode``) runs ``formats.slot_codecs.GGUFCodec`` on its own
stream once the bytes landed: each layer's weight, dequantized with the same torch function
and cast to the same compute dtype the layer would use, goes to the layer's place in the
slot's *decoded region* (one per slot, sized to the largest streamed block's GGUF weights,
each weight ``ALIGN_BYTES``-aligned). The layer's ``decoded_weight`` is pointed at that place
while the block runs (a derived tensor of the streamed block: ``hooks``) and is a placeholder
otherwise, so the output is bit-identical to the compute-side path.

The decoded regions are slot memory: ``decoded_bytes`` is added to each slot in the plan's
HBM budget (``build_plan``), the engine's budget planner and the offload report's
``slot_bytes``.

Built by ``backend.enable_offload``; the views are wired by ``builders.attach``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ditserve.engine.errors import OffloadError
from ditserve.engine.formats.gguf_linear import GGUFBlockLinear
from ditserve.engine.formats.slot_codecs import GGUFCodec, GGUFRun
from ditserve.engine.offload.plan import ALIGN_BYTES, BlockLayout, round_up

STORED = torch.uint8  # the dtype region GGUF bytes stream in (``GGUFBlockLinear.weight_q``)


@dataclass(frozen=True)
class BlockDequant:
    """One streamed block's GGUF layers: their codec, and each layer with its run."""

    codec: GGUFCodec
    layers: tuple[tuple[GGUFBlockLinear, GGUFRun], ...]


def _targets(module: nn.Module) -> Iterator[tuple[str, GGUFBlockLinear, int]]:
    """(name, layer, element offset in the decoded region) of each GGUF layer of a block."""
    cursor = 0
    for name, layer in module.named_modules():
        if isinstance(layer, GGUFBlockLinear):
            align = max(1, ALIGN_BYTES // layer.compute_dtype.itemsize)
            cursor = round_up(cursor, align)
            yield name, layer, cursor
            cursor += layer.out_features * layer.in_features


def decoded_bytes(module: nn.Module) -> int:
    """Bytes of a block's decoded region (0: the block has no GGUF layer)."""
    end = 0
    for _, layer, offset in _targets(module):
        end = round_up((offset + layer.out_features * layer.in_features)
                       * layer.compute_dtype.itemsize, ALIGN_BYTES)
    return end


def slot_decoded_bytes(blocks: Iterable[nn.Module]) -> int:
    """The decoded region one slot holds: the largest block's (the offload plan's HBM budget
    and the engine's budget planner both add it to each slot)."""
    return max((decoded_bytes(block) for block in blocks), default=0)


def block_dequant(layout: BlockLayout, module: nn.Module) -> BlockDequant | None:
    """The block's GGUF layers as runs over its laid-out uint8 region (None: it has none)."""
    placed = {p.name: p for p in layout.tensors}
    runs: list[tuple[GGUFBlockLinear, GGUFRun]] = []
    dtypes = set()
    for name, layer, offset in _targets(module):
        p = placed.get(f"{name}.weight_q" if name else "weight_q")
        if p is None or p.dtype != STORED:
            raise OffloadError(f"{layout.name}.{name} is a GGUF layer whose bytes are not in its "
                               "block's uint8 region; run it with --dlo-dequant compute")
        dtypes.add(layer.compute_dtype)
        runs.append((layer, GGUFRun(p.offset, p.numel, layer.quant, layer.out_features,
                                    layer.in_features, offset)))
    if not runs:
        return None
    if len(dtypes) > 1:
        raise OffloadError(f"{layout.name}'s GGUF layers compute in several dtypes "
                           f"({sorted(map(str, dtypes))}); --dlo-dequant slot decodes into one")
    return BlockDequant(GGUFCodec(tuple(r for _, r in runs), dtypes.pop()), tuple(runs))


@dataclass
class SlotDequant:
    """Every streamed block's ``BlockDequant`` (None where it has no GGUF layer) and the
    decoded region of each slot."""

    blocks: list[BlockDequant | None]  # per streamed block, in plan order
    regions: list[torch.Tensor]  # per slot: flat, the decoded weights' dtype

    @property
    def slot_bytes(self) -> int:
        """Device bytes of one slot's decoded region."""
        return self.regions[0].numel() * self.regions[0].element_size() if self.regions else 0

    def restore(self) -> None:
        """Give every layer back its compute-side dequantization."""
        for block in self.blocks:
            for layer, _ in block.layers if block is not None else ():
                layer.decoded_weight = None


def open_slot_dequant(layouts: Sequence[BlockLayout], modules: Sequence[nn.Module], *,
                      slots: int, device: torch.device) -> SlotDequant:
    """Plan the streamed blocks' runs and allocate the slots' decoded regions; raises when
    blocks stream but none has a GGUF layer (the option would do nothing). With every block
    resident (an HBM budget that holds them all) there is nothing to decode: no regions."""
    blocks = [block_dequant(layout, module) for layout, module in zip(layouts, modules,
                                                                       strict=True)]
    found = [b for b in blocks if b is not None]
    if not layouts:
        return SlotDequant([], [])
    if not found:
        raise OffloadError("--dlo-dequant slot dequantizes GGUF layers into the slots, but no "
                           "streamed block holds one; load a GGUF checkpoint or use "
                           "--dlo-dequant compute")
    dtype = found[0].codec.dtype
    if any(b.codec.dtype != dtype for b in found):
        raise OffloadError("the streamed blocks' GGUF layers compute in several dtypes; "
                           "--dlo-dequant slot decodes into one")
    numel = max(b.codec.numel for b in found)
    align = max(1, ALIGN_BYTES // dtype.itemsize)
    regions = [torch.empty(round_up(numel, align), dtype=dtype, device=device)
               for _ in range(slots)]
    return SlotDequant(blocks, regions)
