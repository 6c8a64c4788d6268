"""Text encoders streamed block by block through device slots, as DLO streams the DiT.

T5-XXL (Flux), UMT5-XXL (Wan) and Qwen2.5-VL (Qwen-Image) are transformer stacks of 9.5-16 GB:
parked whole in host memory (``component_placement.ParkedModules``), each encode still
brings the whole encoder into HBM, and the pipeline's peak is the DiT's slots plus the whole
encoder. Streamed, an encoder holds on the device only two slots of its largest layer and the
small modules outside its layer lists (final norm, position tables); every encode pass
copies each layer once from pinned host memory, the same bytes as parking moves, so an
encode costs the same PCIe time at a fraction of the HBM. The math runs with the same weights
on the same device, so the embeddings are bit-identical to a resident encoder's.

Two modules outside the layers stay in host memory too (``host_side_modules``):

- a large token table (``HOST_TABLE_MIN_BYTES``; UMT5's is 2.1 GB, Qwen2.5-VL's 1.09 GB,
  T5-XXL's 0.26 GB): it is looked up on the host and only the rows read are uploaded
  (``pipelines.host_embedding``);
- an output head (Qwen2.5-VL's 1.09 GB LM head): pipelines read hidden states only, so it is
  never run; calling it raises.

Where the pipeline's prompts never show the encoder an image (``vision=True``), a VLM's vision
side stays on the host as well (``vision_side_modules``: FLUX.2's 0.88 GB Pixtral tower and
projector), guarded the same way; only the parts outside DLO's layer lists move there
(Qwen2.5-VL's vision blocks stream with the language layers, cost no HBM, and stay as they are).

``enable_offload`` finds an encoder's layer list itself (the outermost ``nn.ModuleList`` of
one repeated block class holding most of the weights: ``encoder.block`` for T5, the
language model's and the vision tower's ``layers``/``blocks`` for Qwen2.5-VL). Encoders it
finds none in stay parked. Each encoder streams with the options the replica's resolved offload
gives encoders (``ResolvedOffload.encoder_options``: rank-local, two slots).

An encoder runs once per request, the DiT tens of times, so each encoder's slots are given
back when its pass ends and taken again when the next begins (``enable_offload``'s
``release_slots``): between encodes a streamed encoder holds only its modules outside the
layers, and the DiT's denoise peak carries no encoder slots (FLUX.2's Mistral-24B: two 0.9 GiB
layer slots). ``StreamedEncoder.slot_bytes`` is that part of its device bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ditserve.engine.config import ResolvedOffload
from ditserve.engine.errors import OffloadError
from ditserve.engine.offload import OffloadHandle, enable_offload
from ditserve.engine.offload.discovery import discover
from ditserve.engine.pipelines.host_embedding import HostEmbedding, embedding_module
from ditserve.engine.placement.component_placement import module_bytes

log = logging.getLogger(__name__)

# Encodes hold few activations (one prompt batch of at most 512 tokens); DLO's reserve check
# is for a DiT step's activations.
ENCODER_ACTIVATION_RESERVE_BYTES = 256 << 20
# Token tables at least this large stay on the host: T5-XXL's (0.26 GB) and larger; a CLIP's
# (<= 0.13 GB) stays on the device, where its pooling reads the token ids anyway.
HOST_TABLE_MIN_BYTES = 192 << 20
# Where transformers' VLMs keep their vision side, on the model or its ``.model``: a vision
# tower (Mistral3's Pixtral, LLaVA-style), a visual encoder (Qwen2.5-VL, Qwen3-VL) and the
# projector into the language model's width.
VISION_ATTRS = ("vision_tower", "visual", "multi_modal_projector")


def vision_side_modules(encoder: torch.nn.Module) -> list[torch.nn.Module]:
    """The vision side of a VLM ``encoder`` (``VISION_ATTRS``) outside DLO's layer lists: each
    vision module whole, or, where streamed layers lie inside it, its largest parts that hold
    none (a host module inside a streamed block is refused by the offload). [] for a text-only
    encoder."""
    found: list[torch.nn.Module] = []
    for owner in (encoder, getattr(encoder, "model", None)):
        for attr in VISION_ATTRS:
            module = getattr(owner, attr, None)
            if isinstance(module, torch.nn.Module) and not any(module is m for m in found):
                found.append(module)
    if not found:
        return []
    blocks = {id(m) for _, m in discover(encoder).blocks} if streamable(encoder) else set()
    return [part for module in found for part in _outside_blocks(module, blocks)]


def _outside_blocks(module: torch.nn.Module, blocks: set[int]) -> list[torch.nn.Module]:
    if id(module) in blocks:
        return []
    if not any(id(m) in blocks for m in module.modules()):
        return [module]
    return [part for child in module.children() for part in _outside_blocks(child, blocks)]


def host_side_modules(encoder: torch.nn.Module, *, min_table_bytes: int = HOST_TABLE_MIN_BYTES,
                      vision: bool = False) -> list[torch.nn.Module]:
    """The modules of ``encoder`` a streamed encoder keeps in host memory (module docstring):
    its token table if at least ``min_table_bytes``, its output head if it has one (and does
    not share the weight of a table that stays on the device), and with ``vision`` its vision
    side (``vision_side_modules``)."""
    found: list[torch.nn.Module] = []
    device_side: list[torch.nn.Module] = []  # a token table too small to keep on the host
    for which in ("input", "output"):
        module = embedding_module(encoder, which)
        if isinstance(module, HostEmbedding):
            module = module.table
        if module is None or any(module is m for m in found):
            continue
        if which == "input" and module_bytes(module) < min_table_bytes:
            device_side.append(module)
            continue
        # A head tied to a table that stays on the device shares its weight: moving the
        # head to the host would move the table with it, and the encode's device token ids
        # would then index a host table.
        if which == "output" and any(_shares_weights(module, m) for m in device_side):
            continue
        found.append(module)
    return found + (vision_side_modules(encoder) if vision else [])


def _shares_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    ours = {id(p) for p in a.parameters()}
    return any(id(p) in ours for p in b.parameters())


def host_side_bytes(encoder: torch.nn.Module, *, min_table_bytes: int = HOST_TABLE_MIN_BYTES,
                    vision: bool = False) -> int:
    """Bytes of ``host_side_modules`` (a tied table and head once)."""
    return module_bytes(torch.nn.ModuleList(
        host_side_modules(encoder, min_table_bytes=min_table_bytes, vision=vision)))


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
    device_bytes: int  # slots + resident modules, on the device while it encodes
    streamed_blocks: int
    slots: int
    host_side_bytes: int = 0  # token table, output head and vision side kept in host memory
    vision_bytes: int = 0  # of which the vision side (a text-only pipeline's VLM encoder)
    slot_bytes: int = 0  # of device_bytes: its slots, given back between encode passes

    def lives(self) -> str:
        what = "token table, output head" + (", vision side" if self.vision_bytes else "")
        kept = (f", {self.host_side_bytes / 2**30:.2f} GiB outside the layers ({what}) in "
                "host memory" if self.host_side_bytes >= 1 << 20 else "")
        given = " (given back between encodes)" if self.slot_bytes else ""
        return (f"streamed by DLO: {self.streamed_blocks} layers from pinned host, "
                f"{self.slots} slots{given}{kept}")


class StreamedEncoders:
    """Every streamable encoder of a pipeline under its own DLO handle; see module docstring."""

    def __init__(self, modules: Mapping[str, torch.nn.Module], *, device: torch.device,
                 offload: ResolvedOffload, min_table_bytes: int = HOST_TABLE_MIN_BYTES,
                 vision: bool = False) -> None:
        """offload: the replica's resolved offload, which says how encoders stream;
        min_table_bytes: the smallest token table kept on the host (tests lower it);
        vision: keep a VLM encoder's vision side on the host (the pipeline's prompts are
        text only: ``capabilities.encoder_reads_images`` is False)."""
        self.encoders: dict[str, StreamedEncoder] = {}
        self._undo: list[Callable[[], None]] = []
        config = offload.encoder_options()
        try:
            for name, module in modules.items():
                # The pinned host copies are filled from wherever the weights are, and the
                # originals are freed as the layers are hooked. Pipelines leave their
                # encoders where the loader put them (WholePipeline): host tensors over
                # the checkpoint's mapping, so the fill reads file pages (shared, not this
                # process's memory) and host memory holds each layer once, pinned, while the
                # device never holds the whole encoder (bench/host_rss.py).
                on_host = host_side_modules(module, min_table_bytes=min_table_bytes,
                                            vision=vision)
                seeing = vision_side_modules(module) if vision else []
                self._keep_on_host(name, module, on_host, device, seeing)
                handle = enable_offload(module, config, device=device,
                                        activation_reserve_bytes=ENCODER_ACTIVATION_RESERVE_BYTES,
                                        host_modules=on_host, release_slots=True)
                self.encoders[name] = _described(
                    handle, module_bytes(module),
                    host_bytes=module_bytes(torch.nn.ModuleList(on_host)),
                    vision_bytes=module_bytes(torch.nn.ModuleList(seeing)))
                log.info("%s: %s (%.2f GiB on the device of %.2f GiB)", name,
                         self.encoders[name].lives(), self.encoders[name].device_bytes / 2**30,
                         self.encoders[name].total_bytes / 2**30)
        except BaseException:
            self.close()
            raise

    def _keep_on_host(self, name: str, encoder: torch.nn.Module, modules: list[torch.nn.Module],
                      device: torch.device, vision: list[torch.nn.Module]) -> None:
        """Install the host-side lookup for a host table and a guard on every other host
        module (a head, the ``vision`` side)."""
        table = embedding_module(encoder)
        for module in modules:
            module.to("cpu")
            if module is table and isinstance(table, torch.nn.Embedding):
                encoder.set_input_embeddings(HostEmbedding(table, device))  # type: ignore[operator]
                self._undo.append(lambda e=encoder, t=table: e.set_input_embeddings(t))  # type: ignore[misc]
            else:
                seeing = any(module is m for m in vision)
                hook = module.register_forward_pre_hook(
                    _vision_guard(name) if seeing else _head_guard(name))
                self._undo.append(hook.remove)

    def __contains__(self, name: object) -> bool:
        return name in self.encoders

    def __getitem__(self, name: str) -> StreamedEncoder:
        return self.encoders[name]

    def close(self) -> None:
        """Back to ordinary host modules (tests; a runner keeps its encoders streamed)."""
        for encoder in self.encoders.values():
            encoder.handle.disable()
        self.encoders.clear()
        while self._undo:
            self._undo.pop()()


def _head_guard(name: str) -> Callable[..., None]:
    def refuse(module: torch.nn.Module, args: object) -> None:
        raise RuntimeError(
            f"{name}'s output head stays in host memory while the encoder is streamed: "
            "pipelines read its hidden states only (Qwen-Image calls the model without it)")
    return refuse


def _vision_guard(name: str) -> Callable[..., None]:
    def refuse(module: torch.nn.Module, args: object) -> None:
        raise RuntimeError(
            f"{name}'s vision side stays in host memory while the encoder is streamed: this "
            "pipeline's prompts are text only (a pipeline whose encoder reads images declares "
            "prompt_reads_images or encoder_reads_images)")
    return refuse


def _described(handle: OffloadHandle, total_bytes: int, *, host_bytes: int,
               vision_bytes: int = 0) -> StreamedEncoder:
    report = handle.report()
    resident = int(report.get("resident_module_bytes", 0)) + int(
        report.get("resident_block_bytes", 0))
    slots = int(report.get("slots", 0))
    slot_bytes = slots * int(report.get("slot_bytes", 0))
    return StreamedEncoder(
        handle=handle, total_bytes=total_bytes, host_side_bytes=host_bytes,
        vision_bytes=vision_bytes, device_bytes=resident + slot_bytes,
        slot_bytes=slot_bytes if report.get("slots_released_between_passes") else 0,
        streamed_blocks=int(report.get("streamed_blocks", 0)), slots=slots)
