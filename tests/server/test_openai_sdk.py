"""The official OpenAI Python SDK against the default server: images.generate (n 1 and 2),
image streaming with partial images in the SDK's typed events, models, and the SDK's error
classes for 400 and 404 (401 and 429: test_admission.py, whose server has auth and a
one-slot queue). Every object the API returns validates strictly (``model_validate(...,
strict=True)``) against the SDK's own model, raw JSON and each stream event alike."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
from openai.types import (
    ImageGenCompletedEvent,
    ImageGenPartialImageEvent,
    ImagesResponse,
    Model,
)
from PIL import Image

from ditserve.engine.server.streaming import parse_sse


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def png_size(b64: str) -> tuple[int, int]:
    return Image.open(io.BytesIO(base64.b64decode(b64))).size


@pytest.mark.parametrize("n", [1, 2])
def test_generate(client, n) -> None:
    response = client.images.generate(prompt="a red fox in snow", n=n)
    assert isinstance(response, ImagesResponse)
    assert len(response.data) == n
    assert all(png_size(image.b64_json) == (64, 64) for image in response.data)  # tiny default
    assert (response.size, response.output_format) == ("64x64", "png")
    assert response.usage.output_tokens == n * 256 == response.usage.total_tokens


def test_stream_with_partial_images(client) -> None:
    stream = client.images.generate(prompt="a fox", size="32x32", stream=True,
                                    partial_images=2, extra_body={"num_inference_steps": 6})
    events = list(stream)
    # Code that filters the SDK's events by type sees only OpenAI's, each with its image.
    partial = [e for e in events if isinstance(e, ImageGenPartialImageEvent)]
    completed = [e for e in events if isinstance(e, ImageGenCompletedEvent)]
    assert len(partial) + len(completed) == 3
    assert [e.partial_image_index for e in partial] == [0, 1]
    assert all(png_size(e.b64_json) == (32, 32) and e.size == "32x32" for e in partial)
    (final,) = completed
    assert events[-1] is final
    assert png_size(final.b64_json) == (32, 32)
    assert (final.output_format, final.usage.output_tokens) == ("png", 64)
    # ditserve's own progress events pass through untyped: JSON arrays, one per step.
    progress = [e for e in events if isinstance(e, list)]
    assert progress[0][0] == "queued"
    assert [e[1] for e in progress if e[0] == "step"] == [1, 2, 3, 4, 5, 6]


def test_every_answer_validates_strictly_against_the_sdks_models(server) -> None:
    plain = httpx.post(f"{server.url}/v1/images/generations",
                       json={"prompt": "a fox", "n": 2, "quality": "high"}, timeout=60)
    assert plain.status_code == 200
    response = ImagesResponse.model_validate(plain.json(), strict=True)
    assert response.quality is None and response.background == "opaque"
    streamed = httpx.post(f"{server.url}/v1/images/generations", timeout=60, json={
        "prompt": "a fox", "stream": True, "partial_images": 1, "num_inference_steps": 2})
    events = parse_sse(streamed.text)
    by_type = {"image_generation.partial_image": ImageGenPartialImageEvent,
               "image_generation.completed": ImageGenCompletedEvent}
    for kind, data in events:
        if kind in by_type:
            assert by_type[kind].model_validate(data, strict=True).type == kind
        else:  # ditserve's own: never an object the SDK would read as an image event
            assert kind.startswith("ditserve.") and isinstance(data, list), (kind, data)
            assert all(not isinstance(value, (dict, list)) for value in data)
    assert [kind for kind, _ in events][-1] == "image_generation.completed"
    for body in (httpx.get(f"{server.url}/v1/models").json()["data"][0],
                 httpx.get(f"{server.url}/v1/models/ditserve-tiny-flux").json()):
        assert Model.model_validate(body, strict=True).id == "ditserve-tiny-flux"


def test_models(client) -> None:
    assert [m.id for m in client.models.list()] == ["ditserve-tiny-flux"]
    assert client.models.retrieve("ditserve-tiny-flux").owned_by == "ditserve"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-image-1")


def test_error_classes(client) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.images.generate(prompt="a fox", size="30x30")
    assert bad.value.body["param"] == "size" and bad.value.body["code"] == "invalid_value"
    with pytest.raises(openai.BadRequestError) as unknown:
        client.images.generate(prompt="a fox", extra_body={"colour": "red"})
    assert unknown.value.body["code"] == "unknown_field"
    assert "supported fields: prompt" in unknown.value.body["message"]
    with pytest.raises(openai.BadRequestError) as spelled:  # any spelling is named as sent
        client.images.generate(prompt="a fox", extra_body={"Colour-2": "red"})
    assert spelled.value.body["param"] == "Colour-2"
    with pytest.raises(openai.BadRequestError) as nested_spelled:
        client.images.generate(prompt="a fox", extra_body={"loras": [{"name": "a", "Foo": 1}]})
    assert nested_spelled.value.body["param"] == "loras[0].Foo"
    # Inside a list of objects: the entry and the field are named, not the body's fields.
    with pytest.raises(openai.BadRequestError) as nested:
        client.images.generate(prompt="a fox", extra_body={"loras": [{"name": "a", "foo": 1}]})
    assert nested.value.body["param"] == "loras[0].foo"
    assert nested.value.body["code"] == "unknown_field"
    assert "supported fields" not in nested.value.body["message"]
    with pytest.raises(openai.BadRequestError) as nameless:
        client.images.generate(prompt="a fox", extra_body={"loras": [{"scale": 1}]})
    assert nameless.value.body["param"] == "loras[0].name"
    assert nameless.value.body["code"] == "missing_field"
    with pytest.raises(openai.NotFoundError) as missing:
        client.images.generate(prompt="a fox", model="dall-e-3")
    assert missing.value.body["code"] == "model_not_found"
    assert missing.value.response.headers["x-request-id"]
