"""POST /v1/images/edits on a real server process serving the tiny Z-Image model: one replica
answers generations, image-to-image and inpainting with OpenAI's transparent-PNG ``mask``
(the official SDK's ``images.edit``); the answers equal the engine's own run of the same
request (the mask decoded to white-where-transparent); ``strength`` shortens the run."""

from __future__ import annotations

import base64
import dataclasses
import io
from collections.abc import Iterator

import numpy as np
import openai
import pytest
from PIL import Image

from ditserve.engine.media.image_input import decode_image, decode_mask


def png(width: int, height: int) -> bytes:
    rng = np.random.default_rng(5)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def transparent_mask(width: int, height: int) -> bytes:
    """OpenAI's mask: opaque everywhere but a transparent left half (repaint there)."""
    alpha = np.full((height, width), 255, dtype=np.uint8)
    alpha[:, : width // 2] = 0
    rgba = np.dstack([np.zeros((height, width, 3), dtype=np.uint8), alpha])
    out = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(out, format="PNG")
    return out.getvalue()


def pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


@pytest.fixture(scope="module")
def zimage(tmp_path_factory: pytest.TempPathFactory, launch_server) -> Iterator[object]:  # type: ignore[no-untyped-def]
    from ditserve.engine.makers.tiny_model import init_tiny

    tmp = tmp_path_factory.mktemp("z-image-server")
    model = init_tiny(tmp / "model", family="z-image")
    config = tmp / "engine.yaml"
    config.write_text(f"model: {model}\ndevice: cpu\nscheduler: {{max_num_seqs: 2}}\n"
                      "server: {max_side: 128, max_steps: 8}\n")
    proc = launch_server(tmp, "--config", str(config))
    proc.model = model  # type: ignore[attr-defined]
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(zimage) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{zimage.url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def engine_run(model, params):  # type: ignore[no-untyped-def]
    from ditserve.engine.config import EngineConfig
    from ditserve.engine.loop.engine import DiffusionEngine

    engine = DiffusionEngine(EngineConfig(model=str(model), device="cpu")).start()
    try:
        return engine.add_request(params).result(timeout=120).images[0]
    finally:
        engine.shutdown()


def test_one_replica_generates_and_edits_with_a_transparent_mask(zimage, client) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.request import SamplingParams

    generated = client.images.generate(prompt="a lake", size="64x32",
                                       extra_body={"num_inference_steps": 2, "seed": 1})
    assert pixels(generated.data[0].b64_json).shape == (32, 64, 3)
    source, mask = png(64, 32), transparent_mask(64, 32)
    common = {"num_inference_steps": 4, "seed": 9, "guidance_scale": 0.0}
    edited = client.images.edit(image=("src.png", source, "image/png"), prompt="a red boat",
                                size="64x32", extra_body=common)
    inpainted = client.images.edit(image=("src.png", source, "image/png"),
                                   mask=("mask.png", mask, "image/png"), prompt="a red boat",
                                   size="64x32", extra_body={**common, "strength": 0.9})
    base = SamplingParams(prompt="a red boat", height=32, width=64, num_inference_steps=4,
                          seed=9, guidance_scale=0.0, images=(decode_image(source),))
    want_edit = engine_run(zimage.model, base)  # strength: the model's 0.6
    want_inpaint = engine_run(zimage.model, dataclasses.replace(
        base, mask=decode_mask(mask), strength=0.9))
    assert np.array_equal(pixels(edited.data[0].b64_json), np.asarray(want_edit))
    assert np.array_equal(pixels(inpainted.data[0].b64_json), np.asarray(want_inpaint))
    assert not np.array_equal(np.asarray(want_edit), np.asarray(want_inpaint))


def test_transparent_pixels_are_the_region_to_repaint() -> None:
    mask = np.asarray(Image.frombytes("RGB", (64, 32), decode_mask(transparent_mask(64, 32)).rgb))
    assert (mask[:, :32] == 255).all() and (mask[:, 32:] == 0).all()


def test_strength_is_checked(client) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(openai.BadRequestError) as error:
        client.images.edit(image=("src.png", png(32, 32), "image/png"), prompt="x",
                           size="32x32", extra_body={"strength": 1.5})
    assert error.value.body["param"] == "strength"


def test_the_form_documents_mask_and_strength(zimage) -> None:  # type: ignore[no-untyped-def]
    import httpx
    import jsonschema

    form = httpx.get(f"{zimage.url}/openapi.json").json()["components"]["schemas"][
        "ImageEditForm"]
    validator = jsonschema.Draft202012Validator(form)
    assert validator.is_valid({"prompt": "x", "image": "a", "mask": "m", "strength": 0.5})
    assert not validator.is_valid({"prompt": "x", "image": "a", "strength": 2})
    assert form["properties"]["image[]"]["maxItems"] == 1


def test_progress_counts_the_steps_strength_keeps(zimage) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.config import EngineConfig
    from ditserve.engine.loop.engine import DiffusionEngine
    from ditserve.engine.request import SamplingParams

    events = []
    engine = DiffusionEngine(EngineConfig(model=str(zimage.model), device="cpu")).start()
    try:
        params = SamplingParams(prompt="a boat", height=32, width=32, num_inference_steps=8,
                                seed=1, images=(decode_image(png(32, 32)),))
        # The model's default strength 0.6: diffusers runs 5 of the 8 steps.
        engine.add_request(params, on_event=events.append).result(timeout=120)
    finally:
        engine.shutdown()
    assert {e.total_steps for e in events} == {5}
    assert [e.step for e in events if e.kind == "step"] == [1, 2, 3, 4, 5]


def test_max_sequence_length_in_the_edit_form_is_a_number(client) -> None:  # type: ignore[no-untyped-def]
    # The form's text "64" is typed as the JSON body's integer (it was left a string: 400).
    edited = client.images.edit(image=("src.png", png(32, 32), "image/png"), prompt="x",
                                size="32x32", extra_body={"max_sequence_length": 64,
                                                          "num_inference_steps": 1})
    assert len(edited.data) == 1
    with pytest.raises(openai.BadRequestError) as error:
        client.images.edit(image=("src.png", png(32, 32), "image/png"), prompt="x",
                           size="32x32", extra_body={"max_sequence_length": 0})
    assert error.value.body["param"] == "max_sequence_length"
    assert "[1, " in error.value.body["message"]


def test_a_mask_of_another_shape_is_refused(client) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(openai.BadRequestError) as error:
        client.images.edit(image=("src.png", png(64, 32), "image/png"),
                           mask=("mask.png", transparent_mask(32, 32), "image/png"),
                           prompt="x", size="64x32", extra_body={"num_inference_steps": 1})
    assert error.value.body["param"] == "mask"
    assert "64x32" in error.value.body["message"]
    # A scaled copy of the image's shape is resized to the output, as before.
    scaled = client.images.edit(image=("src.png", png(64, 32), "image/png"),
                                mask=("mask.png", transparent_mask(32, 16), "image/png"),
                                prompt="x", size="64x32", extra_body={"num_inference_steps": 1})
    assert len(scaled.data) == 1


def test_two_source_images_are_refused_by_name(client) -> None:  # type: ignore[no-untyped-def]
    two = [("a.png", png(32, 32), "image/png"), ("b.png", png(32, 32), "image/png")]
    with pytest.raises(openai.BadRequestError) as error:  # no strength sent: image is the fault
        client.images.edit(image=two, prompt="x", size="32x32")
    assert error.value.body["param"] == "image" and "1" in error.value.body["message"]
    with pytest.raises(openai.BadRequestError) as error:
        client.images.edit(image=two, prompt="x", size="32x32", extra_body={"strength": 0.5})
    assert error.value.body["param"] == "image"
