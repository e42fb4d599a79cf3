"""Server paths that need control over the engine, so the app runs in this process over a real engine on the
embedded model: a request that fails after its stream began (error event, then [DONE]; a 500 when not streamed),
and a server without a tokenizer (what `--synthetic` serves). Reasoning and tool-call parsing run over a scripted
engine whose replies are set texts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import types

import httpx
import openai
import pytest

from qwen_jax import structured
from qwen_jax.checkpoint import load_checkpoint, load_tokenizer
from qwen_jax.engine.api import EngineStats, GenerationRequest, TokenEvent, TokenLogprob
from qwen_jax.engine.engine import Engine
from server.app import build_app
from server.loading import EMBEDDED_MODEL
from server.parsers import (TOOL_END, TOOL_START, ForcedCalls, ForcedReplyParser, ParsedReply, ToolCall,
                            parse_forced)
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


# ------------------------------------------------------------------------------- reasoning and tool calls
# The chat route's parsing (server/parsers.py) over replies whose text is set: the tiny model's are gibberish. The
# scripted engine has the engine's surface that Serving uses; each reply is the tiny checkpoint's tokens of a set
# text, one token an event as the engine sends them (so tags arrive cut across events), with made-up logprobs.

THINKING = "\nThe user wants the weather.\n</think>\n\n"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


class ScriptedHandle:
    def __init__(self, request: GenerationRequest, tokenizer, text: str, reason: str):
        self.request = request
        self.request_id = request.request_id
        self.prompt_tokens = len(request.prompt_ids)
        self.completion_tokens = self.cached_tokens = 0
        self.arrival_time = time.monotonic()
        self.first_token_time = self.finish_time = None
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        texts = [tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]
        self.script = [(t, texts[k + 1][len(texts[k]):]) for k, t in enumerate(ids)]
        if reason == "stop":
            self.script.append((tokenizer.convert_tokens_to_ids("<|im_end|>"), ""))  # EOS: its text is left out
        self.reason = reason

    def cancel(self) -> None:
        pass

    async def __aiter__(self):
        for k, (token, text) in enumerate(self.script):
            await asyncio.sleep(0)
            last = k == len(self.script) - 1
            lp = None if self.request.logprobs is None else (TokenLogprob(token, -0.5 - k),)
            self.completion_tokens += 1
            self.first_token_time = self.first_token_time or time.monotonic()
            self.finish_time = time.monotonic() if last else None
            yield TokenEvent((token,), text, lp, self.reason if last else None)


class ScriptedEngine:
    """Replies with `replies` (text, finish reason), one a choice; keeps the requests it was given."""
    max_model_len = 2048
    max_queued = 8
    seed_salt = ""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.model_config = types.SimpleNamespace(text=types.SimpleNamespace(vocab_size=len(tokenizer)))
        self.replies: list[tuple[str, str]] = []
        self.requests: list[GenerationRequest] = []

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 1, 1, 1, 1, 0, 0)

    def token_bytes(self) -> structured.TokenBytes:
        return structured.TokenBytes.from_tokenizer(self.tokenizer, len(self.tokenizer))

    def submit_all(self, reqs):
        self.requests = list(reqs)
        return [ScriptedHandle(r, self.tokenizer, *self.replies[i]) for i, r in enumerate(reqs)]


@pytest.fixture(scope="module")
def scripted():
    engine = ScriptedEngine(load_tokenizer(EMBEDDED_MODEL))
    # "auto", as `python -m server` runs: the tiny template writes think blocks, so qwen3.
    serving = Serving(engine, served_model_name="scripted", model_root="in-process", defaults=GenerationDefaults(),
                      reasoning_parser="auto")
    assert serving.reasoning_parser == "qwen3"
    try:
        yield engine, build_app(serving)
    finally:
        serving.close()


def chat(scripted, replies: list[tuple[str, str]], **body) -> httpx.Response:
    engine, app = scripted
    engine.replies = replies
    return call(app, "POST", "/v1/chat/completions", json={"messages": ASK, "max_tokens": 200, **body})


def chat_stream(scripted, replies: list[tuple[str, str]], **body) -> list[dict]:
    r = chat(scripted, replies, stream=True, **body)
    assert r.status_code == 200, r.text
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    return events[:-1]


def joined(events: list[dict], index: int = 0) -> dict:
    """A choice's deltas summed: each text field joined ("" when never sent), the tool calls, the logprobs and the
    finish reasons in order."""
    out = {"reasoning_content": "", "reasoning": "", "content": "", "tool_calls": [], "logprobs": [], "finish": []}
    for ev in events:
        (c,) = ev["choices"]
        if c["index"] != index:
            continue
        for key in ("reasoning_content", "reasoning", "content"):
            out[key] += c["delta"].get(key) or ""
        out["tool_calls"] += c["delta"].get("tool_calls", [])
        out["logprobs"] += (c["logprobs"] or {}).get("content", [])
        out["finish"] += [c["finish_reason"]] if c["finish_reason"] else []
    return out


def test_reasoning_split_whole_and_streamed(scripted):
    """Thinking on (the prompt opens the block): reasoning under both names, the answer as content, logprobs one a
    token as before; streamed, the same sums, reasoning deltas before content ones."""
    reply = [(THINKING + "Sunny, 21 C.", "stop")]
    whole = chat(scripted, reply, logprobs=True).json()
    (choice,) = whole["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Sunny, 21 C.", "tool_calls": None,
                                 "reasoning_content": "The user wants the weather.",
                                 "reasoning": "The user wants the weather."}
    assert choice["finish_reason"] == "stop"
    tokens = whole["usage"]["completion_tokens"]
    assert [lp["logprob"] for lp in choice["logprobs"]["content"]] == [-0.5 - k for k in range(tokens)]
    events = chat_stream(scripted, reply, logprobs=True)
    s = joined(events)
    assert (s["reasoning_content"], s["reasoning"], s["content"]) == ("The user wants the weather.",) * 2 + \
        ("Sunny, 21 C.",)
    assert s["logprobs"] == choice["logprobs"]["content"] and s["finish"] == ["stop"]
    kinds = [k for ev in events for k in ("reasoning", "content") if ev["choices"][0]["delta"].get(k)]
    assert kinds == sorted(kinds, key=lambda k: k == "content") and kinds[0] == "reasoning"
    assert all(ev["choices"][0]["delta"].get("reasoning_content") == ev["choices"][0]["delta"].get("reasoning")
               for ev in events)


def test_reasoning_cut_short_and_thinking_off(scripted):
    cut = [("\nStill thinking about </thi", "length")]
    whole = chat(scripted, cut).json()["choices"][0]
    assert whole["message"]["reasoning"] == "Still thinking about </thi" and whole["message"]["content"] is None
    assert whole["finish_reason"] == "length"
    s = joined(chat_stream(scripted, cut))
    assert (s["reasoning"], s["content"], s["finish"]) == ("Still thinking about </thi", "", ["length"])
    # enable_thinking false: the prompt closes the block, so a reply without `<think>` is all content.
    off = [("Blue </think> and green.", "stop")]
    kw = {"chat_template_kwargs": {"enable_thinking": False}}
    message = chat(scripted, off, **kw).json()["choices"][0]["message"]
    assert message["content"] == "Blue </think> and green." and message["reasoning"] is None
    assert joined(chat_stream(scripted, off, **kw))["content"] == "Blue </think> and green."


def test_tool_calls_whole_and_streamed(scripted):
    engine, _ = scripted
    reply = [(THINKING + "Let me check.\n" + CALL, "stop")]
    r = chat(scripted, reply, tools=TOOLS)
    assert r.status_code == 200, r.text
    prompt = engine.tokenizer.decode(engine.requests[0].prompt_ids)
    assert "<tools>" in prompt and '"get_weather"' in prompt and "Weather of a city." in prompt
    assert engine.requests[0].skip_special_tokens  # the tiny tokenizer's tags are not special tokens
    (choice,) = r.json()["choices"]
    (tc,) = choice["message"]["tool_calls"]
    assert re.fullmatch(r"call_[0-9a-f]{24}", tc["id"]) and tc["type"] == "function"
    assert tc["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert choice["message"]["content"] == "Let me check." and choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "The user wants the weather."

    events = chat_stream(scripted, reply, tools=TOOLS)
    s = joined(events)
    (streamed,) = s["tool_calls"]
    assert re.fullmatch(r"call_[0-9a-f]{24}", streamed.pop("id"))
    assert streamed == {"index": 0, "type": "function", "function": tc["function"]}
    assert (s["content"], s["reasoning"], s["finish"]) == ("Let me check.", "The user wants the weather.",
                                                            ["tool_calls"])
    # The call went out whole, in one chunk, after the content.
    with_calls = [i for i, ev in enumerate(events) if ev["choices"][0]["delta"].get("tool_calls")]
    with_content = [i for i, ev in enumerate(events) if ev["choices"][0]["delta"].get("content")]
    assert len(with_calls) == 1 and max(with_content) < with_calls[0]
    # ... though its tags came cut across events (the tiny tokenizer spells `<tool_call>` in several tokens).
    pieces = [text for _, text in ScriptedHandle(engine.requests[0], engine.tokenizer, CALL, "stop").script]
    assert not any(TOOL_START in p or TOOL_END in p for p in pieces) and "".join(pieces) == CALL

    # Two calls; cut by the budget the reason stays "length".
    two = [(CALL + "\n" + CALL.replace("Paris", "Oslo"), "length")]
    kw = {"tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": True,
          "chat_template_kwargs": {"enable_thinking": False}}
    choice = chat(scripted, two, **kw).json()["choices"][0]
    assert [json.loads(c["function"]["arguments"])["city"] for c in choice["message"]["tool_calls"]] == \
        ["Paris", "Oslo"]
    assert choice["message"]["content"] is None and choice["finish_reason"] == "length"
    s = joined(chat_stream(scripted, two, **kw))
    assert [c["index"] for c in s["tool_calls"]] == [0, 1] and s["finish"] == ["length"]


def test_tool_calls_left_as_text(scripted):
    """A block that is not a call, one never closed, and any block under tool_choice "none" (then the tools are not
    in the prompt either) stay in the content, streamed or not."""
    engine, _ = scripted
    kw = {"tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}}
    for text in ("<tool_call>\n{get_weather(Paris)}\n</tool_call>", "Checking: " + CALL[:-4]):
        choice = chat(scripted, [(text, "stop")], **kw).json()["choices"][0]
        assert (choice["message"]["content"], choice["message"]["tool_calls"], choice["finish_reason"]) == \
            (text, None, "stop")
        s = joined(chat_stream(scripted, [(text, "stop")], **kw))
        assert (s["content"], s["tool_calls"], s["finish"]) == (text, [], ["stop"])
    choice = chat(scripted, [(CALL, "stop")], **kw, tool_choice="none").json()["choices"][0]
    assert choice["message"]["content"] == CALL and choice["finish_reason"] == "stop"
    assert "<tools>" not in engine.tokenizer.decode(engine.requests[0].prompt_ids)


def test_each_choice_parses_its_own(scripted):
    replies = [(THINKING + CALL, "stop"), (THINKING + "No tool needed.", "stop")]
    r = chat(scripted, replies, tools=TOOLS, n=2).json()
    first, second = r["choices"]
    assert first["finish_reason"] == "tool_calls" and first["message"]["content"] is None
    assert second["finish_reason"] == "stop" and second["message"]["tool_calls"] is None
    assert second["message"]["content"] == "No tool needed."
    events = chat_stream(scripted, replies, tools=TOOLS, n=2)
    a, b = joined(events, 0), joined(events, 1)
    assert [c["function"]["name"] for c in a["tool_calls"]] == ["get_weather"] and a["finish"] == ["tool_calls"]
    assert (b["content"], b["tool_calls"], b["finish"]) == ("No tool needed.", [], ["stop"])


def test_a_conversation_with_calls_goes_back_in(scripted):
    """The assistant turn with its reasoning and tool call, and the tool's answer, sent back as messages: the
    prompt renders the call and the answer; the next reply parses as any other."""
    engine, _ = scripted
    messages = ASK + [
        {"role": "assistant", "content": None, "reasoning_content": "Need the weather.",
         "tool_calls": [{"id": "call_0", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "21 C, sunny"}]
    r = chat(scripted, [(THINKING + "It is sunny.", "stop")], tools=TOOLS, messages=messages)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "It is sunny."
    prompt = engine.tokenizer.decode(engine.requests[0].prompt_ids)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n21 C, sunny\n</tool_response>" in prompt and prompt.endswith("<think>\n")


def test_openai_client_reads_reasoning_and_calls(scripted):
    """The official SDK's types take both forms: the message's tool_calls, and stream deltas it accumulates."""
    engine, app = scripted
    engine.replies = [(THINKING + "Checking.\n" + CALL, "stop")]

    async def go():
        async with openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", max_retries=0, http_client=(
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test"))) as client:
            whole = await client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS)
            stream = await client.chat.completions.create(model="scripted", messages=ASK, tools=TOOLS, stream=True)
            return whole, [c async for c in stream]

    whole, chunks = asyncio.run(go())
    message = whole.choices[0].message
    assert message.tool_calls[0].function.name == "get_weather" and message.content == "Checking."
    assert message.model_extra["reasoning_content"] == "The user wants the weather."
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name, tc.function.arguments) for tc in calls] == \
        [(0, "get_weather", '{"city": "Paris"}')]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tags_that_are_special_tokens_are_kept(scripted):
    """A tokenizer that marks the tool tags special (Hermes-style): replies parsed for them keep special tokens in
    their text, others skip them as usual."""
    tok = load_tokenizer(EMBEDDED_MODEL)
    tok.add_special_tokens({"additional_special_tokens": [TOOL_START, TOOL_END]})
    engine = ScriptedEngine(tok)
    serving = Serving(engine, served_model_name="scripted", model_root="in-process", defaults=GenerationDefaults())
    try:
        app = build_app(serving)
        assert serving.reasoning_parser == "none"
        engine.replies = [(CALL, "stop")]
        body = {"messages": ASK, "max_tokens": 50}
        r = call(app, "POST", "/v1/chat/completions", json={**body, "tools": TOOLS})
        assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        assert not engine.requests[0].skip_special_tokens
        call(app, "POST", "/v1/chat/completions", json=body)
        assert engine.requests[0].skip_special_tokens
    finally:
        serving.close()


XML_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "hourly": {"type": "boolean"}}}}}]
XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n<parameter=hourly>\nfalse\n</parameter>\n</function>\n</tool_call>")


def test_xml_tool_calls_whole_and_streamed(scripted):
    """Qwen3.5's XML call form through the chat route: arguments typed by the request's schema, the streamed call
    equal to the whole one (its tags cut across events), after the answer's content or in place of a `</think>`
    the model left out."""
    engine, _ = scripted
    arguments = {"city": "New York", "days": 3, "hourly": False}
    for text, reasoning, content in ((THINKING + "Let me check.\n\n" + XML_CALL, "The user wants the weather.",
                                      "Let me check."),
                                     ("\nI need the weather.\n\n" + XML_CALL + "\n", "I need the weather.", None)):
        whole = chat(scripted, [(text, "stop")], tools=XML_TOOLS)
        assert whole.status_code == 200, whole.text
        (choice,) = whole.json()["choices"]
        (tc,) = choice["message"]["tool_calls"]
        assert tc["function"]["name"] == "get_weather" and json.loads(tc["function"]["arguments"]) == arguments
        assert (choice["message"]["content"], choice["message"]["reasoning_content"], choice["finish_reason"]) == \
            (content, reasoning, "tool_calls")

        events = chat_stream(scripted, [(text, "stop")], tools=XML_TOOLS)
        s = joined(events)
        (streamed,) = s["tool_calls"]
        assert re.fullmatch(r"call_[0-9a-f]{24}", streamed.pop("id"))
        assert streamed == {"index": 0, "type": "function", "function": tc["function"]}
        assert (s["content"] or None, s["reasoning_content"], s["finish"]) == (content, reasoning, ["tool_calls"])
        pieces = [t for _, t in ScriptedHandle(engine.requests[0], engine.tokenizer, XML_CALL, "stop").script]
        assert not any("<function=get_weather>" in p or "</parameter>" in p for p in pieces)


def test_default_chat_template_kwargs():
    """`--default-chat-template-kwargs`: every chat prompt gets them (here thinking off: the prompt closes its think
    block and the reply is all content), unless the request sets the variable itself; apply_chat_template's own
    parameters are refused."""
    engine = ScriptedEngine(load_tokenizer(EMBEDDED_MODEL))
    serving = Serving(engine, served_model_name="scripted", model_root="in-process", defaults=GenerationDefaults(),
                      reasoning_parser="qwen3", default_template_kwargs={"enable_thinking": False})
    try:
        app = build_app(serving)
        tok = engine.tokenizer
        off = call(app, "POST", "/tokenize", json={"messages": ASK}).json()["tokens"]
        on = call(app, "POST", "/tokenize", json={"messages": ASK,
                                                  "chat_template_kwargs": {"enable_thinking": True}}).json()["tokens"]
        assert tok.decode(off).endswith("<think>\n\n</think>\n\n") and tok.decode(on).endswith("<think>\n")
        engine.replies = [("The answer.", "stop")]
        msg = call(app, "POST", "/v1/chat/completions", json={"messages": ASK}).json()["choices"][0]["message"]
        assert msg["content"] == "The answer." and msg["reasoning_content"] is None
        assert list(engine.requests[0].prompt_ids) == off
    finally:
        serving.close()
    for bad in ({"tokenize": True}, [1], {1: 2}):
        with pytest.raises(ValueError, match="--default-chat-template-kwargs"):
            Serving(engine, served_model_name="x", model_root="x", defaults=GenerationDefaults(),
                    default_template_kwargs=bad)


# ------------------------------------------------------------------------------------------------ forced calls
# tool_choice "required" or a named function: the request carries a grammar of the calls' JSON, and the reply's
# content is read as that document. The scripted engine does not enforce grammars, so its replies are documents
# written here, and each request's grammar is checked on its own over a vocabulary of single bytes.

BYTES = structured.TokenBytes([bytes([b]) for b in range(256)])
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time now."}}
ARGS = '{"city": "Paris"}'
REQUIRED = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def is_document(grammar, text: str) -> bool:
    """Whether `text` is a whole document of `grammar` (fed one byte a token)."""
    matcher = structured.Matcher(grammar, BYTES, ())
    try:
        for byte in text.encode():
            matcher.advance(byte)
    except ValueError:
        return False
    return matcher.complete


def calls_of(message_or_delta: dict) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message_or_delta["tool_calls"] or []]


def check_forced_stream(events: list[dict], calls: list[tuple[str, str]], reasoning: str = "") -> None:
    """A forced reply streamed: reasoning as usual, no content, the calls whole in one chunk (indexes in order,
    fresh ids), then a chunk of its own with the finish reason."""
    s = joined(events)
    assert (s["reasoning_content"], s["content"], s["finish"]) == (reasoning, "", ["tool_calls"])
    assert [(c["index"], c["type"]) for c in s["tool_calls"]] == [(k, "function") for k in range(len(calls))]
    assert calls_of(s) == calls and all(re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) for c in s["tool_calls"])
    with_calls = [ev for ev in events if ev["choices"][0]["delta"].get("tool_calls")]
    assert len(with_calls) == 1 and with_calls[0]["choices"][0]["finish_reason"] is None
    assert events[-1]["choices"][0]["delta"] == {} and events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert events.index(with_calls[0]) == len(events) - 2


def test_forced_named_function(scripted):
    """A named function, thinking on: the grammar is the function's parameters and starts after `</think>`; the
    reasoning goes out as usual and the document is the call's arguments, as written; content null."""
    engine, _ = scripted
    reply = [("\nThe user wants the weather.\n</think>" + ARGS, "stop")]
    r = chat(scripted, reply, tools=TOOLS + [TIME_TOOL], tool_choice=named("get_weather"))
    assert r.status_code == 200, r.text
    (request,) = engine.requests
    prompt = engine.tokenizer.decode(request.prompt_ids)
    assert '"get_weather"' in prompt and '"get_time"' in prompt  # every tool is in the prompt, as vLLM renders them
    assert request.grammar_after == engine.tokenizer.convert_tokens_to_ids("</think>")
    assert is_document(request.grammar, ARGS) and is_document(request.grammar, "{}")
    assert not is_document(request.grammar, '{"city": 5}') and not is_document(request.grammar, '{"town": "x"}')
    (choice,) = r.json()["choices"]
    message = choice["message"]
    assert (message["content"], message["reasoning_content"], choice["finish_reason"]) == \
        (None, "The user wants the weather.", "tool_calls")
    assert calls_of(message) == [("get_weather", ARGS)] and message["tool_calls"][0]["type"] == "function"
    assert re.fullmatch(r"call_[0-9a-f]{24}", message["tool_calls"][0]["id"])
    events = chat_stream(scripted, reply, tools=TOOLS + [TIME_TOOL], tool_choice=named("get_weather"))
    check_forced_stream(events, [("get_weather", ARGS)], "The user wants the weather.")

    # get_time has no parameters: any JSON object; thinking off, the grammar starts at the reply's first token.
    r = chat(scripted, [("{}", "stop")], tools=TOOLS + [TIME_TOOL], tool_choice=named("get_time"), **NO_THINKING)
    assert calls_of(r.json()["choices"][0]["message"]) == [("get_time", "{}")]
    (request,) = engine.requests
    assert request.grammar_after is None and is_document(request.grammar, '{"any": [1, {"thing": null}]}')
    assert not is_document(request.grammar, "[]")


