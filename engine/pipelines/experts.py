"""ExpertStack: several DiTs that take turns (Wan 2.2's high- and low-noise experts) as one
module, so that offload and compilation treat them as one model.

Offload streams the stack's block lists (``transformer.blocks`` then ``transformer_2.blocks``)
through ONE set of device slots: HBM holds two slots of the largest block once, not per
expert, and a step that runs both experts (a batch straddling the boundary) streams them in
that order, one forward per expert. The stack is never called itself; the pipeline calls
the expert it needs. Its parameter names are the experts' prefixed with their component
names, which is how the host backings of both experts are combined (``dit_backing``).

Built by the Wan pipeline when a model has more than one DiT.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn


class ExpertStack(nn.Module):
    """DiTs by component name, in the order a step runs them."""

    def __init__(self, experts: Mapping[str, nn.Module]) -> None:
        super().__init__()
        for name, module in experts.items():
            self.add_module(name, module)
        self.names: tuple[str, ...] = tuple(experts)
        # diffusers' declaration of repeated block classes (regional compilation reads it).
        self._repeated_blocks = sorted(
            {b for m in experts.values() for b in (getattr(m, "_repeated_blocks", None) or ())}
        )

    def expert(self, index: int) -> nn.Module:
        return self.get_submodule(self.names[index])

    def block_lists(self, per_expert: tuple[str, ...]) -> tuple[str, ...]:
        """Every expert's block lists, prefixed, expert by expert (the streaming order)."""
        return tuple(f"{name}.{lst}" for name in self.names for lst in per_expert)

    def forward(self, *args: object, **kwargs: object) -> None:
        raise TypeError("an ExpertStack is not called; call one of its experts")
