"""``LoraRef``: a LoRA adapter as one request applies it, and the bounds on a request's list.

Pure Python (no torch): ``engine.request`` carries a tuple of them in ``SamplingParams.loras``
(and re-exports them), the server resolves them from the client's names
(``engine.server.fields.adapters``), the adapter bank loads what they point at.
"""

from __future__ import annotations

from dataclasses import dataclass

from ditserve.engine.errors import InvalidRequestError

MAX_LORAS_PER_REQUEST = 8
MAX_LORA_SCALE = 10.0


@dataclass(frozen=True)
class LoraRef:
    """One LoRA adapter a request applies, resolved by the engine's catalog
    (``engine.adapters.catalog``) from the name the client gave: the file it was loaded from,
    the catalog's load generation (a re-load under the same name is another adapter), its
    largest rank (as read; the step budget charges none: ``sched.work``) and its scale."""

    name: str
    path: str
    scale: float = 1.0
    rank: int = 0
    version: int = 0

    @property
    def key(self) -> tuple[str, int]:
        """Identity of the loaded weights (name and load generation), not of the scale."""
        return (self.name, self.version)


def check_loras(loras: tuple[LoraRef, ...]) -> None:
    """Raise InvalidRequestError ("loras") for too many adapters, a name given twice, or a
    scale out of bounds."""
    if len(loras) > MAX_LORAS_PER_REQUEST:
        raise InvalidRequestError("loras", f"at most {MAX_LORAS_PER_REQUEST} adapters per "
                                  f"request, got {len(loras)}")
    names = [ref.name for ref in loras]
    if len(set(names)) != len(names):
        raise InvalidRequestError("loras", f"an adapter is named twice: {names}")
    for ref in loras:
        scale = ref.scale
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) \
                or not -MAX_LORA_SCALE <= scale <= MAX_LORA_SCALE:
            raise InvalidRequestError("loras", f"adapter {ref.name!r}: scale must be a "
                                      f"number in [-{MAX_LORA_SCALE:g}, "
                                      f"{MAX_LORA_SCALE:g}], got {scale!r}")
