"""Engine options shared by `ditserve generate`, `serve` and `demo`: flags -> EngineConfig.

Flags default to None so that only options given on the command line override a ``--config``
YAML file (whose keys follow ``EngineConfig.to_mapping()``). The resulting mapping goes through
``EngineConfig.from_mapping``, the same validation the operator uses.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection
from pathlib import Path
from typing import Any

from ditserve.engine.config import (
    COMPILE_BACKENDS,
    COMPRESS_MODES,
    DEQUANT_MODES,
    DLO_COMPONENTS,
    DTYPES,
    GATHER_ENGINES,
    HBM_BUDGET_AUTO,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    VAE_TILING_MODES,
    EngineConfig,
)
from ditserve.engine.config.adapters import modules_mapping, parse_lora_module
from ditserve.engine.config.checkpoint_dtype import AUTO_DTYPE, checkpoint_dtype
from ditserve.engine.config.step_cache import POLICIES as STEP_CACHE_POLICIES
from ditserve.engine.config.types import option_sections
from ditserve.engine.config.unknown_keys import Section, reject_unknown_sections
from ditserve.engine.errors import ConfigError

# (flag dest) -> (section or None, key in EngineConfig.to_mapping())
_FLAG_TARGETS: dict[str, tuple[str | None, str]] = {
    "model": (None, "model"),
    "base_model": (None, "base_model"),
    "dtype": (None, "dtype"),
    "device": (None, "device"),
    "compile": (None, "compile"),
    "quantization": (None, "quantization"),
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "max_batch_tokens": ("scheduler", "max_batch_tokens"),
    "max_request_tokens": ("scheduler", "max_request_tokens"),
    "max_bypass": ("scheduler", "max_bypass"),
    "max_queue": ("scheduler", "max_queue"),
    "scheduling_policy": ("scheduler", "scheduling_policy"),
    "priority_aging_s": ("scheduler", "aging_s"),
    "max_preemptions": ("scheduler", "max_preemptions"),
    "urgent_companions": ("scheduler", "urgent_companions"),
    "plan_at": ("scheduler", "plan_at"),
    "offload": ("offload", "enabled"),  # --offload dlo|none, read as a bool (_offload_mode)
    "dlo_slots": ("offload", "slots"),
    "dlo_resident_layers": ("offload", "resident_layers"),
    "dlo_hbm_budget_gib": ("offload", "hbm_budget_gib"),
    "dlo_use_allgather": ("offload", "use_allgather"),
    "dlo_gather": ("offload", "gather"),
    "dlo_runtime_cache": ("offload", "runtime_cache"),
    "cache_root": ("offload", "cache_root"),
    "dlo_pin_limit_gib": ("offload", "pin_limit_gib"),
    "dlo_checkpoint_mmap": ("offload", "checkpoint_mmap"),
    "dlo_compress": ("offload", "compress"),
    "dlo_dequant": ("offload", "dequant"),
    "dlo_components": ("offload", "components"),
    "prompt_cache_size": ("pipeline", "prompt_cache_size"),
    "prompt_cache_gib": ("pipeline", "prompt_cache_gib"),
    "vae_tiling": ("pipeline", "vae_tiling"),
    "data_parallel_size": ("parallel", "data_parallel_size"),
    "sequence_parallel_size": ("parallel", "sequence_parallel_size"),
    "max_loras": ("adapters", "max_loras"),
    "max_lora_rank": ("adapters", "max_lora_rank"),
    "lora_fuse": ("adapters", "fuse"),
    "step_cache": ("step_cache", "policy"),
    "step_cache_threshold": ("step_cache", "threshold"),
    "step_cache_every": ("step_cache", "every"),
}


def add_engine_options(parser: argparse.ArgumentParser, *, with_config_file: bool = True) -> None:
    """The engine flags shared by generate, demo, serve and worker, one group per concept."""
    g = parser.add_argument_group("engine")
    if with_config_file:
        g.add_argument("--config", type=Path, default=None,
                       help="YAML file with engine options; command-line flags override it")
    g.add_argument("--model", default=None,
                   help="local diffusers pipeline directory (default: the embedded tiny "
                        "model), or a DiT checkpoint file: single-file safetensors (BFL/ComfyUI "
                        "or diffusers names), GGUF, or FP8 safetensors (with --base-model; "
                        "docs/formats.md)")
    g.add_argument("--base-model", default=None,
                   help="with --model FILE: the diffusers directory of the same family that "
                        "gives the DiT's config and every other component (text encoders, VAE)")
    g.add_argument("--dtype", choices=(AUTO_DTYPE, *DTYPES), default=None,
                   help="runtime dtype (default auto: the dtype the DiT's weights are stored "
                        "in, bfloat16 for a bf16 release; as `cachectl build` defaults)")
    g.add_argument("--device", default=None, help="auto (default), cpu, cuda or cuda:N")
    g.add_argument("--compile", nargs="?", const="inductor", default=None,
                   choices=COMPILE_BACKENDS, metavar="BACKEND",
                   help="torch.compile the DiT's repeated blocks (backend: inductor when "
                        "omitted; aot_eager or eager only trace); the warm-up compiles at the "
                        "default size before the engine is ready")
    g.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="fp8: the DiT blocks' linear layers in FP8 e4m3 with rowwise scales "
                        "(torch._scaled_mm on CUDA sm89+, an emulation elsewhere); norms, "
                        "embedders and the final projection stay in --dtype")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="the most requests in one denoise step, of any shapes (default 4)")
    g.add_argument("--max-batch-tokens", type=int, default=None,
                   help="work budget of one step: rows x latent tokens over its requests "
                        "(default: --max-num-seqs requests of the family's usual size - 16384 "
                        "for Flux/Qwen-Image, 262080 for Wan; a larger request runs alone)")
    g.add_argument("--max-request-tokens", type=int, default=None,
                   help="the most work one request may bring to a step, rows x latent tokens "
                        "(default: 4 x --max-batch-tokens); a larger one is refused with a 400, "
                        "since a step cannot be cut short when its client leaves")
    g.add_argument("--max-bypass", type=int, default=None,
                   help="how often requests that fit a step may overtake an older one that "
                        "does not (default 8; 0: strict arrival order)")
    g.add_argument("--max-queue", type=int, default=None,
                   help="waiting requests beyond which new ones are refused (default 64)")
    g.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default=None,
                   help="fcfs (default): arrival order, requests' priority ignored; priority: "
                        "admit by (priority, deadline, arrival) and pause lower-priority "
                        "running requests at a step boundary to make room")
    g.add_argument("--priority-aging-s", type=float, default=None,
                   help="under --scheduling-policy priority, each this many seconds waited "
                        "count one priority level sooner, so low priority never starves "
                        "(default 30)")
    g.add_argument("--max-preemptions", type=int, default=None,
                   help="the most times one request may be paused for higher-priority ones "
                        "(default 2)")
    g.add_argument("--urgent-companions", type=int, default=None,
                   help="with --scheduling-policy priority: the most rows of other requests "
                        "a step holds beside an urgent one (priority below 0); companions "
                        "beyond it are paused (default: unbounded)")
    g.add_argument("--plan-at", type=float, default=None, metavar="FRACTION",
                   help="plan the next step once the running one is this far through its "
                        "DiT blocks on the GPU (default 0: as soon as it starts); 0.8 lets a "
                        "request arriving in the first 80%% of a step join the next one "
                        "(CUDA; the host must plan a step within the last 20%%)")
    _add_offload_options(parser)
    _add_pipeline_options(parser)
    _add_lora_options(parser)
    _add_step_cache_options(parser)
    _add_parallel_options(parser)


def _offload_mode(text: str) -> bool:
    """``--offload``'s value as ``offload.enabled``."""
    if text not in ("none", "dlo"):
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from 'none', 'dlo')")
    return text == "dlo"


