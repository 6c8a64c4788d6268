"""POST /v1/images/edits on a real server process serving the tiny FLUX.1 Kontext model: the
official OpenAI SDK's ``images.edit`` (one image, a list sent as ``image[]``, streaming with
the SDK's typed ``image_edit.*`` events), and every refusal a client can meet: mask, too many
images, not an image, a decompression bomb, a body over the upload limit, a text-to-image
replica; EXIF orientation applied before the size is derived."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types import ImageEditCompletedEvent, ImageEditPartialImageEvent, ImagesResponse
from PIL import Image

from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.media.image_input import decode_image

UPLOAD_LIMIT = 200_000


def png(width: int, height: int, colour: tuple[int, int, int] = (200, 40, 40)) -> bytes:
    image = Image.new("RGB", (width, height), colour)
    for x in range(0, width, 7):  # some structure, so the VAE has something to encode
        image.putpixel((x, (x * 3) % height), (10, 200, 90))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def rotated_jpeg(width: int, height: int) -> bytes:
    """A JPEG stored width x height whose EXIF orientation (6) says: turn it 90 degrees."""
    image = Image.new("RGB", (width, height), (90, 90, 200))
    exif = Image.Exif()
    exif[0x0112] = 6
    out = io.BytesIO()
    image.save(out, format="JPEG", exif=exif.tobytes())
    return out.getvalue()


def size_of(b64: str) -> tuple[int, int]:
    return Image.open(io.BytesIO(base64.b64decode(b64))).size


@pytest.fixture(scope="module")
def kontext_server(tmp_path_factory: pytest.TempPathFactory, launch_server) -> Iterator[object]:  # type: ignore[no-untyped-def]
    from ditserve.engine.makers.tiny_model import init_tiny

    tmp = tmp_path_factory.mktemp("kontext-server")
    model = init_tiny(tmp / "model", family="flux-kontext")
    config = tmp / "engine.yaml"
    config.write_text(
        f"model: {model}\ndevice: cpu\nscheduler: {{max_num_seqs: 2}}\n"
        f"server: {{max_side: 128, max_steps: 4, max_upload_bytes: {UPLOAD_LIMIT},\n"
        "          max_image_pixels: 4000000}\n")
    proc = launch_server(tmp, "--config", str(config))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(kontext_server) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{kontext_server.url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def test_sdk_edit_one_image(client) -> None:  # type: ignore[no-untyped-def]
    response = client.images.edit(image=("cat.png", png(140, 100), "image/png"),
                                  prompt="make the cat red", n=2,
                                  extra_body={"num_inference_steps": 2, "seed": 3})
    assert isinstance(response, ImagesResponse)
    assert len(response.data) == 2
    # size "auto": the source's aspect ratio (1.4) at the default 64x64 area, on the 32 grid
    assert response.size == "64x32"
    assert all(size_of(image.b64_json) == (64, 32) for image in response.data)
    assert response.usage.output_tokens == 2 * 2


def test_sdk_edit_with_size_and_a_list_refused_past_the_models_count(client) -> None:  # type: ignore[no-untyped-def]
    one = client.images.edit(image=[("a.png", png(64, 64), "image/png")], prompt="a hat",
                             size="96x64", extra_body={"num_inference_steps": 1})
    assert size_of(one.data[0].b64_json) == (96, 64)
    with pytest.raises(openai.BadRequestError) as error:
        client.images.edit(image=[("a.png", png(64, 64), "image/png"),
                                  ("b.png", png(64, 64), "image/png")], prompt="merge them")
    assert error.value.body["param"] == "image"
    assert "at most 1 input image" in error.value.body["message"]


def test_sdk_edit_stream_has_typed_events(client) -> None:  # type: ignore[no-untyped-def]
    stream = client.images.edit(image=("a.png", png(64, 64), "image/png"), prompt="a fox",
                                stream=True, partial_images=1, size="64x64",
                                extra_body={"num_inference_steps": 4})
    events = list(stream)
    typed = [e for e in events if not isinstance(e, list)]
    partial = [e for e in typed if e.type == "image_edit.partial_image"]
    (final,) = [e for e in typed if e.type == "image_edit.completed"]
    assert [type(e) for e in partial] == [ImageEditPartialImageEvent]
    assert isinstance(final, ImageEditCompletedEvent) and events[-1] is final
    assert size_of(final.b64_json) == (64, 64)
    # ditserve's own progress messages pass through untyped: JSON arrays, one per step.
    progress = [e for e in events if isinstance(e, list)]
    assert [e[1] for e in progress if e[0] == "step"] == [1, 2, 3, 4]


def test_exif_orientation_is_applied(client) -> None:  # type: ignore[no-untyped-def]
    # Stored 128 wide x 64 high, shown upright 64 x 128: the auto size follows the upright one.
    response = client.images.edit(image=("p.jpg", rotated_jpeg(128, 64), "image/jpeg"),
                                  prompt="x", extra_body={"num_inference_steps": 1})
    assert response.size == "32x64"
    decoded = decode_image(rotated_jpeg(128, 64))
    assert (decoded.width, decoded.height) == (64, 128)


def test_sdk_edit_in_the_output_format_asked_for_and_openais_values_checked(client) -> None:  # type: ignore[no-untyped-def]
    response = client.images.edit(image=("cat.png", png(64, 64), "image/png"), prompt="red",
                                  output_format="webp", input_fidelity="high",
                                  extra_body={"num_inference_steps": 1})
    assert response.output_format == "webp"
    image = Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json)))
    assert (image.format, image.size) == ("WEBP", (64, 64))
    for field, value in (("input_fidelity", "medium"), ("output_format", "gif")):
        with pytest.raises(openai.BadRequestError) as error:
            client.images.edit(image=("cat.png", png(64, 64), "image/png"), prompt="red",
                               extra_body={field: value})
        assert error.value.body["param"] == field and repr(value) in error.value.body["message"]


def _post(server, files: dict[str, object], data: dict[str, str] | None = None) -> httpx.Response:  # type: ignore[no-untyped-def]
    return httpx.post(f"{server.url}/v1/images/edits", files=files,
                      data=data or {"prompt": "x"}, timeout=120)


@pytest.mark.parametrize(("files", "param", "code", "words"), [
    ({"image": ("a.png", png(64, 64)), "mask": ("m.png", png(64, 64))}, "mask",
     "unsupported_value", "masked edits"),
    ({"image": ("a.txt", b"hello, not an image")}, "image", "invalid_image",
     "not a PNG, JPEG or WebP"),
    ({"image": ("a.png", png(64, 64)[:60])}, "image", "invalid_image", "could not be decoded"),
    ({"n": (None, "1")}, "image", "missing_field", "is required"),
    # their order across the two names would be lost ('picture 1' of a Plus prompt)
    ({"image[]": ("a.png", png(64, 64)), "image": ("b.png", png(64, 64))}, "image",
     "invalid_value", "not both"),
])
def test_refusals_are_400s_naming_the_field(kontext_server, files, param, code, words) -> None:  # type: ignore[no-untyped-def]
    response = _post(kontext_server, files)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code)
    assert words in error["message"]


def test_a_decompression_bomb_is_refused_before_decoding(kontext_server) -> None:  # type: ignore[no-untyped-def]
    bomb = io.BytesIO()
    Image.new("L", (3000, 3000)).save(bomb, format="PNG")  # 9 MP in a few kilobytes
    assert len(bomb.getvalue()) < 50_000
    response = _post(kontext_server, {"image": ("bomb.png", bomb.getvalue())})
    assert response.status_code == 400
    assert "at most 4000000 pixels" in response.json()["error"]["message"]
    with pytest.raises(InvalidRequestError, match="at most 1000 pixels"):
        decode_image(bomb.getvalue(), max_pixels=1000)


def test_a_body_over_the_upload_limit_is_413(kontext_server) -> None:  # type: ignore[no-untyped-def]
    response = _post(kontext_server, {"image": ("big.png", b"\0" * (UPLOAD_LIMIT + 1))})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "body_too_large"


def test_a_text_to_image_replica_says_so(server) -> None:  # type: ignore[no-untyped-def]
    response = _post(server, {"image": ("a.png", png(64, 64))})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "unsupported_model"
    assert "text only" in response.json()["error"]["message"]



def test_sdk_edit_with_step_cache_in_extra_body(client) -> None:  # type: ignore[no-untyped-def]
    """The SDK sends extra_body's objects as bracketed form keys (step_cache[policy]); they
    were refused as unknown fields. Tiny and very wide sources edit too (they were a 500)."""
    for width, height in ((1, 1), (64, 8)):
        response = client.images.edit(
            image=("s.png", png(width, height), "image/png"), prompt="x", size="32x32",
            extra_body={"num_inference_steps": 2, "seed": 1,
                        "step_cache": {"policy": "every", "every": 2}})
        assert size_of(response.data[0].b64_json) == (32, 32)


def test_a_truncated_form_is_invalid_multipart(kontext_server) -> None:  # type: ignore[no-untyped-def]
    boundary = "b0undary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\nx\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; "
            "filename=\"a.png\"\r\nContent-Type: image/png\r\n\r\n").encode() + png(64, 64)[:40]
    response = httpx.post(f"{kontext_server.url}/v1/images/edits", content=body, headers={
        "Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_multipart"
