"""Text encoders streamed through DLO slots (``engine.placement.encoder_streaming``): every
family's encoders (T5 and CLIP for Flux, Qwen2.5-VL for Qwen-Image, UMT5 for Wan) give the
same hidden states streamed as resident, and report what they keep on the device."""

from __future__ import annotations

import pytest
import torch

from ditserve.engine.config import OffloadConfig, ParallelConfig, ResolvedOffload
from ditserve.engine.makers.builders import build_tiny
from ditserve.engine.offload.discovery import discover
from ditserve.engine.pipelines.host_embedding import HostEmbedding, host_embedding, token_ids
from ditserve.engine.placement.component_placement import module_bytes
from ditserve.engine.placement.encoder_streaming import (
    StreamedEncoders,
    host_side_bytes,
    host_side_modules,
    streamable,
)
from ditserve.engine.placement.memory_estimates import streamed_encoder_bytes

ENCODERS = {"flux": ("text_encoder", "text_encoder_2"), "qwen-image": ("text_encoder",),
            "wan": ("text_encoder",), "z-image": ("text_encoder",),
            "flux2": ("text_encoder",), "flux2-klein": ("text_encoder",)}

# The offload a replica resolves under --offload dlo: encoders stream with its encoder options.
DLO = ResolvedOffload.of(OffloadConfig(enabled=True), parallel=ParallelConfig())


def _headless(encoder: torch.nn.Module) -> torch.nn.Module:
    """What a pipeline calls: Qwen2.5-VL without its LM head (its ``.model``)."""
    return encoder.model if encoder.get_output_embeddings() is not None else encoder


