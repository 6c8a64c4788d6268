"""AdapterBank: the model runner's resident LoRA adapters and the hooks that apply them.

Created by the ``ModelRunner`` over its DiT. ``acquire(refs)`` (a request is added) makes
every adapter the request names resident - read from its file (``files``), cast to the
DiT's compute dtype, placed on the device and attached to the hooks of the linear layers it
adapts (``linear``) - and pins it while the request runs; ``release(refs)`` (the request
leaves) unpins it. At most ``max_loras`` adapters are resident: the least recently used idle
one is dropped before another loads (pinned ones never are: the scheduler admits no step
whose requests name more than ``max_loras`` adapters, ``admission``). ``fuse(ref)`` merges
one adapter into the DiT's weights instead, for a replica serving a single adapter
(``--lora-fuse``); it must run before quantization and offload read the weights.

Adapters are keyed by ``LoraRef.key`` (name, load generation), so a name re-loaded from
another file is another adapter. Not thread-safe: the runner calls it from its step loop.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ditserve.engine.adapters.files import AdapterWeights, LoraFactors, read_adapter
from ditserve.engine.adapters.linear import AdaptedLinear
from ditserve.engine.adapters.rows import AdapterKey
from ditserve.engine.config.adapters import AdapterConfig
from ditserve.engine.errors import AdapterError
from ditserve.engine.request import LoraRef

log = logging.getLogger(__name__)


class AdapterBank:
    """Resident adapters of one DiT (see module docstring)."""

    def __init__(
        self,
        transformer: nn.Module,
        *,
        pipeline_class: Any,
        device: torch.device,
        dtype: torch.dtype,
        max_loras: int,
        max_rank: int,
        components: tuple[str, ...] = (),
    ) -> None:
        """components: the DiT component names when ``transformer`` stacks several
        (Wan 2.2's experts, as submodules of those names); empty for a single DiT."""
        self.transformer = transformer
        self.pipeline_class = pipeline_class
        self.device = device
        self.dtype = dtype
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.components = components
        self._resident: OrderedDict[AdapterKey, AdapterWeights] = OrderedDict()
        self._pins: Counter[AdapterKey] = Counter()
        self._layers: dict[str, AdaptedLinear] = {}
        self.loads = 0
        self.peak_resident = 0  # the most adapters ever resident at once
        self.fused: LoraRef | None = None

    # -- what is resident -----------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Device bytes of the resident adapters' factors."""
        return sum(w.nbytes for w in self._resident.values())

    @property
    def resident(self) -> list[str]:
        return [name for name, _ in self._resident]

    # -- requests -------------------------------------------------------------------------
    def acquire(self, refs: Iterable[LoraRef]) -> None:
        """Make ``refs`` resident and pin them; on an error nothing stays pinned."""
        taken: list[LoraRef] = []
        try:
            for ref in refs:
                self._ensure(ref)
                self._pins[ref.key] += 1
                taken.append(ref)
        except BaseException:
            self.release(taken)
            raise
        self._evict()

    def release(self, refs: Iterable[LoraRef]) -> None:
        for ref in refs:
            if self._pins[ref.key] > 0:
                self._pins[ref.key] -= 1
            if self._pins[ref.key] <= 0:
                del self._pins[ref.key]
        self._evict()

    def _ensure(self, ref: LoraRef) -> None:
        if ref.key in self._resident:
            self._resident.move_to_end(ref.key)
            return
        self._evict(room_for=1)  # before the load: never more than max_loras on the device
        weights = self._placed(read_adapter(ref.path, self.pipeline_class,
                                            max_rank=self.max_rank))
        targets = [(self._layer(component, module), factors)
                   for (component, module), factors in weights.layers.items()]
        for layer, factors in targets:  # check every shape before attaching any
            layer.check(factors)
        for layer, factors in targets:
            layer.add(ref.key, factors)
        self._resident[ref.key] = weights
        self.loads += 1
        self.peak_resident = max(self.peak_resident, len(self._resident))
        log.info("adapter %s (rank %d, %d layers, %.1f MiB) resident; %d resident, %.1f MiB",
                 ref.name, weights.rank, len(weights.layers), weights.nbytes / 2**20,
                 len(self._resident), self.nbytes / 2**20)

    def _evict(self, room_for: int = 0) -> None:
        """Drop least recently used idle adapters until ``room_for`` more fit the bound."""
        idle = [key for key in self._resident if self._pins[key] <= 0]
        while len(self._resident) + room_for > self.max_loras and idle:
            key = idle.pop(0)  # least recently used first (OrderedDict order)
            weights = self._resident.pop(key)
            for component, module in weights.layers:
                self._layers[self._path(component, module)].remove(key)
            log.info("adapter %s evicted (--max-loras %d)", key[0], self.max_loras)

    # -- layers ---------------------------------------------------------------------------
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """Every layer an adapter may target, as ``"<component>.<module>"`` -> (in, out):
        the table the catalog checks a runtime load against (``files.check_fits``)."""
        shapes = {}
        for path, module in self.transformer.named_modules():
            layer: Any = module
            if not path or not hasattr(layer, "in_features") or not hasattr(
                    layer, "out_features"):
                continue
            name = path if self.components else f"transformer.{path}"
            if self.components and name.split(".", 1)[0] not in self.components:
                continue
            shapes[name] = (int(layer.in_features), int(layer.out_features))
        return shapes

    def _path(self, component: str, module: str) -> str:
        if not self.components:
            if component != "transformer":
                raise AdapterError(f"the adapter targets {component}, which this model does "
                                   "not have")
            return module
        if component not in self.components:
            raise AdapterError(f"the adapter targets {component}; this model's DiTs are "
                               f"{', '.join(self.components)}")
        return f"{component}.{module}"

    def _layer(self, component: str, module: str) -> AdaptedLinear:
        path = self._path(component, module)
        layer = self._layers.get(path)
        if layer is None:
            try:
                target = self.transformer.get_submodule(path)
            except AttributeError as e:
                raise AdapterError(f"the adapter targets {component}.{module}, which the "
                                   "model does not have: it was trained for another "
                                   "model") from e
            if not hasattr(target, "in_features") or not hasattr(target, "out_features"):
                raise AdapterError(f"the adapter targets {component}.{module}, a "
                                   f"{type(target).__name__}; only linear layers are adapted")
            layer = self._layers[path] = AdaptedLinear(f"{component}.{module}", target)
        return layer

    def _placed(self, weights: AdapterWeights) -> AdapterWeights:
        """The factors on the device, in the compute dtype (bf16 beside FP8 layers)."""
        layers = {
            key: LoraFactors(down=f.down.to(self.device, self.dtype),
                             up=f.up.to(self.device, self.dtype), scaling=f.scaling)
            for key, f in weights.layers.items()}
        return AdapterWeights(path=weights.path, layers=layers)

    # -- fused ----------------------------------------------------------------------------
    @torch.no_grad()
    def fuse(self, ref: LoraRef) -> None:
        """Merge ``ref`` at its scale into the linear layers' weights (``--lora-fuse``)."""
        weights = read_adapter(ref.path, self.pipeline_class, max_rank=self.max_rank)
        for (component, module), factors in weights.layers.items():
            layer = self._layer(component, module)
            layer.check(factors)
            weight = getattr(layer.module, "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
                raise AdapterError(f"{component}.{module} has no plain weight to fuse into")
            delta = (factors.up @ factors.down) * (factors.scaling * float(ref.scale))
            weight.add_(delta.to(weight.device, weight.dtype))
        self.fused = ref
        log.info("adapter %s (rank %d) fused into %d linear layers at scale %g", ref.name,
                 weights.rank, len(weights.layers), ref.scale)


def open_bank(pipeline: Any, components: Any, config: Any, *, device: torch.device
              ) -> AdapterBank:
    """The runner's bank over ``pipeline``'s DiT(s) for ``config`` (an AdapterConfig); with
    ``fuse``, its one adapter merged into the weights now. Called before quantization and
    offload (a fused adapter changes the weights they read); ``preload`` after them (the
    hooks must sit on the linears that run: quantization replaces them)."""

    stacked = tuple(components.dit_components) if len(components.dit_components) > 1 else ()
    bank = AdapterBank(pipeline.transformer, pipeline_class=type(components.pipeline),
                       device=device, dtype=pipeline.dtype, max_loras=config.max_loras,
                       max_rank=config.max_lora_rank, components=stacked)
    if config.fuse:
        bank.fuse(startup_refs(config)[0])
    return bank


def preload(bank: AdapterBank, config: Any) -> None:
    """The ``lora_modules`` made resident up to ``max_loras`` (the start log shows their
    bytes); nothing under ``fuse``."""

    refs = startup_refs(config)
    if config.fuse or not refs:
        return
    for ref in refs[: config.max_loras]:
        bank.acquire([ref])
        bank.release([ref])
    log.info("%d LoRA adapters resident at start (%.1f MiB; --max-loras %d)",
             len(bank.resident), bank.nbytes / 2**20, config.max_loras)


def startup_refs(config: AdapterConfig) -> list[LoraRef]:
    """``lora_modules`` as LoraRefs at scale 1, load generations 0..n-1 in their order: the
    engine's catalog and every runner number them alike."""
    return [LoraRef(name=name, path=path, version=index)
            for index, (name, path) in enumerate(config.lora_modules.items())]
