"""POST /v1/images/edits on a real server process serving the tiny Qwen-Image-Edit Plus model:
the official OpenAI SDK's ``images.edit`` with a list of two images (sent as ``image[]``),
the model's image count as a 400 past it, and the route in /openapi.json: a multipart form
(JSON Schema 2020-12) that takes what the server takes and refuses what it refuses, present
on an editing replica only."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types import ImagesResponse
from PIL import Image
from server.test_image_edits import png  # type: ignore[import-not-found]


@pytest.fixture(scope="module")
def edit_server(tmp_path_factory: pytest.TempPathFactory, launch_server) -> Iterator[Any]:  # type: ignore[no-untyped-def]
    from ditserve.engine.makers.tiny_model import init_tiny

    tmp = tmp_path_factory.mktemp("qwen-edit-server")
    model = init_tiny(tmp / "model", family="qwen-image-edit-plus")
    config = tmp / "engine.yaml"
    config.write_text(f"model: {model}\ndevice: cpu\nscheduler: {{max_num_seqs: 2}}\n"
                      "server: {max_side: 128, max_steps: 4}\n")
    proc = launch_server(tmp, "--config", str(config))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(edit_server) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{edit_server.url}/v1", api_key="unused", max_retries=0,
                         timeout=300)


def test_sdk_edit_from_two_images(client) -> None:  # type: ignore[no-untyped-def]
    response = client.images.edit(
        image=[("cat.png", png(96, 64), "image/png"),
               ("sofa.png", png(64, 80, (30, 30, 160)), "image/png")],
        prompt="the cat of picture 1 on the sofa of picture 2", size="64x96",
        extra_body={"num_inference_steps": 1, "seed": 2, "negative_prompt": " ",
                    "true_cfg_scale": 2.0})
    assert isinstance(response, ImagesResponse)
    assert response.size == "64x96"
    (image,) = response.data
    assert Image.open(io.BytesIO(base64.b64decode(image.b64_json))).size == (64, 96)


def test_more_images_than_the_model_takes_is_a_400(client) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(openai.BadRequestError) as error:
        client.images.edit(image=[(f"{i}.png", png(32, 32), "image/png") for i in range(4)],
                           prompt="merge them")
    assert error.value.body["param"] == "image"
    assert "at most 3 input images" in error.value.body["message"]


def test_the_route_is_documented_as_a_multipart_form(edit_server) -> None:  # type: ignore[no-untyped-def]
    doc = httpx.get(f"{edit_server.url}/openapi.json").json()
    operation = doc["paths"]["/v1/images/edits"]["post"]
    body = operation["requestBody"]["content"]["multipart/form-data"]
    assert body["schema"] == {"$ref": "#/components/schemas/ImageEditForm"}
    assert set(operation["responses"]) >= {"200", "400", "413", "429"}
    streamed = operation["responses"]["200"]["content"]["text/event-stream"]["schema"]
    assert "image_edit.completed" in streamed["properties"]["event"]["enum"]
    form = doc["components"]["schemas"]["ImageEditForm"]
    jsonschema.Draft202012Validator.check_schema(form)
    validator = jsonschema.Draft202012Validator(form)
    assert form["properties"]["image[]"]["maxItems"] == 3  # the model's count
    taken = {"prompt": "make it red", "image[]": ["a", "b"], "n": 2, "size": "64x64",
             "num_inference_steps": 2, "loras": "style:0.5", "stream": True}
    assert validator.is_valid(taken)
    refused = [{"image": "a"},  # no prompt
               {"prompt": "x"},  # no image
               {"prompt": "x", "image": "a", "image[]": ["b"]},  # both spellings
               {"prompt": "x", "image[]": ["a"] * 4},  # past the model's count
               {"prompt": "x", "image": "a", "size": "65x64"},  # off the pixel grid
               {"prompt": "x", "image": "a", "mask": "m"}]  # inpainting
    assert not [f for f in refused if validator.is_valid(f)]


def test_an_edit_only_replica_serves_no_text_to_image(edit_server, client) -> None:  # type: ignore[no-untyped-def]
    card = httpx.get(f"{edit_server.url}/v1/models").json()["data"][0]
    assert card["ditserve"]["images"] is False  # /v1/images/generations is not served
    assert "/v1/images/generations" not in httpx.get(f"{edit_server.url}/openapi.json").json()["paths"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.generate(prompt="a fox", size="64x64")
    assert refused.value.body["code"] == "unsupported_model"
    assert "/v1/images/edits" in refused.value.body["message"]


def test_a_text_to_image_replica_leaves_the_route_out(server) -> None:  # type: ignore[no-untyped-def]
    doc = httpx.get(f"{server.url}/openapi.json").json()
    assert "/v1/images/generations" in doc["paths"]
    assert "/v1/images/edits" not in doc["paths"]
    assert "ImageEditForm" not in doc["components"]["schemas"]
