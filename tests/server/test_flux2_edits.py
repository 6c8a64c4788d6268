"""FLUX.2 over HTTP on a real server process serving the tiny FLUX.2 [dev] model: the OpenAI
SDK's ``images.edit`` with two reference images and ``images.generate`` without one, both on
the same replica (text-to-image and multi-reference editing are one model)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from PIL import Image
from server.test_image_edits import png  # type: ignore[import-not-found]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, launch_server) -> Iterator[Any]:  # type: ignore[no-untyped-def]
    from ditserve.engine.makers.tiny_model import init_tiny

    tmp = tmp_path_factory.mktemp("flux2-server")
    model = init_tiny(tmp / "model", family="flux2")
    config = tmp / "engine.yaml"
    config.write_text(f"model: {model}\ndevice: cpu\nscheduler: {{max_num_seqs: 2}}\n"
                      "server: {max_side: 128, max_steps: 4}\n")
    proc = launch_server(tmp, "--config", str(config))
    yield openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0, timeout=300)
    proc.stop()


def _size(b64: str | None) -> tuple[int, int]:
    assert b64 is not None
    return Image.open(io.BytesIO(base64.b64decode(b64))).size  # type: ignore[no-any-return]


def test_edit_from_two_references_and_plain_generation(client) -> None:  # type: ignore[no-untyped-def]
    edit = client.images.edit(
        image=[("cat.png", png(96, 64), "image/png"),
               ("sofa.png", png(64, 80, (30, 30, 160)), "image/png")],
        prompt="the cat of image 1 on the sofa of image 2", size="64x96",
        extra_body={"num_inference_steps": 2, "seed": 2})
    assert _size(edit.data[0].b64_json) == (64, 96)
    plain = client.images.generate(prompt="a red fox", size="64x64",
                                   extra_body={"num_inference_steps": 2, "seed": 3})
    assert _size(plain.data[0].b64_json) == (64, 64)


@pytest.mark.parametrize(("width", "height", "reason"), [
    (32, 64, "at least 64 pixels a side"), (72, 600, "aspect ratios up to 8:1")])
def test_a_reference_diffusers_refuses_is_a_400(client, width: int, height: int,  # type: ignore[no-untyped-def]
                                               reason: str) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.images.edit(image=[("bad.png", png(width, height), "image/png")], prompt="x",
                           size="64x64", extra_body={"num_inference_steps": 1})
    assert error.value.body["param"] == "image"
    assert reason in error.value.body["message"]


def test_an_edit_over_the_request_bound_by_its_references_is_a_400(client) -> None:  # type: ignore[no-untyped-def]
    """The references' tokens count toward --max-request-tokens: a 64x64 target (a few
    hundred tokens) with four 512x512 references (16384 tokens each on the tiny model's
    4-pixel tokens) is past the default bound of four step budgets (32768)."""
    with pytest.raises(openai.BadRequestError) as error:
        client.images.edit(image=[(f"r{i}.png", png(512, 512), "image/png") for i in range(4)],
                           prompt="x", size="64x64", extra_body={"num_inference_steps": 1})
    # The references are nearly all of the work: the field to change is the images, not size.
    assert error.value.body["param"] == "image"
    assert "input images" in error.value.body["message"]
