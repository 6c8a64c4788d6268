"""InputBatch: gathers the rows of many requests into one denoise forward and scatters back.

Called by the model runner every step. Static rows (prompt embeddings, pooled embeddings,
guidance) do not change across a request's steps, so while the batch composition is unchanged
they are reused instead of concatenated again; only latents and timesteps are gathered each
step (into reused buffers). Sequence tensors of different lengths are right-padded to the
batch maximum and described by a boolean mask named ``<name>_mask``.

One InputBatch is one forward, so it takes one shape group: requests of one ``BatchKey``
whose static tensors have the same names, dtypes and per-row shapes beyond the sequence
length. Anything else is refused with ``BatchMismatchError`` naming the requests and the
difference (a mix would otherwise drop a tensor silently or fail deep inside ``torch.cat``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ditserve.engine.errors import BatchMismatchError
from ditserve.engine.step.denoise_state import DenoiseState


def _pad_cat(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate along dim 0, right-padding dim 1 to the longest; mask is None if no padding."""
    if tensors[0].dim() < 2 or all(t.shape[1] == tensors[0].shape[1] for t in tensors):
        return torch.cat(list(tensors)), None
    longest = max(t.shape[1] for t in tensors)
    padded, masks = [], []
    for t in tensors:
        extra = longest - t.shape[1]
        # (rows, L, ...) -> (rows, longest, ...): zeros after the real tokens.
        pad_shape = (t.shape[0], extra, *t.shape[2:])
        padded.append(torch.cat([t, t.new_zeros(pad_shape)], dim=1))
        mask = torch.zeros(t.shape[0], longest, dtype=torch.bool, device=t.device)
        mask[:, : t.shape[1]] = True
        masks.append(mask)
    return torch.cat(padded), torch.cat(masks)


@dataclass
class InputBatch:
    """The batched model inputs of one step.

    request_ids: batch order; row_slices[i] are request i's rows in every batched tensor.
    static: batched static rows (+ masks); shared: tensors common to all rows (equal BatchKey);
    hidden_states: (rows, tokens, channels);
    timesteps: (rows,) each row's current timestep;
    states: the requests' states, in batch order, for pipelines that route or mask by
        per-request host facts (Wan 2.2's expert by timestep, Qwen-Image's text lengths)
        without reading device tensors back.
    """

    request_ids: tuple[str, ...]
    row_slices: tuple[slice, ...]
    static: dict[str, torch.Tensor]
    shared: dict[str, torch.Tensor]
    hidden_states: torch.Tensor
    timesteps: torch.Tensor
    states: tuple[DenoiseState, ...] = ()

    @property
    def num_rows(self) -> int:
        return int(self.hidden_states.shape[0])

    def split(self, output: torch.Tensor) -> list[torch.Tensor]:
        """Per-request views of a (rows, ...) model output, in batch order."""
        return [output[s] for s in self.row_slices]


class InputBatchBuilder:
    """Builds InputBatch objects, reusing static rows and buffers across unchanged steps."""

    def __init__(self) -> None:
        # Identity of the last batch's members: the state objects and their static-row dicts
        # (held, so their ids cannot be recycled). Request ids are not enough: a finished
        # request's id may be reused by a new request with other prompts.
        self._members: list[tuple[DenoiseState, dict[str, torch.Tensor], int]] = []
        self._static: dict[str, torch.Tensor] = {}
        self._hidden: torch.Tensor | None = None
        self._timesteps: torch.Tensor | None = None
        self.static_rebuilds = 0

    def build(self, states: Sequence[DenoiseState]) -> InputBatch:
        if not states:
            raise ValueError("an InputBatch needs at least one request")
        slices, start = [], 0
        for state in states:
            slices.append(slice(start, start + state.rows))
            start += state.rows
        reused = len(states) == len(self._members) and all(
            state is old and state.static_rows is rows and state.rows == n
            for state, (old, rows, n) in zip(states, self._members, strict=True)
        )
        if not reused:
            self._check(states)
            self._static = self._gather_static(states)
            self._members = [(s, s.static_rows, s.rows) for s in states]
            self._hidden = None
            self._timesteps = None
            self.static_rebuilds += 1
        hidden = self._gather_latents(states)
        timesteps = self._gather_timesteps(states, hidden)
        return InputBatch(
            request_ids=tuple(s.request_id for s in states),
            row_slices=tuple(slices),
            static=self._static,
            shared=states[0].shared,
            hidden_states=hidden,
            timesteps=timesteps,
            states=tuple(states),
        )

    @staticmethod
    def _check(states: Sequence[DenoiseState]) -> None:
        """One shape group, one static-tensor contract (see module docstring)."""
        first = states[0]
        key, names = first.params.batch_key(), set(first.static_rows)
        for state in states[1:]:
            where = f"requests {first.request_id!r} and {state.request_id!r}"
            if state.params.batch_key() != key:
                raise BatchMismatchError(
                    f"{where} are of different shape groups ({key} vs "
                    f"{state.params.batch_key()}): give each group its own InputBatch")
            if set(state.static_rows) != names or set(state.shared) != set(first.shared):
                raise BatchMismatchError(
                    f"{where} have different static tensors: "
                    f"{sorted(names)} / {sorted(first.shared)} vs {sorted(state.static_rows)} "
                    f"/ {sorted(state.shared)}; the pipeline must fill the same ones for every "
                    "request of a shape group")
            for name in names:
                a, b = first.static_rows[name], state.static_rows[name]
                if a.dtype != b.dtype or a.dim() != b.dim() or a.shape[2:] != b.shape[2:]:
                    raise BatchMismatchError(
                        f"{where} disagree on static tensor {name!r}: {a.dtype} "
                        f"{tuple(a.shape)} vs {b.dtype} {tuple(b.shape)} (only the row count "
                        "and the sequence length, dim 1, may differ)")

    @staticmethod
    def _gather_static(states: Sequence[DenoiseState]) -> dict[str, torch.Tensor]:
        names = list(states[0].static_rows)
        out: dict[str, torch.Tensor] = {}
        for name in names:
            batched, mask = _pad_cat([s.static_rows[name] for s in states])
            out[name] = batched
            if mask is not None:
                out[f"{name}_mask"] = mask
        return out

    def _gather_latents(self, states: Sequence[DenoiseState]) -> torch.Tensor:
        parts: list[torch.Tensor] = []
        for s in states:
            assert s.latents is not None, "state used before prepare_encode"
            # Under true CFG the negative-prompt rows denoise the same latents.
            repeats = s.rows // s.latents.shape[0]
            parts.extend([s.latents] * repeats)
        total = sum(p.shape[0] for p in parts)
        shape = (total, *parts[0].shape[1:])
        if self._hidden is None or self._hidden.shape != shape or self._hidden.dtype != parts[0].dtype:
            self._hidden = torch.empty(shape, dtype=parts[0].dtype, device=parts[0].device)
        torch.cat(parts, out=self._hidden)
        return self._hidden

    def _gather_timesteps(
        self, states: Sequence[DenoiseState], hidden: torch.Tensor
    ) -> torch.Tensor:
        rows = hidden.shape[0]
        if self._timesteps is None or self._timesteps.shape[0] != rows:
            self._timesteps = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        start = 0
        for s in states:
            self._timesteps[start : start + s.rows] = s.current_timestep()
            start += s.rows
        return self._timesteps
