"""Step-wise FLUX.2 [klein] (the family's diffusers pipeline layout): FLUX.2's DiT and steps
with a Qwen3 text encoder and true classifier-free guidance.

Everything but the prompt encoding and the guidance is FLUX.2's
(``engine.families.flux2.pipeline``: noise, schedule, reference images, decode). The prompt
is Qwen3's chat template (one user turn, generation prompt, thinking off) tokenized alone
and padded to ``max_sequence_length``, the hidden layers 9, 18 and 27 stacked. Guidance is
true CFG: when ``guidance_scale`` > 1 and the model is not step-distilled
(``model_index.json``'s ``is_distilled``), every request adds negative rows - diffusers'
pipeline always uses the empty prompt; a request's ``negative_prompt`` replaces it (equal to
diffusers given that prompt's embeddings as ``negative_prompt_embeds``) - and they run in the
same forward as the positive rows, so the weights are read once per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ditserve.engine.families import FLUX2_KLEIN
from ditserve.engine.families.flux2.pipeline import Flux2StepPipeline
from ditserve.engine.request import SamplingParams

if TYPE_CHECKING:
    from ditserve.engine.weights.loader import LoadedComponents


class Flux2KleinStepPipeline(Flux2StepPipeline):
    """StepPipeline for FLUX.2 [klein] (see module docstring)."""

    family = FLUX2_KLEIN

    def __init__(
        self, components: LoadedComponents, *, device: torch.device, move_transformer: bool = True
    ) -> None:
        super().__init__(components, device=device, move_transformer=move_transformer)
        config = getattr(components.pipeline, "config", {}) or {}
        self.distilled = bool(config.get("is_distilled", False))
        # The work rule's CFG rows: a distilled model adds none at any guidance (only a
        # request's explicit true CFG would count, which this pipeline ignores too).
        self.cfg_rows = "true_cfg" if self.distilled else self.family.cfg_rows

    def _tokens(self, prompts: list[str], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """diffusers' ``_get_qwen3_prompt_embeds`` tokenization: each prompt templated and
        tokenized alone, padded to ``length``."""
        ids, masks = [], []
        for prompt in prompts:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False,
                add_generation_prompt=True, enable_thinking=False)
            inputs = self.tokenizer(text, return_tensors="pt", padding="max_length",
                                    truncation=True, max_length=length)
            ids.append(inputs["input_ids"])
            masks.append(inputs["attention_mask"])
        return torch.cat(ids), torch.cat(masks)

    def uses_cfg(self, params: SamplingParams) -> bool:
        return params.guidance_scale > 1.0 and not self.distilled

    def cfg_scale(self, params: SamplingParams) -> float:
        return float(params.guidance_scale)