def test_forced_required_calls(scripted):
    """"required": the grammar is an array of at least one {"name", "parameters"} of a declared tool (one at most
    with parallel_tool_calls false); each item is a call, arguments re-encoded; streamed, the same calls."""
    engine, _ = scripted
    tools = TOOLS + [TIME_TOOL]
    r = chat(scripted, [(REQUIRED, "stop")], tools=tools, tool_choice="required", **NO_THINKING)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    calls = [("get_weather", ARGS), ("get_time", "{}")]
    assert calls_of(choice["message"]) == calls
    assert (choice["message"]["content"], choice["finish_reason"]) == (None, "tool_calls")
    assert len({c["id"] for c in choice["message"]["tool_calls"]}) == 2
    grammar = engine.requests[0].grammar
    assert engine.requests[0].grammar_after is None and is_document(grammar, REQUIRED)
    for bad in ("[]", "{}", '[{"name": "get_time"}]', '[{"name": "nope", "parameters": {}}]',
                '[{"name": "get_time", "parameters": {}, "extra": 1}]',
                '[{"name": "get_weather", "parameters": {"city": 1}}]',
                '[{"parameters": {}, "name": "get_time"}]'):
        assert not is_document(grammar, bad), bad
    check_forced_stream(chat_stream(scripted, [(REQUIRED, "stop")], tools=tools, tool_choice="required",
                                    **NO_THINKING), calls)
    one = '[{"name": "get_time", "parameters": {}}]'
    chat(scripted, [(one, "stop")], tools=tools, tool_choice="required", parallel_tool_calls=False, **NO_THINKING)
    assert is_document(engine.requests[0].grammar, one) and not is_document(engine.requests[0].grammar, REQUIRED)


