"""The model families ditserve serves, as pure metadata (no torch).

A family is one diffusers pipeline layout, named by ``model_index.json``'s ``_class_name``.
Its ``Family`` record declares everything the rest of the system needs to know without
loading anything: the components a model directory must hold, which of them are DiTs (the
modules offload streams), the DiT's streamed block lists in call order and its resident
modules, the request fields that enter the batch key, whether it makes images or videos, and
the loader version that enters the node cache identity.

Read by the option rules (``engine.config``: which ``model.family`` values the operator
accepts), the loader (layout checks, DiT components), offload discovery (declared block
lists), the model builders and the torch-side pipeline registry
(``engine.pipelines.registry``), which a test keeps in step with this table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One pipeline layout.

    name: the CLI name (``--family``); label: the name the operator's ``model.family`` uses.
    dit_components: DiT components every model of the family has; expert_components: DiTs
        some models add (Wan 2.2's low-noise expert ``transformer_2``), switched per step,
        used only when model_index.json sets ``expert_switch`` (Wan: ``boundary_ratio``).
    components: the other required components (text encoders, tokenizers, VAE, scheduler).
    block_lists: the DiT's repeated-block lists in the order its forward runs them (what DLO
        streams); resident_modules: the DiT's other top-level modules (on the device always).
    batch_key_fields: ``SamplingParams`` fields that change the denoise tensor contract.
    cfg_rows: when classifier-free guidance adds negative-prompt rows (``engine.work``):
        "true_cfg" (``true_cfg_scale`` > 1 with a negative prompt) or "guidance"
        (``guidance_scale`` > 1); the pipeline's ``state.rows`` follows the same rule.
    attention_heads: the attention head counts of the family's released DiTs (sequence
        parallelism splits heads over its ranks; the operator judges a declared family's
        SP size with them before any model is read).
    reference_work: rows x latent tokens of one request at the family's usual size (Flux and
        Qwen-Image: a 1024x1024 image, 4096; Wan: 832x480 x 81 frames with CFG, 2 x 32760);
        the default per-step work budget is ``max_num_seqs`` such requests (``engine.work``).
    loader_version: bump when the loader's tensors for the same files change (cache key).
    """

    name: str
    label: str
    pipeline_class: str
    dit_class: str
    dit_components: tuple[str, ...]
    components: tuple[str, ...]
    block_lists: tuple[str, ...]
    resident_modules: tuple[str, ...]
    batch_key_fields: tuple[str, ...]
    output: str  # "image" | "video"
    loader_version: str
    expert_components: tuple[str, ...] = ()
    expert_switch: str | None = None
    cfg_rows: str = "true_cfg"
    attention_heads: tuple[int, ...] = ()
    reference_work: int = 4096

    @property
    def video(self) -> bool:
        return self.output == "video"


FLUX = Family(
    name="flux", label="Flux", pipeline_class="FluxPipeline",
    dit_class="FluxTransformer2DModel", dit_components=("transformer",),
    components=("vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2",
                "scheduler"),
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    resident_modules=("pos_embed", "time_text_embed", "context_embedder", "x_embedder",
                      "norm_out", "proj_out"),
    batch_key_fields=("height", "width", "max_sequence_length"), output="image",
    loader_version="flux-loader-1",
    attention_heads=(24,),  # FLUX.1-dev / schnell
)
QWEN_IMAGE = Family(
    name="qwen-image", label="QwenImage", pipeline_class="QwenImagePipeline",
    dit_class="QwenImageTransformer2DModel", dit_components=("transformer",),
    components=("vae", "text_encoder", "tokenizer", "scheduler"),
    block_lists=("transformer_blocks",),
    resident_modules=("pos_embed", "time_text_embed", "txt_norm", "img_in", "txt_in",
                      "norm_out", "proj_out"),
    batch_key_fields=("height", "width", "max_sequence_length"), output="image",
    loader_version="qwen-image-loader-1",
    attention_heads=(24,),  # Qwen-Image 20B
)
WAN = Family(
    name="wan", label="Wan", pipeline_class="WanPipeline",
    dit_class="WanTransformer3DModel", dit_components=("transformer",),
    expert_components=("transformer_2",), expert_switch="boundary_ratio",
    components=("vae", "text_encoder", "tokenizer", "scheduler"),
    block_lists=("blocks",),
    resident_modules=("rope", "patch_embedding", "condition_embedder", "norm_out", "proj_out"),
    batch_key_fields=("height", "width", "num_frames", "max_sequence_length"), output="video",
    loader_version="wan-loader-1", cfg_rows="guidance",
    attention_heads=(12, 24, 40),  # Wan2.1-T2V-1.3B, Wan2.2-TI2V-5B, the 14B DiTs
    reference_work=2 * 21 * 30 * 52,  # 81 frames -> 21 latent frames of 30 x 52 tokens, CFG
)

