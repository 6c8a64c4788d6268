"""Model builders: the full-size DiTs have the released models' shapes; init-tiny and
init-random write loadable directories of every family."""

from __future__ import annotations

import json

import pytest
import torch

from ditserve.engine.makers.builders import dit_class, dit_config

# Released DiT sizes (parameters) and block counts, from the public model configs.
FULL = {
    "qwen-image": (20.0e9, 21.0e9, 60, 3072),  # Qwen-Image: 60 blocks, 24 heads x 128
    "qwen-image-edit": (20.0e9, 21.0e9, 60, 3072),  # Qwen-Image-Edit: Qwen-Image's DiT
    "qwen-image-edit-plus": (20.0e9, 21.0e9, 60, 3072),  # Qwen-Image-Edit-2509: the same
    "wan": (13.5e9, 14.5e9, 40, 5120),  # Wan2.1-T2V-14B: 40 blocks, 40 heads x 128
    "wan2.2-ti2v": (4.8e9, 5.2e9, 30, 3072),  # Wan2.2-TI2V-5B: 30 blocks, 24 heads x 128
    # MiniMax-H3: 33.1B, 50 blocks of 56 heads x 128 (the refiner's 2 are nested)
    "minimax-h3": (33.0e9, 33.3e9, 50, 7168),
}


@pytest.mark.parametrize("variant", sorted(FULL))
def test_full_size_dits_have_the_released_shapes(variant: str) -> None:
    low, high, blocks, width = FULL[variant]
    with torch.device("meta"):  # shapes only: nothing allocated
        model = dit_class(variant)(**dit_config(variant, "full"))
    params = sum(p.numel() for p in model.parameters())
    assert low <= params <= high, f"{variant}: {params / 1e9:.2f}B parameters"
    lists = [m for m in model.children() if isinstance(m, torch.nn.ModuleList)]
    assert [len(m) for m in lists] == [blocks]
    assert model.config.num_attention_heads * model.config.attention_head_dim == width


def test_wan22_full_is_two_wan21_experts() -> None:
    assert dit_config("wan2.2", "full") == dit_config("wan", "full")


def test_init_tiny_cli_writes_wan22_with_two_experts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.cli.main import main
    from ditserve.engine.weights.loader import dit_components, read_model_index

    assert main(["model", "init-tiny", "--family", "wan2.2", str(tmp_path / "w")]) == 0
    cls, index = read_model_index(tmp_path / "w")
    assert cls == "WanPipeline" and index["boundary_ratio"] == 0.875
    assert dit_components(tmp_path / "w") == ("transformer", "transformer_2")


def test_init_random_writes_a_loadable_qwen_image_dir(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.makers.random_model import init_random
    from ditserve.engine.weights.loader import load_components

    path = init_random(tmp_path / "q", family="qwen-image", size="tiny", dtype="float32",
                       device="cpu")
    marker = json.loads((path / ".ditserve-random-complete").read_text())
    assert marker["family"] == "qwen-image" and marker["transformer_parameters"] > 0
    components = load_components(path)
    assert components.family.name == "qwen-image"
    assert next(components.modules["transformer"].parameters()).dtype == torch.float32


@pytest.mark.parametrize("variant", ["qwen-image-edit", "qwen-image-edit-plus"])
def test_init_random_writes_a_loadable_qwen_image_edit_dir(variant: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from transformers import Qwen2VLImageProcessorPil

    from ditserve.engine.cli.main import main
    from ditserve.engine.weights.loader import load_components

    assert main(["model", "init-random", "--family", variant, "--size", "tiny",
                 "--dtype", "float32", "--device", "cpu", str(tmp_path / "e")]) == 0
    index = json.loads((tmp_path / "e" / "model_index.json").read_text())
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
    # The released processor folder's pieces: tokenizer files and the image processor's.
    processor = Qwen2VLImageProcessorPil.from_pretrained(tmp_path / "e" / "processor")
    assert processor.merge_size == 2 and processor.patch_size == 14
    components = load_components(tmp_path / "e")
    assert components.family.name == variant
    assert "processor" not in components.modules  # read by the step pipeline itself
    config = components.modules["text_encoder"].config
    assert config.image_token_id == components.modules["tokenizer"].convert_tokens_to_ids(
        "<|image_pad|>")


def test_minimax_h3_dirs_hold_qwen3_vls_image_processor(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # What the keyframe workflow reads its frames through: the released layout's processor
    # folder (named Qwen3VLProcessor in the index), with Qwen3-VL's 16 px patches merged 2x2
    # (the tiny vision tower's patch) and, at the released shapes, its pixel budget.
    from transformers import AutoImageProcessor

    from ditserve.engine.cli.main import main
    from ditserve.engine.families.minimax_h3 import builders
    from ditserve.engine.weights.loader import load_components

    assert main(["model", "init-random", "--family", "minimax-h3", "--size", "tiny",
                 "--dtype", "float32", "--device", "cpu", str(tmp_path / "m")]) == 0
    index = json.loads((tmp_path / "m" / "modular_model_index.json").read_text())
    assert index["processor"][:2] == ["transformers", "Qwen3VLProcessor"]
    processor = AutoImageProcessor.from_pretrained(str(tmp_path / "m" / "processor"))
    components = load_components(tmp_path / "m")
    vision = components.modules["text_encoder"].config.vision_config
    assert (processor.patch_size, processor.merge_size) == (vision.patch_size,
                                                            vision.spatial_merge_size)
    assert "processor" not in components.modules  # read by the step pipeline itself
    released = builders.make_image_processor("full")
    assert (released.size["shortest_edge"], released.size["longest_edge"]) == \
        builders.RELEASED_PIXELS and released.patch_size == 16