def test_forced_calls_move_refs(scripted):
    """Under "required" each tool's parameters sit at #/items/anyOf/K/properties/parameters: their `$ref`s ("#"
    itself, and into their own $defs) are moved with them, so each names the same schema as in the tool alone."""
    engine, _ = scripted
    tree = {"type": "object", "properties": {"value": {"type": "integer"},
                                            "children": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["value"]}
    alarm = {"type": "object", "properties": {"at": {"$ref": "#/$defs/time"}}, "required": ["at"],
             "$defs": {"time": {"type": "object", "properties": {"hour": {"type": "integer"}},
                                "required": ["hour"]}}}
    tools = [TIME_TOOL] + [{"type": "function", "function": {"name": n, "parameters": p}}
                           for n, p in (("tree", tree), ("alarm", alarm))]
    text = ('[{"name": "tree", "parameters": {"value": 1, "children": [{"value": 2, "children": []}]}}, '
            '{"name": "alarm", "parameters": {"at": {"hour": 7}}}]')
    r = chat(scripted, [(text, "stop")], tools=tools, tool_choice="required", **NO_THINKING)
    assert r.status_code == 200, r.text
    assert calls_of(r.json()["choices"][0]["message"]) == [
        ("tree", '{"value": 1, "children": [{"value": 2, "children": []}]}'), ("alarm", '{"at": {"hour": 7}}')]
    grammar = engine.requests[0].grammar
    assert is_document(grammar, text)
    # "#" left as it was would be the whole array of calls; "#/$defs/time" would not resolve at all.
    assert not is_document(grammar, '[{"name": "tree", "parameters": {"value": 1, "children": '
                                    '[[{"name": "get_time", "parameters": {}}]]}}]')
    assert not is_document(grammar, '[{"name": "alarm", "parameters": {"at": {"minute": 7}}}]')


def test_forced_calls_cut_short(scripted):
    """A reply that is not a whole document (cut by max_tokens, or by a stop string) makes no call: its text is the
    content, the finish reason its own; each of n choices is read on its own."""
    cut = REQUIRED[:40]
    replies = [(REQUIRED, "stop"), (cut, "length"), (ARGS[:9], "stop")]
    kw = {"tools": TOOLS + [TIME_TOOL], "tool_choice": "required", "n": 3, **NO_THINKING}
    choices = chat(scripted, replies, **kw).json()["choices"]
    assert [c["finish_reason"] for c in choices] == ["tool_calls", "length", "stop"]
    assert [c["message"]["content"] for c in choices] == [None, cut, ARGS[:9]]
    assert [c["message"]["tool_calls"] is None for c in choices] == [False, True, True]
    events = chat_stream(scripted, replies, **kw)
    check_forced_stream([ev for ev in events if ev["choices"][0]["index"] == 0],
                        [("get_weather", ARGS), ("get_time", "{}")])
    for k, text, reason in ((1, cut, "length"), (2, ARGS[:9], "stop")):
        s = joined(events, k)
        assert (s["content"], s["tool_calls"], s["finish"]) == (text, [], [reason])
    # A named function's arguments cut short; thinking on, a reply cut inside the think block: all reasoning.
    for text, reasoning, content in (("\nOK.\n</think>" + ARGS[:12], "OK.", ARGS[:12]),
                                     ("\nStill thinking", "Still thinking", None)):
        choice = chat(scripted, [(text, "length")], tools=TOOLS, tool_choice=named("get_weather")).json()["choices"][0]
        assert (choice["message"]["reasoning"], choice["message"]["content"], choice["message"]["tool_calls"],
                choice["finish_reason"]) == (reasoning, content, None, "length")
        s = joined(chat_stream(scripted, [(text, "length")], tools=TOOLS, tool_choice=named("get_weather")))
        assert (s["reasoning"], s["content"] or None, s["tool_calls"], s["finish"]) == \
            (reasoning, content, [], ["length"])


def test_forced_calls_without_reasoning_parser():
    """With the reasoning parser off, a think block the prompt opens stays content (up to and with its `</think>`,
    where the grammar starts) and the document after it is the call."""
    engine = ScriptedEngine(load_tokenizer(EMBEDDED_MODEL))
    serving = Serving(engine, served_model_name="scripted", model_root="in-process", defaults=GenerationDefaults(),
                      reasoning_parser="none")
    try:
        app = build_app(serving)
        engine.replies = [("Hmm, weather.\n</think>" + ARGS, "stop")]
        body = {"messages": ASK, "max_tokens": 100, "tools": TOOLS, "tool_choice": named("get_weather")}
        choice = call(app, "POST", "/v1/chat/completions", json=body).json()["choices"][0]
        assert (choice["message"]["content"], calls_of(choice["message"]), choice["finish_reason"]) == \
            ("Hmm, weather.\n</think>", [("get_weather", ARGS)], "tool_calls")
        assert engine.requests[0].grammar_after == engine.tokenizer.convert_tokens_to_ids("</think>")
        events = sse(call(app, "POST", "/v1/chat/completions", json={**body, "stream": True}).text)[:-1]
        s = joined(events)
        assert (s["content"], calls_of(s), s["finish"]) == ("Hmm, weather.\n</think>", [("get_weather", ARGS)],
                                                            ["tool_calls"])
    finally:
        serving.close()


def test_forced_reply_parser_any_cut():
    """The forced-call parser fed a reply in two pieces, cut anywhere (inside `</think>` too), gives the whole
    reply's result: reasoning or content before the document, then the calls or the document's text."""
    forced = ForcedCalls("get_weather", ("get_weather",))
    cases = [(True, "\nHmm.\n</think>" + ARGS, ("Hmm.", None, (ToolCall("get_weather", ARGS),))),
             (False, "Hmm.\n</think>" + ARGS, (None, "Hmm.\n</think>", (ToolCall("get_weather", ARGS),))),
             (False, "Hmm.\n</think>" + ARGS[:5], (None, "Hmm.\n</think>" + ARGS[:5], ())),
             (False, "Hmm, </thi", (None, "Hmm, </thi", ()))]
    for reasoning, text, (thought, content, calls) in cases:
        assert parse_forced(text, forced, reasoning=reasoning, in_think=True) == ParsedReply(thought, content, calls)
        for cut in range(len(text) + 1):
            parser = ForcedReplyParser(forced, reasoning=reasoning, in_think=True)
            delta = parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish()
            assert (delta.reasoning or None, delta.content or None, delta.tool_calls) == (thought, content, calls)