def _hidden_states(encoder: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with torch.inference_mode():
        out = _headless(encoder)(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 output_hidden_states=True)
    return tuple(h.clone() for h in out.hidden_states)


@pytest.mark.parametrize("tables", ["device", "host"])
@pytest.mark.parametrize("variant", sorted(ENCODERS))
def test_streamed_encoders_equal_resident_ones(variant: str, tables: str) -> None:
    pipe = build_tiny(variant, seed=0)
    encoders = {name: getattr(pipe, name).eval() for name in ENCODERS[variant]}
    generator = torch.Generator().manual_seed(1)
    inputs = {name: torch.randint(0, int(m.get_input_embeddings().num_embeddings), (2, 9),
                                  generator=generator) for name, m in encoders.items()}
    resident = {name: _hidden_states(m, inputs[name]) for name, m in encoders.items()}
    assert all(streamable(m) for m in encoders.values())
    # "host": every token table is looked up on the host, however small.
    min_table = 0 if tables == "host" else 1 << 40
    streamed = StreamedEncoders(encoders, device=torch.device("cpu"), offload=DLO,
                                min_table_bytes=min_table)
    try:
        for name, module in encoders.items():
            assert (host_embedding(module) is not None) == (tables == "host")
            got = _hidden_states(module, inputs[name])
            assert len(got) == len(resident[name])
            for a, b in zip(got, resident[name], strict=True):
                assert torch.equal(a, b), name
            facts = streamed[name]
            assert facts.streamed_blocks >= 2 and facts.slots == 2
            assert "streamed by DLO" in facts.lives()
            assert facts.host_side_bytes == host_side_bytes(module, min_table_bytes=min_table)
    finally:
        streamed.close()
    for module in encoders.values():  # the ordinary table is back
        assert isinstance(module.get_input_embeddings(), torch.nn.Embedding)
    # Disabled, the encoders are ordinary modules again and still give the same states.
    for name, module in encoders.items():
        for a, b in zip(_hidden_states(module, inputs[name]), resident[name], strict=True):
            assert torch.equal(a, b)


def test_a_streamed_vl_encoder_keeps_its_lm_head_on_the_host_and_refuses_to_run_it() -> None:
    pipe = build_tiny("qwen-image", seed=0)
    encoder = pipe.text_encoder.eval()
    head = encoder.get_output_embeddings()
    table = encoder.get_input_embeddings()
    held = streamed_encoder_bytes(encoder)
    streamed = StreamedEncoders({"text_encoder": encoder}, device=torch.device("cpu"),
                                offload=DLO, min_table_bytes=0)
    try:
        facts = streamed["text_encoder"]
        # The planner's estimate leaves out what stays on the host, as the handle does.
        assert held is not None and facts.host_side_bytes >= module_bytes(head)
        assert facts.device_bytes <= held
        ids = torch.tensor([[1, 2, 3]])
        with pytest.raises(RuntimeError, match="output head stays in host memory"), \
                torch.inference_mode():
            encoder(input_ids=ids, attention_mask=torch.ones_like(ids))
    finally:
        streamed.close()
    assert encoder.get_input_embeddings() is table
    with torch.inference_mode():  # closed: the whole model runs again
        encoder(input_ids=torch.tensor([[1, 2, 3]]))


def test_a_head_tied_to_a_device_side_table_is_not_kept_on_the_host() -> None:
    """A head sharing its weight with a small token table (Mistral3Config ties them by
    default): keeping the head on the host would move the table there too, and the encode's
    device token ids would index a host table (FLUX.2's tiny encoder failed so on CUDA)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    config = Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=64, hidden_size=16,
                         intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8),
        vision_config=dict(model_type="pixtral", hidden_size=8, intermediate_size=8,
                           num_hidden_layers=1, num_attention_heads=1, head_dim=8,
                           image_size=28, patch_size=14))
    encoder = Mistral3ForConditionalGeneration(config)
    table, head = encoder.get_input_embeddings(), encoder.get_output_embeddings()
    assert head.weight is table.weight  # tied
    assert host_side_modules(encoder, min_table_bytes=1 << 40) == []
    # A table kept on the host takes its tied head with it; the head is guarded.
    kept = host_side_modules(encoder, min_table_bytes=0)
    assert kept[0] is table and all(m is table or m is head for m in kept)


def test_token_ids_stay_on_the_host_only_for_a_host_table() -> None:
    table = torch.nn.Embedding(10, 4)
    host = torch.tensor([[1, 2]])

    class Encoder(torch.nn.Module):
        def __init__(self, embedding: torch.nn.Module) -> None:
            super().__init__()
            self.embedding = embedding

        def get_input_embeddings(self) -> torch.nn.Module:
            return self.embedding

    cpu = torch.device("cpu")
    looked_up = HostEmbedding(table, cpu)
    assert token_ids(Encoder(looked_up), host, cpu) is host
    assert torch.equal(looked_up(host), table(host))
    assert looked_up.num_embeddings == 10 and looked_up.weight is table.weight


def test_a_deep_encoder_keeps_two_layers_and_its_embeddings_on_the_device() -> None:
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    encoder = T5EncoderModel(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=128,
                                      num_layers=8, num_heads=4)).eval()
    total = module_bytes(encoder)
    found = discover(encoder)
    layer = max(module_bytes(m) for _, m in found.blocks)
    outside = total - sum(module_bytes(m) for _, m in found.blocks)
    streamed = StreamedEncoders({"text_encoder": encoder}, device=torch.device("cpu"),
                                offload=DLO)
    try:
        facts = streamed["text_encoder"]
        assert facts.total_bytes == total and facts.streamed_blocks == 8
        # Two slots of the largest layer (slots round up a little) and the rest of the model.
        assert outside + 2 * layer <= facts.device_bytes < total
    finally:
        streamed.close()


def test_a_module_without_a_layer_list_is_not_streamable() -> None:
    assert not streamable(torch.nn.Sequential(torch.nn.Linear(4, 4)))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", sorted(ENCODERS))
def test_streamed_encoders_on_cuda_equal_resident_ones(variant: str) -> None:
    cuda = torch.device("cuda")
    pipe = build_tiny(variant, seed=0)
    encoders = {name: getattr(pipe, name).eval().to(cuda) for name in ENCODERS[variant]}
    generator = torch.Generator().manual_seed(1)
    inputs = {name: torch.randint(0, int(m.get_input_embeddings().num_embeddings), (2, 9),
                                  generator=generator).to(cuda)
              for name, m in encoders.items()}
    resident = {name: _hidden_states(m, inputs[name]) for name, m in encoders.items()}
    # Every table on the host: ids from the host (as pipelines pass them) and from the
    # device (looked up after a copy back) give the same states; a VLM's vision side stays
    # on the host too, as a text-only pipeline streams it.
    streamed = StreamedEncoders(encoders, device=cuda, offload=DLO, min_table_bytes=0,
                                vision=True)
    try:
        for ids_on in ("cpu", "cuda", "cpu"):  # later passes reuse the slots left filled
            for name, module in encoders.items():
                assert host_embedding(module) is not None
                got = _hidden_states(module, inputs[name].to(ids_on))
                for a, b in zip(got, resident[name], strict=True):
                    assert a.device.type == "cuda" and torch.equal(a, b), name
    finally:
        streamed.close()


def test_a_nested_visit_of_parked_modules_places_them_once() -> None:
    from contextlib import contextmanager

    from ditserve.engine.placement.component_placement import ParkedModules

    class Counted(ParkedModules):
        placements = 0

        @contextmanager
        def _placed(self):  # type: ignore[no-untyped-def,override]
            Counted.placements += 1
            with super()._placed():
                yield

    module = torch.nn.Linear(4, 4)
    parked = Counted({"m": module}, device=torch.device("cpu"))
    with parked.on_device():
        with parked.on_device():  # e.g. a prompt-cache miss inside a step's placement
            pass
        with parked.on_device():
            pass
    assert Counted.placements == 1
    with parked.on_device():
        pass
    assert Counted.placements == 2  # the outer exit ended the first visit

