"""Key tables between diffusers' names and a checkpoint file's original names, walked both ways.

Owns the mechanics that the families' ``*_keys`` modules share, none of their names:

- ``Layout``: a family's whole mapping as data - top-level module paths, the final
  modulation whose two row halves swap, and block groups (``transformer_blocks.{i}.`` <->
  ``double_blocks.{i}.``) with their paths, whole keys and fused projections. ``to_original``
  and ``to_diffusers`` walk one layout in either direction, so a family's reader and writer
  cannot drift apart (``flux_keys`` uses both, ``flux2_keys`` the writer).
- fused projections: joined from their parts in row order when all are there (``pop_joined``,
  which ``z_image_keys`` uses too: its table lists only the names that differ, every other
  tensor keeping its name, so it is no ``Layout``), and split back into equal row blocks or
  blocks of a width another tensor gives (``Fused.rows_from``).
- ``strip_prefix``: ComfyUI-style prefixes (``model.diffusion_model.``) before the names.

Every transform is along dim 0 (rows) only, and slicing plus the caller's ``cat`` are the only
tensor operations, so the same walk maps torch tensors, GGUF tensors (quantized within rows) and
FP8 weights with their per-row scales. Output order is the table's (GGUF files are written in it).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Cat = Callable[[list[Any]], Any]
# (diffusers name, original name) pairs.
Pairs = tuple[tuple[str, str], ...]
# A module path in a table names these two keys (either may be absent).
PARAMS = ("weight", "bias")


@dataclass(frozen=True)
class Fused:
    """A projection that is one tensor in the file and several in diffusers."""

    original: str  # the file's module path, inside the block
    parts: tuple[str, ...]  # diffusers' module paths, in row order
    # None: the parts have equal rows. Else a key in the file's block whose row count each part
    # but the last has (the last takes the remaining rows): widths the fused tensor cannot tell.
    rows_from: str | None = None


@dataclass(frozen=True)
class Blocks:
    """One group of numbered blocks: ``{diffusers}{i}.`` <-> ``{original}{i}.``."""

    diffusers: str
    original: str
    paths: Pairs = ()  # module paths (``.weight``/``.bias`` follow)
    keys: Pairs = ()  # whole keys (a norm's ``weight`` that the file calls ``scale``)
    fused: tuple[Fused, ...] = ()


@dataclass(frozen=True)
class Layout:
    """A family's mapping; ``to_original`` refuses keys it does not name with ``unknown``."""

    unknown: str  # the KeyError's words, e.g. "Flux tensors with no BFL name"
    top: Pairs
    swapped: tuple[str, str] | None  # a module path pair whose two row halves swap
    blocks: tuple[Blocks, ...]


def strip_prefix(name: str, prefixes: Iterable[str]) -> str:
    """``name`` without the first of ``prefixes`` it starts with."""
    for prefix in prefixes:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _block_indices(names: Iterable[str], prefix: str) -> list[int]:
    """The block numbers ``i`` of the names starting ``{prefix}{i}.``, ascending."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    return sorted({int(m.group(1)) for n in names if (m := pattern.match(n))})


def _rows(t: Any) -> int:
    return int(t.shape[0])


def _swap_halves(t: Any, cat: Cat) -> Any:
    half = _rows(t) // 2
    return cat([t[half:], t[:half]])


def pop_joined(pool: dict[str, Any], names: Sequence[str], cat: Cat) -> Any | None:
    """The tensors ``names`` joined along rows in that order, popped from ``pool``; None (and
    ``pool`` untouched) when any is missing."""
    if not all(n in pool for n in names):
        return None
    return cat([pool.pop(n) for n in names])


def _split_rows(t: Any, bounds: Sequence[int]) -> list[Any]:
    """``t``'s row blocks ``[bounds[j], bounds[j + 1])``."""
    return [t[bounds[j]:bounds[j + 1]] for j in range(len(bounds) - 1)]


def to_original(state: Mapping[str, Any], layout: Layout, *, cat: Cat) -> dict[str, Any]:
    """A diffusers-named state dict in the file's names. Fused parts are joined only when all
    are present. Raises KeyError naming (up to five of) the keys ``layout`` does not map."""
    out, rest = _walk(state, layout, cat, to_original=True)
    if rest:
        raise KeyError(f"{layout.unknown}: {', '.join(sorted(rest)[:5])}")
    return out


