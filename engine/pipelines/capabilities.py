"""Optional pipeline capabilities: what a family's pipeline may declare beyond ``StepPipeline``.

Most families need none of these; a DiT unlike the others (Cosmos3's packed sequences, an
image-conditioned layout, a distilled model) declares the few it needs as plain class or
instance attributes. Each is a small runtime-checkable protocol, so the runner and the
placement ask ``isinstance(pipeline, Capability)`` - a question a type checker follows - rather
than probing attribute names; the ``*_of`` readers give the default a pipeline without the
capability gets. The step cache's two choices (``step_cache_refusal``,
``step_cache_block_lists``) are protocols of ``engine.step_cache.runtime``, which sits below
the pipelines. docs/architecture.md lists them all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from ditserve.engine.families.base import CfgRule
from ditserve.engine.sched.work import WorkRule

if TYPE_CHECKING:
    from ditserve.engine.model_limits import ModelLimits
    from ditserve.engine.pipelines.base import StepPipeline
    from ditserve.engine.request import SamplingParams
    from ditserve.engine.step.denoise_state import DenoiseState


@runtime_checkable
class TokenSide(Protocol):
    """The pixel side of one DiT token when it differs from ``pixel_multiple`` (Cosmos3: sizes
    in 16 px, tokens of 32 px), for the work rule."""

    pixels_per_token: int


@runtime_checkable
class NarrowedCfgRule(Protocol):
    """The CFG rule of the loaded model when it narrows its family's (a step-distilled
    FLUX.2 [klein] ignores guidance)."""

    cfg_rows: CfgRule


@runtime_checkable
class ImageConditioned(Protocol):
    """A pipeline that takes input images: (fewest, most) per request."""

    condition_images: tuple[int, int]


@runtime_checkable
class ConditionTokens(Protocol):
    """A pipeline whose conditioning joins the DiT's sequence (an edit's source image,
    reference images, keyframes): the tokens it adds to each row, for the work rule.

    ``condition_tokens(params)``: those tokens of a request, from its images' sizes by the
    pipeline's own resize rule (no pixels resized: the scheduler asks per step).
    ``most_condition_tokens``: the most any request it admits may add (its largest count of
    images at their largest resize), for the HBM planner's estimate of one request alone.
    """

    def condition_tokens(self, params: SamplingParams) -> int: ...

    @property
    def most_condition_tokens(self) -> int: ...


@runtime_checkable
class BatchedConditions(Protocol):
    """Encodes the admitted requests' input images in one batch before their prompts."""

    def encode_conditions(self, states: Sequence[DenoiseState]) -> None: ...


@runtime_checkable
class HostModules(Protocol):
    """DiT modules outside the block lists that stay in host memory, neither resident nor
    streamed under offload (Cosmos3's token table and unused language-model head)."""

    host_modules: Sequence[torch.nn.Module]


@runtime_checkable
class PromptEncoder(Protocol):
    """Encodes one prompt per call: the hook the prompt cache wraps."""

    def _encode_prompt(self, *args: object, **kwargs: object) -> object: ...


@runtime_checkable
class BatchedPromptEncoder(Protocol):
    """Encodes many prompts in one encoder pass (``placement.batched_encode``): the prompts a
    request needs, and their embeddings at one text length."""

    def _encode_prompts(self, prompts: list[str], length: int) -> list[torch.Tensor]: ...
    def text_prompts(self, params: SamplingParams) -> list[str]: ...


@runtime_checkable
class PromptReadsImages(Protocol):
    """Reads its prompt with the request's images (Qwen-Image-Edit's vision-language encoder):
    no prompt cache or batched pass can stage it."""

    prompt_reads_images: bool


@runtime_checkable
class EncoderReadsImages(Protocol):
    """Shows its text encoder a request's images although the prompt cache can stage them
    (MiniMax-H3's keyframes and references): its encoder's vision side stays on the device
    when streamed, as ``PromptReadsImages``' does."""

    encoder_reads_images: bool


@runtime_checkable
class EncoderHiddenStates(Protocol):
    """Reads the prompt off every encoder layer's hidden state (Qwen-Image): an encode holds
    all of them, which the memory estimate counts."""

    encoder_keeps_hidden_states: bool


@runtime_checkable
class DecodeBatching(Protocol):
    """Whether finished requests of one shape may decode in one VAE call (False where a decode
    reads more of a request than its latents: Wan I2V's first-frame latents)."""

    batched_decode: bool


def pixels_per_token_of(pipeline: StepPipeline) -> int:
    return (int(pipeline.pixels_per_token) if isinstance(pipeline, TokenSide)
            else int(pipeline.pixel_multiple))


def cfg_rows_of(pipeline: StepPipeline) -> CfgRule:
    return pipeline.cfg_rows if isinstance(pipeline, NarrowedCfgRule) else pipeline.family.cfg_rows


def work_rule_of(pipeline: StepPipeline) -> WorkRule:
    """How the loaded model turns a request into rows and tokens: its DiT's token side and
    CFG rule, where it declares them, else its pixel multiple and its family's rule; and the
    tokens its conditioning adds, where it declares them (``ConditionTokens``)."""
    conditioned = pipeline.condition_tokens if isinstance(pipeline, ConditionTokens) else None
    return WorkRule(pixels_per_token=pixels_per_token_of(pipeline),
                    frame_step=pipeline.frame_step, cfg_rows=cfg_rows_of(pipeline),
                    condition_tokens=conditioned)


def most_condition_tokens_of(pipeline: object) -> int:
    """The most tokens a request's conditioning may add to a row (0: none joins the DiT)."""
    return int(pipeline.most_condition_tokens) if isinstance(pipeline, ConditionTokens) else 0


def condition_images_of(pipeline: object) -> tuple[int, int]:
    return pipeline.condition_images if isinstance(pipeline, ImageConditioned) else (0, 0)


def model_limits_of(pipeline: StepPipeline) -> ModelLimits:
    """What the loaded model can run: its pipeline's ``limits``, with the input images an
    image-conditioned pipeline takes, whether ``true_cfg_scale`` is one of its inputs, and
    (a family whose one frame is a still image made from the text: ``Family.still_images``)
    that an input image needs two frames or more."""
    import dataclasses

    return dataclasses.replace(pipeline.limits(), condition_images=condition_images_of(pipeline),
                               true_cfg=cfg_rows_of(pipeline) == "true_cfg",
                               image_needs_frames=2 if pipeline.family.still_images else 1)


def host_modules_of(pipeline: object) -> Sequence[torch.nn.Module]:
    return pipeline.host_modules if isinstance(pipeline, HostModules) else ()


def prompt_reads_images(pipeline: object) -> bool:
    return isinstance(pipeline, PromptReadsImages) and bool(pipeline.prompt_reads_images)


def encoder_reads_images(pipeline: object) -> bool:
    """Whether any prompt encoding runs the encoder's vision side (False: prompts are text
    only, and a streamed encoder keeps its vision side in host memory)."""
    return prompt_reads_images(pipeline) or (isinstance(pipeline, EncoderReadsImages)
                                             and bool(pipeline.encoder_reads_images))


def keeps_encoder_hidden_states(pipeline: object) -> bool:
    return isinstance(pipeline, EncoderHiddenStates) and bool(
        pipeline.encoder_keeps_hidden_states)


def decodes_in_batches(pipeline: object) -> bool:
    return not isinstance(pipeline, DecodeBatching) or bool(pipeline.batched_decode)
