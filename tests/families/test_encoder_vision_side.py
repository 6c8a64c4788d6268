"""A streamed VLM text encoder of a text-only pipeline keeps its vision side in host memory
(``encoder_streaming.vision_side_modules``): FLUX.2's Mistral3 (Pixtral tower and projector)
and Qwen-Image's Qwen2.5-VL hold less on the device by exactly those bytes, the planner counts
the same, the hidden states are unchanged, and running the vision side raises. Pipelines
whose prompts read images (Qwen-Image-Edit, MiniMax-H3) keep it on the device."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ditserve.engine.config import (
    EngineConfig,
    OffloadConfig,
    ParallelConfig,
    PipelineConfig,
    ResolvedOffload,
    RunnerConfig,
)
from ditserve.engine.makers.builders import build_tiny
from ditserve.engine.offload.discovery import discover
from ditserve.engine.pipelines.capabilities import encoder_reads_images
from ditserve.engine.placement.component_placement import module_bytes
from ditserve.engine.placement.encoder_streaming import (
    StreamedEncoder,
    StreamedEncoders,
    vision_side_modules,
)
from ditserve.engine.placement.memory_estimates import streamed_encoder_bytes
from ditserve.engine.runner.model_runner import ModelRunner

DLO = ResolvedOffload.of(OffloadConfig(enabled=True), parallel=ParallelConfig())
CPU = torch.device("cpu")


def _qwen25_vl_with_streamed_vision_blocks() -> torch.nn.Module:
    """A Qwen2.5-VL deep enough in vision that DLO streams its vision blocks too, as it does
    the released 7B's (the tiny Qwen-Image encoder's single vision block is not streamed)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]}),
        vision_config=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=32, fullatt_block_indexes=[3]))
    return Qwen2_5_VLForConditionalGeneration(config).eval()


ENCODERS = {"flux2": lambda: build_tiny("flux2", seed=0).text_encoder.eval(),
            "qwen-image": lambda: build_tiny("qwen-image", seed=0).text_encoder.eval(),
            "qwen2.5-vl-deep": _qwen25_vl_with_streamed_vision_blocks}


def _hidden_states(encoder: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with torch.inference_mode():
        out = encoder.model(input_ids=ids, attention_mask=torch.ones_like(ids),
                            output_hidden_states=True)
    return tuple(h.clone() for h in out.hidden_states)


def _streamed(encoder: torch.nn.Module, *, vision: bool) -> tuple[StreamedEncoder, Any]:
    streamed = StreamedEncoders({"text_encoder": encoder}, device=CPU, offload=DLO,
                                vision=vision)
    return streamed["text_encoder"], streamed


@pytest.mark.parametrize("variant", sorted(ENCODERS))
def test_a_text_only_encoder_keeps_its_vision_side_on_the_host(variant: str) -> None:
    encoder = ENCODERS[variant]()
    ids = torch.randint(0, int(encoder.get_input_embeddings().num_embeddings), (2, 9),
                        generator=torch.Generator().manual_seed(1))
    resident = _hidden_states(encoder, ids)
    parts = vision_side_modules(encoder)
    assert parts
    seeing = module_bytes(torch.nn.ModuleList(parts))
    # Nothing kept on the host lies inside a streamed layer (the offload would refuse it).
    blocks = {id(t) for _, m in discover(encoder).blocks for t in m.parameters()}
    assert not any(id(t) in blocks for p in parts for t in p.parameters())

    everything, streamed = _streamed(encoder, vision=False)
    streamed.close()
    text_only, streamed = _streamed(encoder, vision=True)
    try:
        assert text_only.vision_bytes == seeing > 0 and everything.vision_bytes == 0
        assert text_only.device_bytes == everything.device_bytes - seeing
        assert text_only.host_side_bytes == everything.host_side_bytes + seeing
        # The planner counts what the runtime holds, to the byte, either way.
        assert streamed_encoder_bytes(encoder, vision=True) == text_only.device_bytes
        assert streamed_encoder_bytes(encoder) == everything.device_bytes
        got = _hidden_states(encoder, ids)
        assert len(got) == len(resident)
        for a, b in zip(got, resident, strict=True):
            assert torch.equal(a, b)
        tower = getattr(encoder.model, "vision_tower", None) or encoder.model.visual
        with pytest.raises(RuntimeError, match="vision side stays in host memory"), \
                torch.inference_mode():
            # (the guard fires before the tower reads its input: Qwen2.5-VL's patch embedding
            # where its blocks stream, the whole tower elsewhere)
            tower(torch.zeros(4, 1176), grid_thw=torch.tensor([[1, 2, 2]]))
    finally:
        streamed.close()
    assert not any(p._forward_pre_hooks for p in parts)  # closed: the guards are gone


def test_the_lives_line_names_the_vision_side() -> None:
    facts = StreamedEncoder(handle=None, total_bytes=4 << 30, device_bytes=1 << 30,  # type: ignore[arg-type]
                            streamed_blocks=40, slots=2, host_side_bytes=3 << 30,
                            vision_bytes=1 << 29)
    assert "(token table, output head, vision side) in host memory" in facts.lives()
    plain = StreamedEncoder(handle=None, total_bytes=4 << 30, device_bytes=1 << 30,  # type: ignore[arg-type]
                            streamed_blocks=40, slots=2, host_side_bytes=2 << 30)
    assert "vision" not in plain.lives()


def test_pipelines_that_show_their_encoder_images_say_so() -> None:
    from ditserve.engine.families.flux2.pipeline import Flux2StepPipeline
    from ditserve.engine.families.minimax_h3.pipeline import MiniMaxH3StepPipeline
    from ditserve.engine.families.qwen_image.pipeline import QwenImageStepPipeline
    from ditserve.engine.families.qwen_image_edit.pipeline import (
        QwenImageEditPlusStepPipeline,
        QwenImageEditStepPipeline,
    )

    for reads in (QwenImageEditStepPipeline, QwenImageEditPlusStepPipeline,
                  MiniMaxH3StepPipeline):
        assert encoder_reads_images(reads), reads.__name__
    for text_only in (Flux2StepPipeline, QwenImageStepPipeline):
        assert not encoder_reads_images(text_only), text_only.__name__


@pytest.mark.parametrize(("variant", "on_host"), [("flux2", True), ("qwen-image-edit", False)])
def test_the_runner_streams_the_vision_side_as_the_pipeline_reads_images(
        family_dir, variant: str, on_host: bool) -> None:  # type: ignore[no-untyped-def]
    """--offload dlo --dlo-components all: FLUX.2's encoder leaves its vision tower and
    projector on the host; Qwen-Image-Edit's, which reads the source image, keeps them; the
    planner's figure is the runtime's in both."""
    model = family_dir(variant)
    config = EngineConfig(model=str(model), device="cpu",
                          offload=OffloadConfig(enabled=True, components="all"),
                          pipeline=PipelineConfig(prompt_cache_size=0))
    runner = ModelRunner(RunnerConfig.of(config), model_dir=model)
    try:
        encoder = runner.pipeline.text_encoder
        facts = runner.whole.streamed["text_encoder"]
        seeing = module_bytes(torch.nn.ModuleList(vision_side_modules(encoder)))
        assert seeing > 0
        assert facts.vision_bytes == (seeing if on_host else 0)
        assert dict(runner.whole.inputs.streamable)["text_encoder"] == facts.device_bytes
    finally:
        runner.close()