# Image-conditioned families (edits, image-to-video): the same DiTs, whose rows also carry
# the conditioning image's latents (or tokens); ``engine.pipelines.flux_kontext`` & co.
FLUX_KONTEXT = Family(
    name="flux-kontext", label="FluxKontext", pipeline_class="FluxKontextPipeline",
    dit_class=FLUX.dit_class, dit_components=FLUX.dit_components, components=FLUX.components,
    block_lists=FLUX.block_lists, resident_modules=FLUX.resident_modules,
    batch_key_fields=("height", "width", "images"), output="image",
    loader_version="flux-kontext-loader-1", attention_heads=FLUX.attention_heads,
    reference_work=2 * 4096,  # a 1024x1024 edit: 4096 target + 4096 source tokens
)

WAN_I2V = Family(
    name="wan-i2v", label="WanI2V", pipeline_class="WanImageToVideoPipeline",
    dit_class=WAN.dit_class, dit_components=WAN.dit_components,
    expert_components=WAN.expert_components, expert_switch=WAN.expert_switch,
    components=WAN.components,  # + image_encoder / image_processor where the model has them
    block_lists=WAN.block_lists, resident_modules=WAN.resident_modules,
    batch_key_fields=("height", "width", "num_frames", "images"), output="video",
    loader_version="wan-i2v-loader-1", cfg_rows="guidance",
    attention_heads=WAN.attention_heads, reference_work=WAN.reference_work,
)

FAMILIES: tuple[Family, ...] = (FLUX, QWEN_IMAGE, WAN, FLUX_KONTEXT, WAN_I2V)
# What the model builders (`ditserve model init-tiny / init-random --family`) build: one
# released model layout each, by the family it belongs to.
MODEL_VARIANTS: dict[str, str] = {
    "flux": "flux",  # FLUX.1-dev
    "qwen-image": "qwen-image",  # Qwen-Image (20B)
    "wan": "wan",  # Wan2.1-T2V-14B
    "wan2.2": "wan",  # Wan2.2-T2V-A14B: two 14B experts
    "wan2.2-ti2v": "wan",  # Wan2.2-TI2V-5B
    "flux-kontext": "flux-kontext",  # FLUX.1-Kontext-dev
    "wan-i2v": "wan-i2v",  # Wan2.1-I2V-14B-480P: 36 input channels, CLIP image context
    "wan2.2-ti2v-i2v": "wan-i2v",  # Wan2.2-TI2V-5B as WanImageToVideoPipeline
}
# The value of ``model.family`` that means "read it from model_index.json".
AUTO_FAMILY = "Auto"


def family_names() -> tuple[str, ...]:
    return tuple(f.name for f in FAMILIES)


def family_labels() -> tuple[str, ...]:
    return tuple(f.label for f in FAMILIES)


def family_named(name: str) -> Family | None:
    """The family a CLI name or operator label names (case-insensitive), else None."""
    wanted = name.strip().lower()
    for family in FAMILIES:
        if wanted in (family.name, family.label.lower()):
            return family
    return None


def family_of_pipeline(class_name: object) -> Family | None:
    """The family whose layout ``model_index.json``'s ``_class_name`` names, else None."""
    for family in FAMILIES:
        if family.pipeline_class == class_name:
            return family
    return None


def supported_pipelines() -> tuple[str, ...]:
    return tuple(f.pipeline_class for f in FAMILIES)


def declared_block_lists(dit_class: str) -> tuple[str, ...] | None:
    """The block lists a family declares for a DiT class (by class name), else None."""
    for family in FAMILIES:
        if family.dit_class == dit_class:
            return family.block_lists
    return None
