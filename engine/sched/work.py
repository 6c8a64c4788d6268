"""Work: how much of a denoise step a request takes - rows x tokens - by a pure rule.

Pure Python (no torch): the scheduler plans steps by it, the engine computes it when a request
arrives, the runner reports it per step. A request adds ``rows`` rows to its shape group's
forward (its images, doubled when classifier-free guidance runs negative-prompt rows) of
``tokens_per_row`` latent tokens each; the work of a step, rows x tokens summed over its
requests, is what its forwards cost in activation memory and (roughly) compute, whatever the
mix of shapes. So a 512x512 image counts a quarter of a 1024x1024 one, and a true-CFG request
twice its size.

``WorkRule`` turns ``SamplingParams`` into ``RequestWork`` from three facts of the served model:
the pixels per token side (VAE factor x patch size: the ``pixel_multiple`` requests already
validate against), the frames per latent frame of a video model (``frame_step``), and the
family's CFG rule (``Family.cfg_rows``) - and, where the model conditions on images, the
tokens those join each row's sequence with (``condition_tokens``: an edit's source image, FLUX.2's
references, MiniMax-H3's keyframes and image references), which the pipeline computes from the
request's images by its own resize rule. So a FLUX.1 Kontext edit at 1024x1024 counts twice the
tokens of a text-to-image request of that size: the DiT attends over both. Nothing in it is
family-specific code; a test keeps it equal to the rows and tokens every pipeline actually
builds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import get_args

from ditserve.engine.config import SchedulerConfig
from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.families import FLUX, Family
from ditserve.engine.families.base import CfgRule
from ditserve.engine.request import SamplingParams
from ditserve.engine.step.plan import RequestWork

# Tokens of one 1024x1024 image of a DiT with 16-pixel tokens (Flux.1, Qwen-Image): 64 x 64.
FULL_IMAGE_TOKENS = 4096


@dataclass(frozen=True, kw_only=True)
class ResolvedScheduling(SchedulerConfig):
    """A ``SchedulerConfig`` whose work budget is resolved: what a ``StepScheduler`` runs
    with. Resolved once, where the engine knows the served family (``for_family``), so no
    scheduler ever sees an unset budget.

    max_loras: the most distinct LoRA adapters the requests of one step (running and paused)
        may name (``engine.adapters.admission``); None: unbounded. The engine passes
        ``adapters.max_loras`` (``--max-loras``), so the adapters resident at once never
        exceed what the runner keeps.
    """

    max_batch_tokens: int
    max_request_tokens: int
    max_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_request_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"a resolved {name} is a positive token count, got "
                                 f"{value!r}")

    @classmethod
    def for_family(cls, config: SchedulerConfig, family: Family | None = None, *,
                   max_loras: int | None = None) -> ResolvedScheduling:
        """``config`` with its budget resolved: the configured one, else ``max_num_seqs``
        requests of the served family's usual size (``Family.reference_work``), so an image
        model budgets four 1024x1024 images and a video model four 81-frame CFG videos, not a
        video's fraction. An unknown family budgets like Flux. ``max_request_tokens`` unset is
        ``REQUEST_BUDGETS`` budgets."""
        budget = config.max_batch_tokens
        if budget is None:
            budget = config.max_num_seqs * (family or FLUX).reference_work
        values = {f.name: getattr(config, f.name) for f in fields(SchedulerConfig)}
        largest = (REQUEST_BUDGETS * budget if config.max_request_tokens is None
                   else config.max_request_tokens)
        return cls(**{**values, "max_batch_tokens": budget, "max_request_tokens": largest,
                      "max_loras": max_loras})


# One request may bring this many steps' budgets to one step by default: a 720p Wan video
# with CFG (151200 tokens) at --max-num-seqs 1 (a 65520 budget) still runs; an 8192x8192
# Flux image (262144 tokens, a step of minutes an abort cannot cut short) does not.
REQUEST_BUDGETS = 4
CFG_RULES: tuple[str, ...] = get_args(CfgRule)


@dataclass(frozen=True)
class WorkRule:
    """How a served model turns a request into rows and tokens (see module docstring).

    pixels_per_token: the pixel side of one latent token (VAE factor x patch size).
    frame_step: pixel frames per latent frame of a video model; None for an image model.
    cfg_rows: "true_cfg" - negative-prompt rows when ``true_cfg_scale`` > 1 with a negative
        prompt (Flux, Qwen-Image); "guidance" - when ``guidance_scale`` > 1 (Wan);
        "guidance_positive" - when ``guidance_scale`` > 0 (Z-Image).
    condition_tokens: the tokens a request's conditioning adds to each of its rows (the
        pipeline's ``condition_tokens``: its images after the family's resize rule); None for
        a model whose conditioning joins no sequence (text only; Wan I2V's channels).
    """

    pixels_per_token: int = 16
    frame_step: int | None = None
    cfg_rows: CfgRule = "true_cfg"
    condition_tokens: Callable[[SamplingParams], int] | None = field(default=None,
                                                                      compare=False)

    def __post_init__(self) -> None:
        if self.cfg_rows not in CFG_RULES:
            raise ValueError(f"cfg_rows must be one of {CFG_RULES}, got {self.cfg_rows!r}")

    def rows(self, params: SamplingParams) -> int:
        if self.cfg_rows == "guidance":
            cfg = params.guidance_scale > 1.0
        elif self.cfg_rows == "guidance_positive":
            cfg = params.guidance_scale > 0.0
        else:
            cfg = params.uses_true_cfg
        return params.num_images * (2 if cfg else 1)

    def generated_tokens_per_row(self, params: SamplingParams) -> int:
        """The latent tokens a row generates (its size and frames), conditioning aside."""
        side = self.pixels_per_token
        frames = 1 if self.frame_step is None else (params.num_frames - 1) // self.frame_step + 1
        return frames * (params.height // side) * (params.width // side)

    def tokens_per_row(self, params: SamplingParams) -> int:
        """The tokens a row's forward holds: the generated ones and its conditioning's."""
        generated = self.generated_tokens_per_row(params)
        if self.condition_tokens is None:
            return generated
        return generated + int(self.condition_tokens(params))

    def of(self, params: SamplingParams) -> RequestWork:
        """The request's rows and tokens. Its LoRA adapters add nothing (issue 45): the budget
        bounds what a step holds (its activations), and an adapter's delta is accumulated into
        the layer's own output in place (``adapters.linear``), holding only a (tokens x rank)
        intermediate; its compute, 2r/d of an adapted d x d linear (1-8% for ranks 16-128 on
        Flux), makes the step slightly longer. Charged as tokens, it shrank the step: four
        1024x1024 requests fill the default budget exactly, so any adapter left one of them
        out (0.87x the adapter-free throughput on one H200, 2.23 against 2.75 rows a step)."""
        return RequestWork(self.rows(params), self.tokens_per_row(params))

    def check_request(self, params: SamplingParams, bound: int) -> None:
        """Refuse a request whose one step would exceed ``bound`` tokens
        (``max_request_tokens``): a step is never cut short, so it would hold the replica even
        after its client left."""
        work = self.of(params)
        if work.tokens <= bound:
            return
        frames = f" x {params.num_frames} frames" if params.num_frames > 1 else ""
        what = "size and frames" if frames else "size"
        conditioned = work.tokens_per_row - self.generated_tokens_per_row(params)
        inputs = (f" (of which {conditioned * work.rows} the input images' tokens the model "
                  "reads beside its own)" if conditioned else "")
        # Blame what makes most of the work: the input images when they do (the client's
        # fix is to downscale them, not to shrink the size it asked for).
        field = "image" if 2 * conditioned > work.tokens_per_row else "size"
        raise InvalidRequestError(
            field, f"{params.width}x{params.height}{frames} x {work.rows} row(s) is "
            f"{work.tokens} tokens of work per step{inputs}; this server takes at most {bound} "
            "per request (--max-request-tokens, default 4 x the step budget "
            f"--max-batch-tokens): ask for a smaller {what}, fewer images"
            f"{', or smaller or fewer input images' if conditioned else ''}")