def _add_offload_options(parser: argparse.ArgumentParser) -> None:
    """Layerwise offload of the DiT blocks and their host backing."""
    o = parser.add_argument_group("layerwise offload (DLO)")
    o.add_argument("--offload", type=_offload_mode, metavar="{none,dlo}", default=None,
                   help="dlo: stream DiT blocks from host memory through device slots")
    o.add_argument("--dlo-slots", type=int, default=None,
                   help="device slots blocks stream through (default 2, or 8 with AllGather; "
                        "more let copies run ahead of compute, one largest block of HBM each)")
    o.add_argument("--dlo-resident-layers", type=int, default=None,
                   help="leading DiT blocks kept on the device")
    o.add_argument("--dlo-hbm-budget-gib", type=_hbm_budget, default=None, metavar="GIB|auto",
                   help="HBM for the whole pipeline (DiT, encoders, VAE, activations, "
                        "slack); auto: the device's free HBM. Blocks stay resident while "
                        "they fit; refused at start below the smallest budget that fits")
    o.add_argument("--dlo-no-use-allgather", dest="dlo_use_allgather", action="store_const",
                   const=False, default=None,
                   help="with DP/SP > 1: keep full rank-local blocks instead of 1/group shards")
    o.add_argument("--dlo-gather", choices=GATHER_ENGINES, default=None,
                   help="AllGather: rebuild blocks with NCCL all_gather kernels (default) or "
                        "copy-engine peer-to-peer copies that take no SMs from compute")
    o.add_argument("--dlo-runtime-cache", action="store_const", const=True, default=None,
                   help="use the node cache (cachectl) entry as the host backing")
    o.add_argument("--cache-root", default=None,
                   help="node cache root (default $DITSERVE_CACHE_ROOT or /var/cache/ditserve)")
    o.add_argument("--dlo-pin-limit-gib", type=float, default=None,
                   help="host-registration budget for mmap backings (0: staging copies, or "
                        "under auto an automatic budget for a checkpoint on tmpfs)")
    o.add_argument("--dlo-checkpoint-mmap", choices=("auto", "off"), default=None,
                   help="auto: stream straight from the checkpoint's safetensors when that "
                        "is the backing that fits host memory (a checkpoint on tmpfs is "
                        "mapped and registered, never copied); off: a private pinned copy. "
                        "A load that cannot fit host memory is refused at start "
                        "(DITSERVE_HOST_MEMORY_CHECK=warn|off to load anyway)")
    o.add_argument("--dlo-compress", choices=COMPRESS_MODES, default=None,
                   help="lossless: keep streamed blocks' bf16 bytes packed (0.75x, bit-exact) "
                        "in host memory and decode them on the device after each copy")
    o.add_argument("--dlo-dequant", choices=DEQUANT_MODES, default=None,
                   help="GGUF DiT under DLO: compute (default) dequantizes each layer at each "
                        "call; slot dequantizes each streamed block into a bf16 slot region "
                        "on the decode stream after its copy (bit-identical; larger slots)")
    o.add_argument("--dlo-components", choices=DLO_COMPONENTS, default=None,
                   help="all (default): DLO also parks the text encoders in pinned host "
                        "memory, on the device only while they encode; dit: stream the DiT "
                        "only and keep the encoders resident")


