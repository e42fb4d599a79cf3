"""Images on the device (`pytest -m gpu`): the app over an engine on captures/tiny (its checkpoint has a vision
tower) with the kernels on, the tower and the media pool on the GPU. In float32, transformers' three-image
conversation (captures/refs/hf-tiny-vision-f32.npz) gives its prompt length and greedy tokens, as on the CPU
(tests/test_server_images.py). In bfloat16, an image request's reply, logprobs included, is the same alone and beside
text requests and another image request (concurrent ≡ solo with media rows in the calls), and the media rows come
back."""

from __future__ import annotations

import contextlib

import jax
import pytest

from qwen_jax.engine.engine import Engine
from server.loading import EMBEDDED_MODEL
from tests.test_server_images import _messages, _messages_body, call, calls, ref  # noqa: F401 (ref: a fixture)
from tests.test_server_inprocess import served

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (run with -m gpu)")]


@contextlib.contextmanager
def _served(dtype: str):
    e = Engine.from_checkpoint(str(EMBEDDED_MODEL), dtype=dtype, max_model_len=512, parallel=4, max_queued=8,
                               progress=False, compile_cache=None, max_logprobs=2)
    assert e.backend.kernels and e.vision is not None
    e.start()
    try:
        with served(e, "tiny") as app:
            yield e, app
    finally:
        e.shutdown()


def _media_back(e: Engine) -> bool:
    return e._media.free == e._media.total and e.stats().running == 0


def test_transformers_conversation_gives_its_tokens_on_gpu(ref):
    n = len(ref["prompt.gen_ids"])
    with _served("float32") as (e, app):
        body = {"messages": _messages(ref), "max_tokens": n, "temperature": 0, "ignore_eos": True,
                "chat_template_kwargs": {"enable_thinking": False}}
        r = call(app, body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(ref["prompt.input_ids"])
        want = e.tokenizer.decode(ref["prompt.gen_ids"].tolist(), skip_special_tokens=True)
        assert r.json()["choices"][0]["message"]["content"] == want
        assert _media_back(e)


def test_an_image_beside_others_replies_as_alone_on_gpu(ref):
    msgs = _messages(ref)
    one = {"messages": [msgs[0], {"role": "user", "content": [msgs[1]["content"][0], {"type": "text", "text": "?"}]}],
           "max_tokens": 8, "temperature": 0.7, "seed": 3, "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
    text = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6, "ignore_eos": True}
    with _served("bfloat16") as (e, app):
        alone = call(app, one)
        assert alone.status_code == 200, alone.text
        together = calls(app, [text, one, _messages_body(ref, 4), text])
        assert all(r.status_code == 200 for r in together), [r.text for r in together]
        a, b = alone.json()["choices"][0], together[1].json()["choices"][0]
        assert (a["message"]["content"], a["logprobs"]) == (b["message"]["content"], b["logprobs"])
        assert _media_back(e)
