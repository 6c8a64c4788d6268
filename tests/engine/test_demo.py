"""`ditserve demo`: six requests of different step counts batched through one engine, each
output saved as what the model makes, and a banner that names the model it runs (the tiny
Flux by default; the one ``--model`` names otherwise)."""

from __future__ import annotations

from pathlib import Path

import av
import pytest
from PIL import Image

from ditserve.engine.cli.main import main


def test_the_demo_saves_six_images_and_shows_the_batching(
        tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo-out"
    assert main(["demo", "--model", str(tiny_model_dir), "--device", "cpu",
                 "--out-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"ditserve demo: the model in {tiny_model_dir}" in printed
    assert "requests 6 | denoise steps run" in printed and "(vs 27 unbatched)" in printed
    for i in range(6):
        with Image.open(out / f"demo-{i}.png") as image:
            assert image.size == (64, 64)


def test_a_video_model_demo_saves_its_videos(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from ditserve.engine.makers.tiny_model import init_tiny
    from ditserve.engine.server.model_defaults import model_defaults

    wan = init_tiny(tmp_path / "tiny-wan", family="wan")
    out = tmp_path / "demo-out"
    assert main(["demo", "--model", str(wan), "--device", "cpu", "--out-dir", str(out)]) == 0
    assert "videos/s" in capsys.readouterr().out
    for i in range(6):
        with av.open(str(out / f"demo-{i}.mp4")) as container:
            frames = sum(1 for _ in container.decode(video=0))
        assert frames == model_defaults(wan).frames  # the model's clip, not one frame


def test_a_model_that_needs_an_input_image_is_pointed_to_generate(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ditserve.engine.makers.tiny_model import init_tiny

    edit = init_tiny(tmp_path / "tiny-edit", family="qwen-image-edit")
    assert main(["demo", "--model", str(edit), "--device", "cpu",
                 "--out-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "demo sends text-only requests" in err and "ditserve generate" in err