def _hbm_budget(text: str) -> float | str:
    if text == HBM_BUDGET_AUTO:
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of GiB or {HBM_BUDGET_AUTO!r}, got {text!r}") from None


def _add_pipeline_options(parser: argparse.ArgumentParser) -> None:
    """The rest of the pipeline: prompt-embedding cache, VAE decode."""
    w = parser.add_argument_group("whole pipeline (encoders, VAE)")
    w.add_argument("--prompt-cache-size", type=int, default=None,
                   help="prompt embeddings kept (LRU), so repeated prompts and the empty "
                        "negative prompt are encoded once (default 256; 0 disables)")
    w.add_argument("--prompt-cache-gib", type=float, default=None,
                   help="the most device memory cached prompt embeddings take (default 1)")
    w.add_argument("--vae-tiling", choices=VAE_TILING_MODES, default=None,
                   help="decode in tiles (diffusers' VAE tiling and slicing): auto (default) "
                        "tiles under --offload dlo when a frame is >= 1024x1024 (images) or "
                        "above 480p (video); on; off")


def _add_lora_options(parser: argparse.ArgumentParser) -> None:
    """Per-request LoRA adapters."""
    a = parser.add_argument_group("LoRA adapters (docs/lora.md)")
    a.add_argument("--lora-modules", nargs="+", action="extend", default=None,
                   metavar="NAME=PATH",
                   help="adapters to serve: a .safetensors file (diffusers/PEFT or kohya "
                        "keys) or a directory holding one; requests select them by name "
                        "(model: NAME, or loras: [{name, scale}])")
    a.add_argument("--max-loras", type=int, default=None,
                   help="adapters resident on the device at once (default 8); others load "
                        "on demand, the least recently used idle one is dropped")
    a.add_argument("--max-lora-rank", type=int, default=None,
                   help="the largest adapter rank accepted (default 256)")
    a.add_argument("--lora-fuse", action="store_const", const=True, default=None,
                   help="merge the one --lora-modules adapter into the weights (a replica "
                        "serving that adapter only: no per-step cost)")


