"""Server paths that need control over the engine, so the app runs in this process over a real engine on the
embedded model: a request that fails after its stream began (error event, then [DONE]; a 500 when not streamed),
and a server without a tokenizer (what `--synthetic` serves)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest

from qwen_jax.checkpoint import load_checkpoint
from qwen_jax.engine.engine import Engine
from server.app import build_app
from server.loading import EMBEDDED_MODEL
from server.serving import GenerationDefaults, Serving, load_generation_defaults

pytestmark = pytest.mark.timeout(300)

POISON = (7, 7, 7)  # a prompt starting with these ids fails at its third generated token
FAIL_AT = 2


class FaultyEngine(Engine):
    def on_token(self, stream, token):
        if stream.request.prompt_ids[:3] == POISON and stream.handle.completion_tokens >= FAIL_AT:
            raise RuntimeError("injected fault")


@pytest.fixture(scope="module")
def engine():
    ck = load_checkpoint(EMBEDDED_MODEL)
    e = FaultyEngine(ck.params, ck.config, None, model_name="faulty", max_model_len=256, parallel=2, max_queued=4,
                     max_logprobs=0, progress=False)
    e.start()
    yield e
    e.shutdown()


@contextlib.contextmanager
def served(engine, name: str):
    """The app over a started engine in this process (closed on exit; the engine stays the caller's)."""
    serving = Serving(engine, served_model_name=name, model_root="in-process", defaults=GenerationDefaults())
    try:
        yield build_app(serving)
    finally:
        serving.close()


@pytest.fixture(scope="module")
def app(engine):
    with served(engine, "faulty") as a:
        yield a


def call(app, method: str, path: str, **kw) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=60.0) as c:
            return await c.request(method, path, **kw)
    return asyncio.run(go())


def sse(text: str) -> list:
    return [d if (d := line[6:]) == "[DONE]" else json.loads(d) for line in text.splitlines()
            if line.startswith("data: ")]


@pytest.mark.parametrize("n", [1, 2])
def test_error_after_stream_began(app, engine, n):
    """Every choice fails at its third token (the same poisoned prompt): each choice's tokens before it, one error
    event after them, [DONE], and the engine's state back where it was."""
    baseline = call(app, "GET", "/health").json()
    r = call(app, "POST", "/v1/completions", json={"prompt": list(POISON) + [1], "max_tokens": 10, "stream": True,
                                                   "ignore_eos": True, "n": n, "temperature": 1.0})
    assert r.status_code == 200
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["type"] == "server_error" and err["code"] == "generation_failed" and "injected fault" in err["message"]
    tokens = [e for e in events[:-2] if "choices" in e]
    assert all(e["choices"][0]["finish_reason"] is None for e in tokens)
    assert sorted(e["choices"][0]["index"] for e in tokens) == sorted(list(range(n)) * FAIL_AT)
    h = call(app, "GET", "/health").json()
    assert {k: h[k] for k in ("running", "waiting", "free_pages", "free_slots")} == \
        {k: baseline[k] for k in ("running", "waiting", "free_pages", "free_slots")}


def _errors_counted(app) -> float:
    line = 'qwen_jax:request_success_total{finished_reason="error",model_name="faulty"} '
    text = call(app, "GET", "/metrics").text
    return next((float(x[len(line):]) for x in text.splitlines() if x.startswith(line)), 0.0)


def test_error_without_stream_is_500_and_others_unaffected(app):
    errors = _errors_counted(app)
    async def both():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=60.0) as c:
            return await asyncio.gather(
                c.post("/v1/completions", json={"prompt": list(POISON), "max_tokens": 10, "ignore_eos": True}),
                c.post("/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 10, "ignore_eos": True}))
    bad, good = asyncio.run(both())
    assert bad.status_code == 500
    assert bad.json()["error"]["code"] == "generation_failed"
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 10
    assert _errors_counted(app) == errors + 1


def test_without_tokenizer(app):
    ok = call(app, "POST", "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    streamed = sse(call(app, "POST", "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "stream": True,
                                                            "ignore_eos": True}).text)
    # No text without a tokenizer, but one chunk per token still goes out (benchmarks count them).
    assert len([e for e in streamed if e != "[DONE]"]) == 4
    for path, body, param in (("/v1/completions", {"prompt": "text"}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, "messages"),
                              ("/tokenize", {"prompt": "x"}, "prompt"), ("/detokenize", {"tokens": [1]}, "tokens"),
                              ("/v1/completions", {"prompt": [1, 2], "stop": "x"}, "stop"),
                              ("/v1/completions", {"prompt": [1, 2], "logprobs": 1}, "logprobs")):
        r = call(app, "POST", path, json=body)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == param


def test_generation_defaults_from_the_checkpoint(tmp_path):
    """generation_config.json's sampling values, repetition_penalty included (vLLM applies it by default);
    `do_sample: false` is greedy; a repetition penalty the engine would refuse is refused at start."""
    assert load_generation_defaults(None) == GenerationDefaults()
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "do_sample": True}))
    assert load_generation_defaults(tmp_path) == GenerationDefaults(temperature=0.7, top_p=0.8, top_k=20,
                                                                   repetition_penalty=1.05)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "do_sample": False}))
    assert load_generation_defaults(tmp_path) == GenerationDefaults(temperature=0.0)
    (tmp_path / "generation_config.json").write_text(json.dumps({"repetition_penalty": 0}))
    with pytest.raises(ValueError, match="repetition_penalty"):
        load_generation_defaults(tmp_path)
