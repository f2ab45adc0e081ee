"""Images in chat and Responses requests (issue 17, the Django side): the AddRequest a request
becomes on the tiny Qwen2.5-VL checkpoint (its prompt ids against transformers' own processor,
each image's offset, tokens, grid, pixel values and hash), /v1/tokenize's count, and every
refusal (400 invalid_image naming the part) through the real consumers, each followed by a
request that is still served. No engine: the consumers' submit is captured (the ``offline``
fixture of tests/api/conftest.py)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import struct

import numpy as np
import pytest
from channels.testing import ApplicationCommunicator
from django.conf import settings
from PIL import Image

from apps.api.chat.consumer import ChatCompletionsConsumer
from apps.api.chat.service import chat_prepare
from apps.api.responses.consumer import ResponsesConsumer
from apps.api.responses.service import response_parse, response_prepare
from apps.api.tokenize.service import tokenize_chat
from apps.models.services import served_model, served_model_update
from tests.helpers import assert_openai_error
from tests.models.tiny_vl import hf_processor, processor_outputs, write_tiny_qwen2_5_vl
from tests.models.tiny_vl import test_image as picture  # (a name pytest would collect)

pytestmark = pytest.mark.slow  # writes the checkpoint with transformers


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def user(*parts) -> dict:
    return {"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory, default_gguf_path):
    return write_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-vl"), default_gguf_path)


@pytest.fixture
def vl(vl_dir):
    """The tiny VL checkpoint as the served model (as the engine's status would point at it)."""
    before = served_model()
    yield served_model_update(served_id="tiny-vl", path=vl_dir)
    served_model_update(served_id=before.served_id, path=before.path)


# -- what a request becomes ------------------------------------------------------------------


def test_images_expand_to_transformers_processor_ids_and_pixels(vl, vl_dir):
    a, b = picture(100, 60, seed=1), picture(37, 90, seed=2)
    body = {"messages": [user("Compare", image_part(data_url(a)), "with", image_part(data_url(b)), "please.")]}
    prep = chat_prepare(body)
    hf = hf_processor(vl_dir)(text=[prep.prompt], images=[a, b], return_tensors="np")
    assert prep.prompt.count("<|image_pad|>") == 2  # the template's one placeholder per image
    assert prep.add.prompt_token_ids == hf["input_ids"][0].tolist()
    image_token = json.loads((vl_dir / "config.json").read_text())["image_token_id"]
    ids, images = prep.add.prompt_token_ids, prep.add.images
    assert len(images) == 2 and images[0]["offset"] < images[1]["offset"]
    rows = 0
    for entry, image, grid in zip(images, (a, b), hf["image_grid_thw"].tolist()):
        pixels, grid_thw = processor_outputs(vl_dir, image)
        assert entry["grid_thw"] == grid_thw == grid
        assert entry["num_tokens"] == grid[0] * grid[1] * grid[2] // 4
        start, end = entry["offset"], entry["offset"] + entry["num_tokens"]
        assert set(ids[start:end]) == {image_token} and ids[start - 1] != image_token and ids[end] != image_token
        got = np.frombuffer(entry["pixel_values"], dtype="<f4").reshape(pixels.shape)
        assert np.allclose(got, pixels, atol=1e-6)
        assert np.allclose(got, hf["pixel_values"][rows : rows + len(got)], atol=1e-6)
        rows += len(got)
        want = hashlib.sha256(struct.pack("<3q", *grid_thw) + entry["pixel_values"]).hexdigest()
        assert entry["hash"] == want
    assert images[0]["hash"] != images[1]["hash"]
    assert all(add.images == images for add in prep.adds)


def test_the_same_image_hashes_the_same_and_text_alone_renders_as_before(vl):
    url = data_url(picture(64, 64, seed=3))
    one = chat_prepare({"messages": [user("Describe:", image_part(url))]}).add
    two = chat_prepare({"messages": [user("Describe this one:", image_part(url))]}).add
    assert one.images[0]["hash"] == two.images[0]["hash"]
    text = chat_prepare({"messages": [{"role": "user", "content": "Describe:"}]})
    parts = chat_prepare({"messages": [user("Desc", "ribe:")]})
    assert text.add.images is None and parts.add.images is None
    assert parts.prompt == text.prompt and parts.add.prompt_token_ids == text.add.prompt_token_ids
    assert "<|vision_start|>" not in text.prompt


def test_tokenize_counts_the_expanded_placeholders(vl):
    body = {"messages": [user("What is it?", image_part(data_url(picture(90, 50))))]}
    served = chat_prepare(body).add
    counted = tokenize_chat(body)
    text_only = tokenize_chat({"messages": [user("What is it?")]})
    assert counted["tokens"] == served.prompt_token_ids and counted["count"] == len(served.prompt_token_ids)
    # the vision start/end pair and the expanded pad tokens
    assert counted["count"] == text_only["count"] + 2 + served.images[0]["num_tokens"]


def test_responses_input_image_becomes_the_same_images(vl):
    url = data_url(picture(80, 80, seed=4))
    req = response_parse({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What is it?"}, {"type": "input_image", "image_url": url, "detail": "auto"},
    ]}]})  # fmt: skip
    add = response_prepare(req, None).add
    chat = chat_prepare({"messages": [user("What is it?", image_part(url))]}).add
    assert add.prompt_token_ids == chat.prompt_token_ids and add.images == chat.images


