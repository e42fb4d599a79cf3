"""Images through the chat API, end to end in this process (the app over a float32 engine on captures/tiny, whose
checkpoint has a vision tower): transformers' conversation with three images (captures/refs/hf-tiny-vision-f32.npz,
tools/captures/make_vision.py) sent as image_url data URLs gives transformers' prompt length and its greedy tokens;
an image beside other requests gives what it gives alone; bad images and image parts where none may go are 400s
naming the part; the media rows come back."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image

from qwen_jax.engine.engine import Engine
from server.loading import EMBEDDED_MODEL
from tests.conftest import CAPTURES
from tests.test_server_inprocess import served

pytestmark = pytest.mark.timeout(600)

REF = CAPTURES / "refs" / "hf-tiny-vision-f32.npz"


@pytest.fixture(scope="module")
def ref():
    return np.load(REF)


@pytest.fixture(scope="module")
def engine():
    e = Engine.from_checkpoint(str(EMBEDDED_MODEL), dtype="float32", max_model_len=512, parallel=4, max_queued=8,
                               progress=False, compile_cache=None, max_logprobs=0)
    e.start()
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def app(engine):
    with served(engine, "tiny") as a:
        yield a


def call(app, body: dict) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=300.0) as c:
            return await c.post("/v1/chat/completions", json=body)
    return asyncio.run(go())


def calls(app, bodies: list[dict]) -> list[httpx.Response]:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=300.0) as c:
            return await asyncio.gather(*[c.post("/v1/chat/completions", json=b) for b in bodies])
    return asyncio.run(go())


def _data_url(rgb: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG")  # lossless: the decoded pixels are the capture's
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _messages(ref) -> list[dict]:
    """The capture's conversation, each {"type": "image"} part as an image_url part holding that image."""
    meta = json.loads(str(ref["meta"]))
    images = iter(ref[f"image{i}.rgb"] for i in range(3))
    out = []
    for m in meta["messages"]:
        content = m["content"]
        if isinstance(content, list):
            content = [{"type": "image_url", "image_url": {"url": _data_url(next(images))}} if p["type"] == "image"
                       else p for p in content]
        out.append({**m, "content": content})
    return out


def test_transformers_conversation_gives_its_tokens(app, engine, ref):
    n = len(ref["prompt.gen_ids"])
    body = {"messages": _messages(ref), "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "chat_template_kwargs": {"enable_thinking": False}}  # as the capture rendered it
    r = call(app, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(ref["prompt.input_ids"])
    want = engine.tokenizer.decode(ref["prompt.gen_ids"].tolist(), skip_special_tokens=True)
    assert r.json()["choices"][0]["message"]["content"] == want
    stats = engine.stats()
    assert engine._media.free == engine._media.total and stats.running == 0


def test_an_image_beside_others_replies_as_alone(app, ref):
    msgs = _messages(ref)
    one = {"messages": [msgs[0], {"role": "user", "content": [msgs[1]["content"][0], {"type": "text", "text": "?"}]}],
           "max_tokens": 6, "temperature": 0.7, "seed": 3, "ignore_eos": True}
    text = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6, "ignore_eos": True}
    alone = call(app, one).json()["choices"][0]["message"]["content"]
    together = calls(app, [text, one, _messages_body(ref, 4)])
    assert all(r.status_code == 200 for r in together), [r.text for r in together]
    assert together[1].json()["choices"][0]["message"]["content"] == alone


def _messages_body(ref, n: int) -> dict:
    return {"messages": _messages(ref), "max_tokens": n, "ignore_eos": True}


def test_bad_images_are_400s_naming_the_part(app, ref):
    good = _messages(ref)[1]["content"][0]
    cases = [
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
         "messages[0].content[0]", "not a JPEG, PNG or WebP"),
        ([{"role": "user", "content": [{"type": "text", "text": "x"},
                                       {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}],
         "messages[0].content[1]", "inline"),
        ([{"role": "assistant", "content": [good]}, {"role": "user", "content": "x"}],
         "messages[0].content[0]", "user and tool messages only"),
        ([{"role": "user", "content": [good] * 5}], "messages", "at most 4"),
    ]
    for messages, param, text in cases:
        r = call(app, {"messages": messages, "max_tokens": 2})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and text in err["message"], err
