"""The ``Family`` record: everything the rest of the system knows about a model family.

A family is one diffusers pipeline layout, named by ``model_index.json``'s ``_class_name``.
Its record is pure data (no torch): the components a model directory must hold, its DiTs,
their streamed block lists and resident modules, the request fields that enter the batch
key, the server's defaults, the DiT shapes the model builders make - and *lazy references*
(``"module:attr"`` strings, resolved by ``resolve`` on first use) to its torch-side parts:
the step pipeline, the sequence-parallel hooks and the builders.

One record lives in each family module (``engine.families.flux``, ``qwen_image``, ``wan``, ...);
the registry (``engine.families``) lists them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ditserve.engine.families.defaults import ModelDefaults, square_image

# A diffusers pipeline directory's index: a DiffusionPipeline's, or - where diffusers ships a
# model as a modular pipeline only (MiniMax-H3) - a ModularPipeline's.
INDEX_FILES = ("model_index.json", "modular_model_index.json")


def index_file(root: Path) -> Path | None:
    """The index of the pipeline directory ``root`` (``INDEX_FILES``, in that order), else
    None. Its ``_class_name`` names the family; its component entries are ``[library,
    class]`` (a modular index adds the component's loading spec as a third item)."""
    for name in INDEX_FILES:
        if (root / name).is_file():
            return root / name
    return None


# variant -> size ("tiny" | "small" | "full") -> the DiT's keyword arguments
DitSizes = Mapping[str, Mapping[str, Mapping[str, Any]]]


@dataclass(frozen=True)
class ComponentShape:
    """One released component around the DiT - a text encoder, an image encoder, a VAE - as
    ``init-random --components all`` builds it (random weights, released shape).

    library: "transformers" or "diffusers"; model_class: the class in it; config_class: the
    transformers config class the model takes (None: a diffusers model, whose keyword
    arguments are ``config``); config: the released config.json's shape-defining values.
    """

    library: str
    model_class: str
    config: Mapping[str, Any]
    config_class: str | None = None


# variant -> component name -> its released shape
ReleasedComponents = Mapping[str, Mapping[str, ComponentShape]]
# (the DiT's config.json, the VAE's config.json, the diffusers pipeline's call defaults)
#   -> size, steps and frames of a full-size model
DefaultsRule = Callable[[Mapping[str, Any], Mapping[str, Any], Mapping[str, Any]],
                        ModelDefaults]
# the checkpoint's scheduler config -> the pipeline call defaults it changes
CallOverrides = Callable[[Mapping[str, Any]], Mapping[str, Any]]


# What a family generates, and when classifier-free guidance adds negative-prompt rows.
Output = Literal["image", "video"]
CfgRule = Literal["true_cfg", "guidance", "guidance_positive"]


@dataclass(frozen=True, kw_only=True)
class Family:
    """One pipeline layout.

    name: the CLI name (``--family``); label: the name the operator's ``model.family`` uses.
    pipeline_class / dit_class: the diffusers class names of the pipeline and its DiT (only
        the family's module spells them; everything else reads them from here).
    pipeline_module: the diffusers module that defines ``pipeline_class``: the server reads
        the pipeline's call defaults from its source (``engine.pipeline_defaults``), so a
        replica's HTTP side never imports diffusers; None: they come from the imported class.
    dit_components: DiT components every model of the family has; expert_components: DiTs
        some models add (Wan 2.2's low-noise expert ``transformer_2``), switched per step,
        used only when model_index.json sets ``expert_switch`` (Wan: ``boundary_ratio``).
    components: the other required components (text encoders, tokenizers, VAE, scheduler).
    self_loaded: components the step pipeline reads from the model directory itself; the
        loader passes None for them to diffusers (Qwen-Image-Edit's ``processor``, whose
        transformers class cannot be built on a machine without torchvision).
    load_options: keyword arguments the loader adds to the diffusers pipeline's
        ``from_pretrained`` (Cosmos3: its safety checker off, whose package ditserve does
        not install).
    block_lists: the DiT's repeated-block lists in the order its forward runs them (what DLO
        streams); resident_modules: the DiT's other top-level modules (on the device always).
    cfg_rows: when classifier-free guidance adds negative-prompt rows (``engine.sched.work``):
        "true_cfg" (``true_cfg_scale`` > 1 with a negative prompt) or "guidance"
        (``guidance_scale`` > 1) or "guidance_positive" (``guidance_scale`` > 0, Z-Image's
        rule); the pipeline's ``state.rows`` follows the same rule.
    attention_heads: the attention head counts of the family's released DiTs (sequence
        parallelism splits heads over its ranks; the operator judges a declared family's
        SP size with them before any model is read).
    activation_copies: the hidden states of a step's tokens its DiT holds at once at its peak
        (the HBM planner's denoise estimate, ``engine.placement.memory_estimates``): 20 for Flux
        and Qwen-Image (a Flux step at b1 1024x1024 measured 18.6); Wan's blocks run the
        engine's sliced token math, which measured 8.5 (docs/benchmarks.md, "Activation peak
        of a Wan block").
    reference_work: rows x latent tokens of one request at the family's usual size (Flux and
        Qwen-Image: a 1024x1024 image, 4096; Wan: 832x480 x 81 frames with CFG, 2 x 32760);
        the default per-step work budget is ``max_num_seqs`` such requests (``engine.sched.work``).
    loader_version: bump when the loader's tensors for the same files change (cache key).
    step_pipeline: ``"module:Class"`` of its ``StepPipeline`` (``engine.pipelines.registry``).
    sp_hooks: ``"module:function"`` that attaches sequence parallelism to one loaded DiT
        (``engine.parallel.sharding``); None: the family runs with SP size 1 only.
    builders: the module that builds its random-weight pipelines (``engine.makers.builders``
        calls its ``build_pipeline`` and ``build_tiny``).
    dit_sizes: per model variant the family builds (``ditserve model init-tiny --family``),
        the DiT's keyword arguments per size; the first variant is the family's own name.
    released_components: per model variant, the text encoders, image encoder and VAE at
        their released shapes (``init-random --components all``; one table per family, which
        the builders and the tests read).
    defaults: the size, steps and frames of a full-size model's requests
        (``engine.server.model_defaults``; guidance comes from the pipeline's call defaults).
    still_images: a video family whose one-frame video is a still image its pipeline makes as
        text-to-image (Cosmos3): its replicas serve /v1/images/generations too (one frame,
        written as a PNG), and ``generate`` writes an image for an image ``--out``; being made
        from the text alone, a one-frame request refuses an input image (every route).
    min_frames: the shortest clip a video family's pipeline generates (MiniMax-H3: 5 s at
        24 fps, 124 frames); a tiny model's default request asks for at least that many.
    call_overrides: what a checkpoint changes of the pipeline's call defaults, read off its
        scheduler config (Z-Image-Turbo: 8 steps without guidance, where the shared pipeline
        class defaults to Base's 50 steps with guidance); None: the call defaults stand.
    """

    name: str
    label: str
    pipeline_class: str
    dit_class: str
    dit_components: tuple[str, ...]
    components: tuple[str, ...]
    block_lists: tuple[str, ...]
    resident_modules: tuple[str, ...]
    output: Output
    loader_version: str
    step_pipeline: str
    builders: str
    sp_hooks: str | None = None
    expert_components: tuple[str, ...] = ()
    self_loaded: tuple[str, ...] = ()
    load_options: Mapping[str, Any] = field(default_factory=dict, compare=False)
    expert_switch: str | None = None
    cfg_rows: CfgRule = "true_cfg"
    attention_heads: tuple[int, ...] = ()
    reference_work: int = 4096
    activation_copies: int = 20
    dit_sizes: DitSizes = field(default_factory=dict, compare=False)
    released_components: ReleasedComponents = field(default_factory=dict, compare=False)
    defaults: DefaultsRule = field(default=square_image, compare=False)
    min_frames: int = 1
    still_images: bool = False
    call_overrides: CallOverrides | None = field(default=None, compare=False)
    pipeline_module: str | None = None

    @property
    def video(self) -> bool:
        return self.output == "video"

    @property
    def variants(self) -> tuple[str, ...]:
        return tuple(self.dit_sizes)


def dit_heads(config: Mapping[str, Any]) -> int | None:
    """A DiT ``config.json``'s attention head count: diffusers' usual
    ``num_attention_heads``, or ``n_heads`` (Z-Image's, Lumina's); None when neither."""
    value = config.get("num_attention_heads", config.get("n_heads"))
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def dit_width(config: Mapping[str, Any]) -> int | None:
    """A DiT ``config.json``'s hidden width: heads x ``attention_head_dim``, or ``dim``
    (Z-Image's, Lumina's), or ``hidden_size`` (Cosmos3's, a language model's naming); None
    when none."""
    heads, head_dim = config.get("num_attention_heads"), config.get("attention_head_dim")
    if isinstance(heads, int) and isinstance(head_dim, int):
        return heads * head_dim
    for key in ("dim", "hidden_size"):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def resolve(reference: str) -> Any:
    """The object a ``"module:attr"`` reference names (imports its module on first use)."""
    module, _, attr = reference.partition(":")
    target = importlib.import_module(module)
    return getattr(target, attr) if attr else target