# -- refusals, through the consumers ---------------------------------------------------------


async def _post(consumer, path: str, body: dict) -> tuple[int, dict]:
    app = ApplicationCommunicator(consumer.as_asgi(), {"type": "http", "method": "POST", "path": path, "headers": []})
    await app.send_input({"type": "http.request", "body": json.dumps(body).encode()})
    start = await app.receive_output(30)
    out = await app.receive_output(30)
    await app.wait(5)
    return start["status"], json.loads(out["body"])


class Answer:
    def __init__(self, status: int, body: dict):
        self.status_code, self._body, self.text = status, body, json.dumps(body)
        self.headers = {"content-type": "application/json"}

    def json(self) -> dict:
        return self._body


async def _served_after(submitted: list) -> None:
    """A good image request still reaches the engine (the refusal left nothing behind)."""
    good = {"messages": [user("Hi", image_part(data_url(picture(56, 56))))], "max_tokens": 2}
    app = ApplicationCommunicator(
        ChatCompletionsConsumer.as_asgi(),
        {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []},  # fmt: skip
    )
    await app.send_input({"type": "http.request", "body": json.dumps(good).encode()})
    for _ in range(600):
        if submitted:
            break
        await asyncio.sleep(0.05)
    assert submitted and submitted[-1].images and len(submitted[-1].images) == 1
    await app.send_input({"type": "http.disconnect"})
    await app.wait(5)


def _refused(body: dict, submitted: list, param: str, code: str = "invalid_image", *, path="/v1/chat/completions"):
    consumer = ChatCompletionsConsumer if path == "/v1/chat/completions" else ResponsesConsumer

    async def go():
        status, answer = await _post(consumer, path, body)
        assert not submitted  # refused before the engine heard of it
        err = assert_openai_error(Answer(status, answer), 400, code, param)
        await _served_after(submitted)
        submitted.clear()
        return err

    return asyncio.run(go())


def _bmp_url() -> str:
    return data_url(picture(30, 30), "BMP")


