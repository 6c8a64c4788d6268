"""A DiT checkpoint file's node cache entry: what it holds, and a DiT served from its mapping.

A checkpoint file (``--model FILE --base-model DIR``: single-file, GGUF or FP8, issue 49) gets
its own entry, as a diffusers directory does: the DiT's final runtime tensors in the form the
engine runs them - GGUF blocks as the ``weight_q`` bytes of ``GGUFBlockLinear`` layers, FP8 as
the e4m3 weights and fp32 scales of ``FP8Linear`` layers, everything else in ``--dtype`` - in
the store's content-checked safetensors shards. Which layer has which form is the entry's
metadata (``FORMS_KEY``: ``{"transformer_blocks.0.attn.to_q": "gguf:Q8_0", ...}``), so an
engine whose recipe names the entry builds the DiT around the mapped bytes without reading
the file (``skeleton_dit``), exactly as ``runtime_cache`` does for a directory.

- ``load_checkpoint_state_dict`` / ``checkpoint_base_files`` / ``CHECKPOINT_LOADER_VERSION``:
  the build side, handed to the store by ``cachectl`` (``describe_loader(loader, this)``);
- ``checkpoint_cache_dit``: the engine side under ``--dlo-runtime-cache``: a recipe hit maps
  the entry (no load); a miss loads the file, builds or joins the entry (content-checked),
  repoints the DiT's tensors to the entry's mapping and releases the private copy.

Called by ``cachectl`` (build, ensure, the daemon) and ``weights.load`` (a checkpoint file
under offload with the runtime cache).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ditserve.engine.config import OffloadConfig
from ditserve.engine.errors import ModelLoadError
from ditserve.engine.offload.host.weight_plan import BackingKind, HostWeightPlan

log = logging.getLogger(__name__)

# Bump when the tensors or metadata built from the same file change (the cache keys on it,
# with this module's source digest).
CHECKPOINT_LOADER_VERSION = "checkpoint-1"
FORMS_KEY = "ditserve.layer_forms"
GGUF_FORM = "gguf:"  # + the GGUF type name: a GGUFBlockLinear
FP8_FORM = "fp8"  # an FP8Linear
DIT_COMPONENT = "transformer"


def checkpoint_base_files(base_dir: str | Path, component: str = DIT_COMPONENT) -> list[Path]:
    """The base model's files that shape a checkpoint's DiT: its pipeline index (the family)
    and the DiT's config (its structure); the file itself holds every tensor."""
    root = Path(base_dir)
    files = [root / "model_index.json", root / component / "config.json"]
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"{str(root)!r} is no base model for a checkpoint file: "
                                 f"{f.relative_to(root)} is missing")
    return files


def layer_forms(model: nn.Module) -> dict[str, str]:
    """Each quantized layer's form by module name (the entry's ``FORMS_KEY`` metadata)."""
    from ditserve.engine.formats.fp8_linear import FP8Linear
    from ditserve.engine.formats.gguf_linear import GGUFBlockLinear

    forms = {}
    for name, module in model.named_modules():
        if isinstance(module, GGUFBlockLinear):
            forms[name] = GGUF_FORM + module.quant.name
        elif isinstance(module, FP8Linear):
            forms[name] = FP8_FORM
        elif type(module).__name__ == "GGUFLinear":
            forms[name] = "gguf-linear"  # diffusers' own layer: skeleton_dit refuses it
    return forms


def entry_metadata(model: nn.Module) -> dict[str, str]:
    return {FORMS_KEY: json.dumps(layer_forms(model), sort_keys=True, separators=(",", ":"))}