def _add_step_cache_options(parser: argparse.ArgumentParser) -> None:
    """Reuse of the DiT residual across denoising steps."""
    c = parser.add_argument_group("step cache (docs/step_cache.md)")
    c.add_argument("--step-cache", choices=STEP_CACHE_POLICIES, default=None,
                   help="reuse the DiT's residual across denoising steps by default (off when "
                        "omitted; a request's step_cache overrides it): first-block (skip the "
                        "other blocks while the first block's output barely changes), "
                        "teacache (Flux, Wan2.1: the published TeaCache rescaling), every "
                        "(compute one step in K between the first and last 2)")
    c.add_argument("--step-cache-threshold", type=float, default=None,
                   help="first-block / teacache threshold (default 0.08 for first-block; "
                        "teacache: 0.4 Flux, 0.2 Wan); 0 never reuses (bit-identical to off)")
    c.add_argument("--step-cache-every", type=int, default=None,
                   help="the every policy's K (default 2); 1 never reuses")


def _add_parallel_options(parser: argparse.ArgumentParser) -> None:
    """Processes per replica: data and sequence parallelism."""
    p = parser.add_argument_group("parallelism")
    p.add_argument("--data-parallel-size", type=int, default=None,
                   help="data-parallel ranks, each with its own batch (processes: dp x sp, "
                        "one per device)")
    p.add_argument("--sequence-parallel-size", type=int, default=None,
                   help="processes per data-parallel rank that split every forward's tokens "
                        "(Ulysses attention; must divide the DiT's head count); with dp 1 "
                        "DLO AllGather shards over them")


def load_config_file(path: Path) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(path)!r}: {e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    return data


def engine_config_from_args(
    args: argparse.Namespace, base: dict[str, Any] | None = None
) -> EngineConfig:
    """Merge ``base`` (e.g. a YAML file's engine keys) with the flags given; validate."""
    merged: dict[str, Any] = {k: (dict(v) if isinstance(v, dict) else v)
                              for k, v in (base or {}).items()}
    for dest, (section, key) in _FLAG_TARGETS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        target = merged.setdefault(section, {}) if section else merged
        target[key] = value
    modules = getattr(args, "lora_modules", None)
    if modules:
        pairs = [parse_lora_module(text) for text in modules]
        merged.setdefault("adapters", {})["lora_modules"] = modules_mapping(pairs)
    _split_checkpoint(merged)
    if merged.get("dtype", AUTO_DTYPE) == AUTO_DTYPE:
        # Serve in the dtype the checkpoint is stored in (what `cachectl build` defaults to).
        model = merged.get("model")
        merged["dtype"] = checkpoint_dtype(model if isinstance(model, str) else None)
    return EngineConfig.from_mapping(merged)


def _split_checkpoint(merged: dict[str, Any]) -> None:
    """``model: FILE`` (+ ``base_model: DIR``) -> ``model: DIR, checkpoint: FILE`` (the
    config's form: ``model`` is always a directory)."""
    base = merged.pop("base_model", None)
    model = merged.get("model")
    if isinstance(model, str) and Path(model).is_file():  # a file, not a diffusers folder
        if base is None:
            raise ConfigError(
                f"--model {model!r} is a checkpoint file: pass --base-model DIR, a diffusers "
                "directory of the same family, for the DiT's config and the other components")
        if not Path(base).is_dir():  # named here: the "model directory" check blames --model
            raise ConfigError(f"--base-model {base!r} is not a directory: pass the diffusers "
                              f"directory of {model!r}'s family (the one holding "
                              "model_index.json)")
        merged["checkpoint"], merged["model"] = model, base
    elif base is not None:
        raise ConfigError("--base-model goes with --model FILE (a checkpoint file); "
                          f"--model {model!r} is not a file")


def engine_config_and_server_section(
    args: argparse.Namespace, server_options: Collection[str] | None = None,
) -> tuple[EngineConfig, dict[str, Any]]:
    """The EngineConfig from ``--config`` (if given) and the flags, and the file's ``server:``
    section (the HTTP layer's own options; empty without a file). With ``server_options``
    (the server's keys) an unknown key anywhere in the file is named in one error with the
    others, so every typo is reported at once."""
    data: dict[str, Any] = {}
    if getattr(args, "config", None) is not None:
        data = load_config_file(args.config)
    server_section = data.pop("server", None) or {}
    # ``base_model`` is the file's spelling of --base-model: it becomes ``model`` below.
    (top, known, _), *nested = option_sections(data)
    sections: list[Section] = [(top, {*known, "base_model"}, ""), *nested]
    if server_options is not None:
        sections.append((server_section, server_options, "server"))
    reject_unknown_sections(sections)
    return engine_config_from_args(args, base=data), server_section