REFUSALS = {
    "undecodable": ("data:image/png;base64," + base64.b64encode(b"hello, not a png").decode(), "does not decode"),
    "bad base64": ("data:image/png;base64,@@@@", "base64"),
    "not an image type": ("data:text/plain;base64,aGVsbG8=", "image/*"),
    "unsupported format": (None, "Unsupported image format BMP"),
    "no fetching": ("https://example.com/cat.png", "does not fetch"),
    "file scheme": ("file:///etc/passwd", "scheme"),
    "aspect ratio": (None, "aspect ratio"),
    "truncated": (None, "truncated"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_bad_image_is_refused_naming_its_part(vl, offline, case):
    url, words = REFUSALS[case]
    if case == "unsupported format":
        url = _bmp_url()
    elif case == "aspect ratio":
        url = data_url(Image.new("RGB", (2, 600)))
    elif case == "truncated":
        buf = io.BytesIO()
        picture(200, 200).save(buf, "PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()[: len(buf.getvalue()) // 2]).decode()
    body = {"messages": [{"role": "system", "content": "Be brief."}, user("Look:", image_part(url))]}
    err = _refused(body, offline, "messages[1].content[1]")
    assert words in err["message"]


def test_more_pixels_than_the_limit_is_refused_from_the_header(vl, offline, monkeypatch):
    # 6000x6000 one-bit pixels compress to a few KB: above model.max_image_pixels (32 Mi) by its header alone
    bomb = Image.new("1", (6000, 6000))
    err = _refused({"messages": [user(image_part(data_url(bomb)), "What?")]}, offline, "messages[0].content[0]")
    assert "36000000 pixels" in err["message"] and "model.max_image_pixels" in err["message"]
    monkeypatch.setitem(settings.IGNIS, "model.max_image_pixels", 99 * 99)
    url = data_url(picture(100, 99))
    err = _refused({"messages": [user("What?", image_part(url))]}, offline, "messages[0].content[1]")
    assert "9900 pixels" in err["message"]


def test_more_images_than_the_limit_is_refused_naming_the_first_past_it(vl, offline, monkeypatch):
    monkeypatch.setitem(settings.IGNIS, "model.max_images", 1)
    url = data_url(picture(56, 56))
    body = {"messages": [user(image_part(url), "and"), {"role": "assistant", "content": "Yes."}, user(image_part(url))]}
    err = _refused(body, offline, "messages[2].content[0]")
    assert "at most 1" in err["message"]


def test_an_image_outside_a_user_message_is_refused(vl, offline):
    body = {"messages": [user("Hi"), {"role": "assistant", "content": [image_part(data_url(picture(56, 56)))]}]}
    _refused(body, offline, "messages[1].content[0]")


def test_text_spelling_the_placeholder_is_refused(vl, offline):
    body = {"messages": [user("<|image_pad|> is a token", image_part(data_url(picture(56, 56))))]}
    err = _refused(body, offline, "messages", "invalid_value")
    assert "2 image placeholders for 1 images" in err["message"]


def test_responses_refuse_a_bad_input_image_naming_its_part(vl, offline):
    body = {"input": [
        {"type": "reasoning", "summary": []},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}, {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]},
    ], "store": False}  # fmt: skip
    _refused(body, offline, "input[1].content[1]", path="/v1/responses")


def test_a_text_only_model_refuses_images_clearly(offline, default_gguf_path):
    assert served_model().served_id == settings.IGNIS["model.id"]  # the default model, a GGUF: text only

    async def go():
        body = {"messages": [user("What is this?", image_part(data_url(picture(56, 56))))]}
        status, answer = await _post(ChatCompletionsConsumer, "/v1/chat/completions", body)
        err = assert_openai_error(Answer(status, answer), 400, "invalid_image", "messages[0].content[1]")
        assert "reads text only" in err["message"]
        status, answer = await _post(
            ResponsesConsumer,
            "/v1/responses",
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},  # fmt: skip
        )
        assert_openai_error(Answer(status, answer), 400, "invalid_image", "input[0].content[0]")

    asyncio.run(go())
    assert not offline


def test_image_part_shapes_are_checked_by_the_schema(vl, offline):
    for part, param in [
        ({"type": "image_url"}, "messages[0].content[0].image_url"),
        ({"type": "image_url", "image_url": {"url": 3}}, "messages[0].content[0].image_url.url"),
        ({"type": "image_url", "image_url": {"url": "data:,", "detail": "ultra"}}, "messages[0].content[0].detail"),
        ({"type": "input_image", "file_id": "file-1"}, "messages[0].content[0]"),
        ({"type": "input_audio", "input_audio": {}}, "messages[0].content[0]"),
    ]:
        status, answer = asyncio.run(_post(ChatCompletionsConsumer, "/v1/chat/completions", {"messages": [user(part)]}))
        assert_openai_error(Answer(status, answer), 400, None, param)
    assert not offline


def test_tokenize_route_counts_and_refuses_images(vl, monkeypatch):
    from django.test import Client

    from apps.models import middleware

    async def nothing(**kw):
        return None

    monkeypatch.setattr(middleware, "switch_gate", nothing)
    http = Client()
    body = {"messages": [user("What is it?", image_part(data_url(picture(112, 112))))]}
    resp = http.post("/v1/tokenize", data=json.dumps(body), content_type="application/json")
    assert resp.status_code == 200 and resp.json()["count"] == len(chat_prepare(body).add.prompt_token_ids)
    bad = {"messages": [user("What is it?", image_part("data:image/gif;base64,R0lGODlh"))]}
    resp = http.post("/v1/tokenize", data=json.dumps(bad), content_type="application/json")
    assert_openai_error(resp, 400, "invalid_image", "messages[0].content[1]")


def test_a_stored_conversation_brings_its_images_back(vl):
    url = data_url(picture(70, 70, seed=6))
    first = response_prepare(response_parse({"input": [user("What is it?", image_part(url))]}), None)
    stored = json.loads(json.dumps(first.conversation))  # as the store keeps it (a JSON column)
    follow = response_parse({"input": [user("And this one?", image_part(data_url(picture(60, 90, seed=7))))]})
    add = response_prepare(follow, {"messages": stored}).add
    assert len(add.images) == 2 and add.images[0] == first.add.images[0]
    assert add.prompt_token_ids[: len(first.add.prompt_token_ids) - 3] == first.add.prompt_token_ids[:-3]