def to_diffusers(checkpoint: Mapping[str, Any], layout: Layout, *, cat: Cat) -> dict[str, Any]:
    """File-named tensors (prefixes already stripped) in diffusers' names. Keys ``layout`` does
    not map are kept under their own names, last, for the caller's shape check to report."""
    out, rest = _walk(checkpoint, layout, cat, to_original=False)
    out.update(rest)
    return out


def _walk(state: Mapping[str, Any], layout: Layout, cat: Cat, *, to_original: bool,
          ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(mapped, the keys left unmapped). Pairs are read (diffusers, original) when writing the
    file's names and (original, diffusers) when reading them."""
    rest = dict(state)
    out: dict[str, Any] = {}

    def direct(pair: tuple[str, str]) -> tuple[str, str]:
        return pair if to_original else (pair[1], pair[0])

    def move(src: str, dst: str) -> None:
        if src in rest:
            out[dst] = rest.pop(src)

    for src, dst in map(direct, layout.top):
        for p in PARAMS:
            move(f"{src}.{p}", f"{dst}.{p}")
    if layout.swapped is not None:
        src, dst = direct(layout.swapped)
        for p in PARAMS:
            if f"{src}.{p}" in rest:
                out[f"{dst}.{p}"] = _swap_halves(rest.pop(f"{src}.{p}"), cat)
    for group in layout.blocks:
        src_group, dst_group = direct((group.diffusers, group.original))
        for i in _block_indices(rest, src_group):
            src, dst = f"{src_group}{i}.", f"{dst_group}{i}."
            # read before the renames below move the key these widths come from
            widths = {} if to_original else _widths(rest, src, group.fused)
            for path_src, path_dst in map(direct, group.paths):
                for p in PARAMS:
                    move(f"{src}{path_src}.{p}", f"{dst}{path_dst}.{p}")
            for key_src, key_dst in map(direct, group.keys):
                move(src + key_src, dst + key_dst)
            for fused in group.fused:
                for p in PARAMS:
                    if to_original:
                        _join(rest, out, src, dst, fused, p, cat)
                    elif fused.original in widths:
                        _split(rest, out, src, dst, fused, p, widths[fused.original])
    return out, rest


def _join(rest: dict[str, Any], out: dict[str, Any], src: str, dst: str, fused: Fused, p: str,
          cat: Cat) -> None:
    """Block ``src``'s parts of ``fused`` as block ``dst``'s one tensor, if all are there."""
    joined = pop_joined(rest, [f"{src}{part}.{p}" for part in fused.parts], cat)
    if joined is not None:
        out[f"{dst}{fused.original}.{p}"] = joined


def _split(rest: dict[str, Any], out: dict[str, Any], src: str, dst: str, fused: Fused, p: str,
           width: int | None) -> None:
    """Block ``src``'s one tensor of ``fused``, if there, as block ``dst``'s parts."""
    if f"{src}{fused.original}.{p}" not in rest:
        return
    t = rest.pop(f"{src}{fused.original}.{p}")
    pieces = _split_rows(t, _bounds(_rows(t), len(fused.parts), width))
    for part, piece in zip(fused.parts, pieces, strict=True):
        out[f"{dst}{part}.{p}"] = piece


def _widths(rest: Mapping[str, Any], src: str, fused: Iterable[Fused]) -> dict[str, int | None]:
    """Each splittable fused path of block ``src`` -> its parts' row count (None: equal parts);
    one whose ``rows_from`` key is absent is missing and stays fused."""
    out: dict[str, int | None] = {}
    for f in fused:
        if f.rows_from is None:
            out[f.original] = None
        elif src + f.rows_from in rest:
            out[f.original] = _rows(rest[src + f.rows_from])
    return out


def _bounds(total: int, count: int, width: int | None) -> list[int]:
    """Row bounds of ``count`` parts: equal thirds (etc.) of ``total`` rows (rows past the last
    whole share dropped), or ``width`` rows each with the rest in the last."""
    if width is None:
        share = total // count
        return [j * share for j in range(count + 1)]
    return [j * width for j in range(count)] + [total]
