"""Text encoders streamed block by block through device slots, as DLO streams the DiT.

T5-XXL (Flux), UMT5-XXL (Wan) and Qwen2.5-VL (Qwen-Image) are transformer stacks of 9.5-16 GB:
parked whole in host memory (``component_placement.ParkedModules``), each encode still
brings the whole encoder into HBM, and the pipeline's peak is the DiT's slots plus the whole
encoder. Streamed, an encoder holds on the device only two slots of its largest layer and the
modules outside its layer lists (embeddings, final norm, a VL model's LM head); every encode
pass copies each layer once from pinned host memory, the same bytes as parking moves, so an
encode costs the same PCIe time at a fraction of the HBM. The math runs with the same weights
on the same device, so the embeddings are bit-identical to a resident encoder's.

``enable_offload`` finds an encoder's layer list itself (the outermost ``nn.ModuleList`` of
one repeated block class holding most of the weights: ``encoder.block`` for T5, the
language model's and the vision tower's ``layers``/``blocks`` for Qwen2.5-VL). Encoders it
finds none in stay parked. Each encoder streams rank-locally (no AllGather group): an
encode is short, and DP ranks encode different prompts at different times.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ditserve.engine.config import OffloadConfig
from ditserve.engine.errors import OffloadError
from ditserve.engine.offload import OffloadHandle, enable_offload
from ditserve.engine.offload.discovery import discover
from ditserve.engine.runner.component_placement import module_bytes

log = logging.getLogger(__name__)

# Two slots reach the copy floor for rank-local streaming (offload.builders.DEFAULT_SLOTS).
ENCODER_SLOTS = 2
# Encodes hold few activations (one prompt batch of at most 512 tokens); DLO's reserve check
# is for a DiT step's activations.
ENCODER_ACTIVATION_RESERVE_BYTES = 256 << 20


def streamable(module: torch.nn.Module) -> bool:
    """Whether DLO finds a layer list to stream in ``module``."""
    try:
        discover(module)
    except OffloadError:
        return False
    return True


@dataclass(frozen=True)
class StreamedEncoder:
    """One streamed encoder: its offload handle and the bytes it holds where."""

    handle: OffloadHandle
    total_bytes: int
    device_bytes: int  # slots + resident modules, on the device all the time
    streamed_blocks: int
    slots: int

    def lives(self) -> str:
        return (f"streamed by DLO: {self.streamed_blocks} layers from pinned host, "
                f"{self.slots} slots")


class StreamedEncoders:
    """Every streamable encoder of a pipeline under its own DLO handle; see module docstring."""

    def __init__(self, modules: Mapping[str, torch.nn.Module], *, device: torch.device) -> None:
        self.encoders: dict[str, StreamedEncoder] = {}
        config = OffloadConfig(enabled=True, slots=ENCODER_SLOTS, use_allgather=False)
        try:
            for name, module in modules.items():
                # Host copies are made from wherever the weights are; start from host memory
                # so the device never holds a whole encoder again.
                module.to("cpu")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                handle = enable_offload(module, config, device=device,
                                        activation_reserve_bytes=ENCODER_ACTIVATION_RESERVE_BYTES)
                self.encoders[name] = _described(handle, module_bytes(module))
                log.info("%s: %s (%.2f GiB on the device of %.2f GiB)", name,
                         self.encoders[name].lives(), self.encoders[name].device_bytes / 2**30,
                         self.encoders[name].total_bytes / 2**30)
        except BaseException:
            self.close()
            raise

    def __contains__(self, name: object) -> bool:
        return name in self.encoders

    def __getitem__(self, name: str) -> StreamedEncoder:
        return self.encoders[name]

    def close(self) -> None:
        """Back to ordinary host modules (tests; a runner keeps its encoders streamed)."""
        for encoder in self.encoders.values():
            encoder.handle.disable()
        self.encoders.clear()


def _described(handle: OffloadHandle, total_bytes: int) -> StreamedEncoder:
    report = handle.report()
    resident = int(report.get("resident_module_bytes", 0)) + int(
        report.get("resident_block_bytes", 0))
    slots = int(report.get("slots", 0))
    return StreamedEncoder(
        handle=handle, total_bytes=total_bytes,
        device_bytes=resident + slots * int(report.get("slot_bytes", 0)),
        streamed_blocks=int(report.get("streamed_blocks", 0)), slots=slots)
