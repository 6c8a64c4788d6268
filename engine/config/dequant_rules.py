"""The rules of ``offload.dequant`` (``--dlo-dequant``), apart so ``rules`` stays one screenful
per concern. Called by ``rules.format_problems``."""

from __future__ import annotations

from ditserve.engine.config.types import DEQUANT_MODES, OffloadConfig


def dequant_problems(off: OffloadConfig, *, quantization: str | None,
                     group_size: int) -> list[str]:
    """``dequant`` slot: GGUF layers dequantized into the slots by the decode stream - an
    offload option, for rank-local streaming of a GGUF DiT (the option is refused at enable
    when no streamed block holds a GGUF layer)."""
    if off.dequant not in DEQUANT_MODES:
        return [f"offload.dequant must be one of {', '.join(DEQUANT_MODES)}, "
                f"got {off.dequant!r}"]
    if off.dequant != "slot":
        return []
    out = []
    if not off.enabled:
        out.append("offload.dequant=slot dequantizes streamed GGUF blocks into the offload's "
                   "slots; it needs offload.enabled (--offload dlo), or drop --dlo-dequant")
    if off.compress == "lossless":
        out.append("offload.dequant=slot and offload.compress=lossless do not combine (a GGUF "
                   "DiT's blocks hold no bf16 weights to pack): drop one")
    if quantization == "fp8":
        out.append("offload.dequant=slot dequantizes GGUF layers; FP8 layers run scaled "
                   "matmuls over their fp8 weights: drop --dlo-dequant or --quantization")
    if group_size > 1:
        out.append("offload.dequant=slot streams rank-local only so far; use "
                   "--dlo-no-use-allgather or --dlo-dequant compute")
    return out
