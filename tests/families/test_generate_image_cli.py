"""`ditserve generate --image`: an edit on the tiny FLUX.1 Kontext model, an edit from two images
on the tiny Qwen-Image-Edit Plus model (--image repeated) and an image-to-video
run on the tiny Wan I2V model write their outputs, as Z-Image's image-to-image and inpainting
(--mask, --strength) do; a bad image is a clean error naming it."""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from ditserve.engine.cli.main import main


def write_png(path: Path, size: tuple[int, int]) -> Path:
    image = Image.new("RGB", size, (40, 90, 200))
    for x in range(size[0]):
        image.putpixel((x, x % size[1]), (250, 200, 10))
    image.save(path)
    return path


def test_edit_and_image_to_video(family_dir, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    source = write_png(tmp_path / "in.png", (90, 60))
    out = tmp_path / "edit.png"
    assert main(["generate", "--model", str(family_dir("flux-kontext")), "--device", "cpu",
                 "--image", str(source), "--prompt", "make it red", "--height", "64",
                 "--width", "96", "--steps", "1", "--seed", "1", "--out", str(out)]) == 0
    assert Image.open(out).size == (96, 64)
    video = tmp_path / "clip.mp4"
    assert main(["generate", "--model", str(family_dir("wan-i2v")), "--device", "cpu",
                 "--image", str(source), "--prompt", "it moves", "--height", "32",
                 "--width", "32", "--num-frames", "5", "--steps", "1", "--out",
                 str(video)]) == 0
    assert video.stat().st_size > 0
    assert "saved" in capsys.readouterr().out


def test_a_bad_image_is_a_clean_error(family_dir, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "notes.png"
    bad.write_text("not an image")
    code = main(["generate", "--model", str(family_dir("flux-kontext")), "--device", "cpu",
                 "--image", str(bad), "--prompt", "x"])
    assert code != 0
    assert "not a PNG, JPEG or WebP" in capsys.readouterr().err
    missing = main(["generate", "--model", str(family_dir("flux-kontext")), "--device", "cpu",
                    "--image", str(tmp_path / "nope.png"), "--prompt", "x"])
    assert missing != 0


def test_an_edit_from_several_images(family_dir, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    first = write_png(tmp_path / "cat.png", (80, 60))
    second = write_png(tmp_path / "sofa.png", (60, 90))
    out = tmp_path / "edit.png"
    model = str(family_dir("qwen-image-edit-plus"))
    assert main(["generate", "--model", model, "--device", "cpu", "--image", str(first),
                 "--image", str(second), "--prompt", "the cat on the sofa", "--height", "32",
                 "--width", "48", "--steps", "1", "--seed", "1", "--out", str(out)]) == 0
    assert Image.open(out).size == (48, 32)
    assert "saved" in capsys.readouterr().out
    # The single-image edit model says how many it takes.
    code = main(["generate", "--model", str(family_dir("qwen-image-edit")), "--device", "cpu",
                 "--image", str(first), "--image", str(second), "--prompt", "x",
                 "--steps", "1"])
    assert code != 0
    assert "at most 1 input image" in capsys.readouterr().err


def test_z_image_inpainting_from_the_cli(family_dir, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    source = write_png(tmp_path / "src.png", (64, 32))
    mask = Image.new("L", (64, 32), 0)
    mask.paste(255, (0, 0, 32, 32))  # white: repaint the left half
    mask.save(tmp_path / "mask.png")
    outs = {}
    for name, extra in (("img2img", []), ("inpaint", ["--mask", str(tmp_path / "mask.png")])):
        outs[name] = tmp_path / f"{name}.png"
        assert main(["generate", "--model", str(family_dir("z-image")), "--device", "cpu",
                     "--image", str(source), "--prompt", "a boat", "--height", "32",
                     "--width", "64", "--steps", "3", "--seed", "1", "--strength", "0.9",
                     "--out", str(outs[name]), *extra]) == 0
        assert Image.open(outs[name]).size == (64, 32)
    assert Image.open(outs["img2img"]).tobytes() != Image.open(outs["inpaint"]).tobytes()
    assert "saved" in capsys.readouterr().out
