"""`ditserve generate` on a video model: the model's usual frame count by default, an MP4
where it was asked for one, and a refusal (before loading) of an extension that does not fit
what the model makes."""

from __future__ import annotations

from pathlib import Path

import av
import pytest

from ditserve.engine.cli.main import main
from ditserve.engine.server.model_defaults import model_defaults


@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ditserve.engine.makers.tiny_model import init_tiny

    return init_tiny(tmp_path_factory.mktemp("models") / "tiny-wan", family="wan")


def _frames(path: Path) -> int:
    with av.open(str(path)) as container:
        return sum(1 for _ in container.decode(video=0))


def test_a_video_model_writes_its_usual_frame_count_by_default(
    tiny_wan: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "waves.mp4"
    assert main(["generate", "--model", str(tiny_wan), "--prompt", "waves", "--seed", "1",
                 "--device", "cpu", "--out", str(out)]) == 0
    usual = model_defaults(tiny_wan).frames
    assert usual > 1  # 9 for a tiny Wan (81 for a released one)
    assert _frames(out) == usual
    assert f"saved {out}" in capsys.readouterr().out


@pytest.mark.parametrize(("model", "out", "hint"), [
    ("wan", "waves.png", "waves.mp4"),
    ("wan", "waves", "waves.mp4"),
    ("flux", "fox.mp4", "fox.png"),
])
def test_an_output_extension_that_does_not_fit_the_model_is_refused(
    tiny_wan: Path, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    model: str, out: str, hint: str,
) -> None:
    directory = {"wan": tiny_wan, "flux": tiny_model_dir}[model]
    path = tmp_path / out
    assert main(["generate", "--model", str(directory), "--prompt", "x", "--device", "cpu",
                 "--out", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--out {path}" in err and hint in err
    assert not path.exists()


def test_an_image_model_still_writes_a_png(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    from PIL import Image

    out = tmp_path / "fox.png"
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "a fox", "--seed", "1",
                 "--device", "cpu", "--out", str(out)]) == 0
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size == (64, 64)



def test_a_frame_rate_for_an_image_is_refused_before_loading(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "fox.png"
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "a fox", "--fps", "16",
                 "--device", "cpu", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--fps 16" in err and "no frame rate" in err and not out.exists()


@pytest.fixture(scope="module")
def tiny_cosmos3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ditserve.engine.makers.tiny_model import init_tiny

    return init_tiny(tmp_path_factory.mktemp("models") / "tiny-cosmos3", family="cosmos3")


@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """What is refused must be refused before the model loads (minutes on a real one)."""
    from ditserve.engine.loop import engine

    def refuse(*_a: object, **_kw: object) -> None:
        raise AssertionError("the model was loaded for a request the flags already refuse")

    monkeypatch.setattr(engine.DiffusionEngine, "__init__", refuse)


@pytest.mark.parametrize(("flags", "named"), [
    (["--fps", "0"], "--fps 0: must be in [1, 240]"),
    (["--fps", "241"], "--fps 241: must be in [1, 240]"),
    (["--audio", "--fps", "12"], "plays at the model's 24 fps"),
    (["--image", "IMAGE", "--num-frames", "1"], "does not use the input image"),
])
def test_video_flags_that_cannot_be_honoured_are_refused_before_loading(
    tiny_cosmos3: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_loading: None,
    flags: list[str], named: str,
) -> None:
    from PIL import Image

    image = tmp_path / "red.png"
    Image.new("RGB", (64, 64), "red").save(image)
    out = tmp_path / "clip.mp4"
    argv = ["generate", "--model", str(tiny_cosmos3), "--prompt", "waves", "--device", "cpu",
            "--out", str(out), *(str(image) if f == "IMAGE" else f for f in flags)]
    assert main(argv) == 2
    assert named in capsys.readouterr().err and not out.exists()


def test_an_input_image_for_a_still_image_is_refused_before_loading(
    tiny_cosmos3: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_loading: None,
) -> None:
    from PIL import Image

    image = tmp_path / "red.png"
    Image.new("RGB", (64, 64), "red").save(image)
    assert main(["generate", "--model", str(tiny_cosmos3), "--prompt", "waves", "--image",
                 str(image), "--device", "cpu", "--out", str(tmp_path / "still.png")]) == 2
    assert "does not use the input image" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["a-directory.png", "a-file/fox.png"])
def test_an_out_path_that_cannot_be_written_is_refused_before_loading(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_loading: None,
    where: str,
) -> None:
    (tmp_path / "a-directory.png").mkdir()
    (tmp_path / "a-file").write_text("")
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "a fox",
                 "--device", "cpu", "--out", str(tmp_path / where)]) == 2
    err = capsys.readouterr().err
    assert f"--out {tmp_path / where}" in err and "Traceback" not in err


@pytest.mark.parametrize(("flags", "said"), [
    (["--num-images", "9"], "error: --num-images: must be an integer in [1, 8], got 9"),
    (["--steps", "0"], "error: --steps: must be an integer in [1, 1000], got 0"),
    (["--lora", "style.safetensors"], "error: --lora takes NAME=PATH[:SCALE]"),
    (["--model", "A-FILE", "--base-model", "no-such-dir"], "error: --base-model 'no-such-dir'"),
])
def test_errors_name_the_flag_that_was_typed(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    flags: list[str], said: str,
) -> None:
    checkpoint = tmp_path / "dit.safetensors"
    checkpoint.write_bytes(b"")
    argv = ["generate", "--model", str(tiny_model_dir), "--prompt", "a fox", "--device", "cpu",
            "--out", str(tmp_path / "fox.png"),
            *(str(checkpoint) if f == "A-FILE" else f for f in flags)]
    assert main(argv) == 2
    assert said in capsys.readouterr().err


def test_inspect_on_a_directory_says_it_is_one(tiny_model_dir: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "inspect", str(tiny_model_dir)]) == 2
    assert "is a directory, not a checkpoint file" in capsys.readouterr().err


def test_true_cfg_on_a_model_whose_cfg_is_guidance_scale_is_refused_not_ignored(
    tiny_wan: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "waves.mp4"
    assert main(["generate", "--model", str(tiny_wan), "--prompt", "waves", "--device", "cpu",
                 "--negative-prompt", "blur", "--true-cfg-scale", "7", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--true-cfg-scale: this model has no true CFG" in err and "guidance_scale" in err
    assert not out.exists()