def load_checkpoint_state_dict(
    checkpoint: str | Path, base_dir: str | Path, *, dtype: str, component: str = DIT_COMPONENT
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The checkpoint's DiT as the engine runs it: its final tensors (contiguous, on CPU) and
    the entry metadata naming each layer's form."""
    from ditserve.engine.weights.dit_file import load_dit_file

    model = load_dit_file(checkpoint, base_dir, dtype=dtype, component=component)
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    return tensors, entry_metadata(model)


def skeleton_dit(base_dir: str | Path, dtype: str, forms: Mapping[str, str],
                 stored: Mapping[str, tuple[str, tuple[int, ...]]],
                 component: str = DIT_COMPONENT) -> nn.Module:
    """The checkpoint's DiT on the meta device, its quantized layers as ``forms`` names them,
    shaped and typed as ``stored`` ({name: (safetensors dtype, shape)}, the entry's header)
    holds them; bound to the entry's views afterwards. Raises ValueError for a form it cannot
    build (the caller loads the file instead)."""
    from ditserve.engine.formats.fp8_linear import FP8Linear
    from ditserve.engine.formats.gguf_linear import GGUFBlockLinear
    from ditserve.engine.weights.checkpoint_mmap import meta_dit, torch_dtype_of
    from ditserve.engine.weights.dit_file import gguf_quant
    from ditserve.engine.weights.loader import dit_class, torch_dtype

    model_cls = dit_class(base_dir, component)
    compute = torch_dtype(dtype)
    model = meta_dit(model_cls, model_cls.load_config(str(base_dir), subfolder=component),
                     compute)

    def meta(name: str) -> torch.Tensor:
        st, shape = stored[name]
        return torch.empty(shape, dtype=torch_dtype_of(st), device="meta")

    for name, form in forms.items():
        old = model.get_submodule(name)
        if not isinstance(old, nn.Linear):
            raise ValueError(f"{name} is a {type(old).__name__} in the base DiT, not a linear")
        bias = (nn.Parameter(meta(f"{name}.bias"), requires_grad=False)
                if f"{name}.bias" in stored else None)
        layer: nn.Module
        if form.startswith(GGUF_FORM):
            from gguf import GGMLQuantizationType

            try:
                qtype = GGMLQuantizationType[form[len(GGUF_FORM):]]
            except KeyError as e:
                raise ValueError(f"{name}: unknown GGUF type in form {form!r}") from e
            layer = GGUFBlockLinear(old.in_features, old.out_features,
                                    weight_q=meta(f"{name}.weight_q"), quant=gguf_quant(qtype),
                                    bias=bias, compute_dtype=compute)
        elif form == FP8_FORM:
            layer = FP8Linear(old.in_features, old.out_features, bias=bias,
                              device=torch.device("meta"))
        else:
            raise ValueError(f"{name}: layer form {form!r} is not built from an entry")
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    # Tensors outside the quantized layers as the entry holds them (GGUF files keep some in
    # their stored float type); meta tensors: nothing moves.
    for full, tensor in list(model.state_dict(keep_vars=True).items()):
        if full in stored and tensor.is_floating_point():
            tensor.data = tensor.data.to(torch_dtype_of(stored[full][0]))
    return model


def _forms_of(entry: Any) -> dict[str, str]:
    raw = entry.manifest.metadata.get(FORMS_KEY)
    if raw is None:
        raise ValueError(f"entry {entry.key[:12]} has no {FORMS_KEY} metadata")
    forms = json.loads(raw)
    if not isinstance(forms, dict):
        raise ValueError(f"entry {entry.key[:12]}: {FORMS_KEY} is not a JSON object")
    return {str(k): str(v) for k, v in forms.items()}


def checkpoint_cache_dit(
    checkpoint: str | Path, base_dir: str | Path, *, dtype: str, offload: OffloadConfig,
    sp_size: int = 1,
) -> tuple[nn.Module, HostWeightPlan]:
    """The checkpoint's DiT backed by its node cache entry (see the module docstring).
    Raises ``CacheError`` / ``OSError`` when the cache cannot be used: the caller loads the
    file into private memory instead."""
    import sys

    from ditserve.cachectl.identity import Placement
    from ditserve.cachectl.layout import default_root
    from ditserve.cachectl.model_build import ModelRequest, describe_loader, plan_model
    from ditserve.cachectl.store import CacheStore
    from ditserve.engine.config import SEQUENCE_PARALLEL_IMPL
    from ditserve.engine.weights import loader
    from ditserve.engine.weights.dit_file import load_dit_file
    from ditserve.engine.weights.runtime_cache import load_then_join

    store = CacheStore(offload.cache_root or default_root(),
                       lock_timeout_s=offload.cache_lock_timeout_s)
    placement = Placement(sp_size=sp_size,
                          sp_impl=SEQUENCE_PARALLEL_IMPL if sp_size > 1 else None)
    model_plan = plan_model(
        ModelRequest(Path(base_dir), dtype=dtype, placement=placement,
                     checkpoint=Path(checkpoint)),
        describe_loader(loader, sys.modules[__name__]))
    key = store.resolve_recipe(model_plan.recipe)
    note = ""
    if key is not None:
        hit, note = _join_hit(store, key, base_dir, dtype)
        if hit is not None:
            return hit
    model = load_dit_file(checkpoint, base_dir, dtype=dtype)
    return load_then_join(store, model_plan, model, note=note,
                          metadata=entry_metadata(model))


def _join_hit(store: Any, key: str, base_dir: str | Path, dtype: str
              ) -> tuple[tuple[nn.Module, HostWeightPlan] | None, str]:
    """The DiT as views of the entry the recipe names, without reading the file; else None
    and a note on why the entry was not used."""
    from ditserve.cachectl.errors import EntryNotFoundError
    from ditserve.engine.weights.checkpoint_mmap import (
        bind_views,
        expected_tensors,
        preflight,
        source_views,
    )
    from ditserve.engine.weights.runtime_cache import close_all, map_entry

    try:
        entry = store.join(key)
    except EntryNotFoundError:
        return None, ""
    files = map_entry(entry)
    try:
        stored = {name: (t.dtype, tuple(t.shape)) for f in files
                  for name, t in f.tensors.items()}
        model = skeleton_dit(base_dir, dtype, _forms_of(entry), stored)
        checked = preflight(expected_tensors(model), files)
        if not checked.ok:
            raise ValueError(checked.reason)
    except (ValueError, KeyError, AttributeError, ModelLoadError) as e:
        close_all(files)
        entry.close()
        log.warning("runtime cache: checkpoint entry %s refused: %s", key[:12], e)
        return None, f" (the recipe's entry {key[:12]} did not fit: {e})"
    views = source_views(checked.bindings, files)
    bind_views(model, views)
    return (model, HostWeightPlan(
        BackingKind.RUNTIME_CACHE,
        reason=f"cache hit: checkpoint entry {key[:12]} mapped, file load skipped (recipe)",
        bindings=checked.bindings, sources=views, mappings=files, coverage=checked.coverage,
        skipped_materialization=True, lease=entry,
    )), ""
