"""The OpenAI-compatible server end to end: one real uvicorn server (`python -m server` on the embedded tiny model,
a loopback port) for the whole module, driven by the official `openai` client and raw HTTP (httpx).

Every request loop is bounded in count and time; replies of the tiny random model are gibberish, so tests compare
replies with each other (stream vs not, concurrent vs solo, draft vs serial, seed vs seed), never with fixed text.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from qwen_jax.sampling import choice_seed, derive_seed
from server.launch import ServerProcess

# Room for prompts with two tools (~660 tokens: the tiny vocabulary spells the template's tool preamble in ~280).
MAX_MODEL_LEN = 1024
MAX_QUEUED = 64
MAX_BODY = 1 << 20
MESSAGES = [{"role": "user", "content": "Name three colours."}]

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server():
    # The tests below compare whole replies as text: the think-block split (the default, --reasoning-parser auto, on
    # this Qwen template) would put most of the tiny model's into `reasoning`. Parsing is tested in
    # test_server_inprocess.py over replies whose text is set.
    with ServerProcess(["--max-model-len", str(MAX_MODEL_LEN), "--parallel", "16", "--max-queued", str(MAX_QUEUED),
                        "--max-request-bytes", str(MAX_BODY), "--reasoning-parser", "none"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60.0) as c:
        yield c


@pytest.fixture(scope="module")
def model(http):
    return http.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60.0)


def sse_events(response: httpx.Response) -> list:
    """The `data:` payloads of an SSE response, decoded; the final [DONE] kept as the string."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def wait_idle(http: httpx.Client, baseline: dict, timeout: float = 20.0) -> dict:
    """Poll /health until the engine's pools are back to `baseline` (bounded)."""
    deadline = time.monotonic() + timeout
    keys = ("running", "waiting", "free_pages", "free_slots")
    while True:
        h = http.get("/health").json()
        if all(h[k] == baseline[k] for k in keys) or time.monotonic() > deadline:
            return h
        time.sleep(0.05)


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample in a Prometheus exposition (0 if absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        series, _, label_text = head.partition("{")
        if series != name:
            continue
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            return float(value)
    return 0.0


# ---------------------------------------------------------------------------------------------- basic routes

def test_health_models_version(http, model, client):
    h = http.get("/health")
    assert h.status_code == 200
    body = h.json()
    assert body["status"] == "ok" and body["max_model_len"] == MAX_MODEL_LEN
    assert body["running"] == 0 and body["waiting"] == 0
    assert 0 < body["free_pages"] <= body["total_pages"] and 0 < body["free_slots"] <= body["total_slots"]
    models = client.models.list().data
    assert [m.id for m in models] == [model]
    card = http.get("/v1/models").json()["data"][0]
    assert card["object"] == "model" and card["max_model_len"] == MAX_MODEL_LEN
    assert "version" in http.get("/version").json()


def test_tokenize_detokenize(http, model):
    text = "hello world, hello"
    r = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == MAX_MODEL_LEN
    assert len(r["token_strs"]) == r["count"]
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": text}

    chat = http.post("/tokenize", json={"messages": MESSAGES, "model": model}).json()
    no_think = http.post("/tokenize", json={"messages": MESSAGES,
                                            "chat_template_kwargs": {"enable_thinking": False}}).json()
    bare = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert chat["count"] == len(chat["tokens"])
    # The template's generation prompt ("<think>\n", or an empty think block without thinking) adds tokens.
    assert bare["count"] < chat["count"] < no_think["count"]
    assert chat["tokens"][:bare["count"]] == bare["tokens"]
    rendered = http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert "Name three colours." in rendered and rendered.endswith("<think>\n")


# ------------------------------------------------------------------------------------------------------ chat

def test_chat_nonstream_usage_and_logprobs(client, model, http):
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0.0,
                                       logprobs=True, top_logprobs=3)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert choice.finish_reason in ("stop", "length") and choice.message.role == "assistant"
    prompt = http.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    assert r.usage.prompt_tokens == prompt
    assert 1 <= r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == 12
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens
    for tok in content:
        assert len(tok.top_logprobs) == 3 and tok.logprob <= 0.0
        tops = [t.logprob for t in tok.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert tok.logprob == pytest.approx(tops[0], abs=1e-5)


def test_chat_stream_matches_nonstream(client, model, http):
    kw = dict(model=model, messages=MESSAGES, max_tokens=10, temperature=0.0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == full.choices[0].message.content
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])

    # Raw SSE framing: every event is JSON until the final [DONE]; no usage chunk unless asked for.
    with http.stream("POST", "/v1/chat/completions", json={**kw, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]" and all(isinstance(e, dict) for e in events[:-1])
    assert all(e["object"] == "chat.completion.chunk" and len(e["choices"]) == 1 for e in events[:-1])
    assert "usage" not in events[-2]


def test_generation_config_defaults(client, model):
    """Fields left out take generation_config.json (tiny: temperature 0.6, top_p 0.95, top_k 20)."""
    kw = dict(model=model, messages=MESSAGES, max_tokens=16, seed=7)
    implicit = client.chat.completions.create(**kw).choices[0].message.content
    explicit = client.chat.completions.create(**kw, temperature=0.6, top_p=0.95,
                                              extra_body={"top_k": 20}).choices[0].message.content
    greedy = client.chat.completions.create(**kw, temperature=0.0).choices[0].message.content
    other = client.chat.completions.create(**kw, temperature=1.0, top_p=1.0,
                                           extra_body={"top_k": 0}).choices[0].message.content
    assert implicit == explicit
    # The defaults are really in effect: the same seed under other settings gives other text.
    assert implicit != greedy and implicit != other


def test_seed_reproducible(client, model):
    kw = dict(model=model, messages=MESSAGES, max_tokens=16, temperature=1.0, extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**kw, seed=1234).choices[0].message.content
    b = client.chat.completions.create(**kw, seed=1234).choices[0].message.content
    c = client.chat.completions.create(**kw, seed=4321).choices[0].message.content
    assert a == b
    assert a != c
    # No seed: one derived from the prompt, so the reply still reproduces.
    d = client.chat.completions.create(**kw).choices[0].message.content
    e = client.chat.completions.create(**kw).choices[0].message.content
    assert d == e


def test_n_choices(client, model, http):
    """n choices: choice i is the n=1 reply with seed sampling.choice_seed(seed, i) (choice 0: the request's own
    seed; without one, the seed derived from the prompt), logprobs included; usage counts the prompt once and every
    completion. Streamed, each choice's chunks give its text and finish reason, and the usage chunk comes last."""
    kw = dict(model=model, messages=MESSAGES, max_tokens=12, temperature=1.0, logprobs=True,
              extra_body={"ignore_eos": True})
    ids = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    for seed in (1234, None):
        many = client.chat.completions.create(**kw, n=3, **({} if seed is None else {"seed": seed}))
        base = derive_seed(ids) if seed is None else seed
        solo = [client.chat.completions.create(**kw, seed=choice_seed(base, i)).choices[0] for i in range(3)]
        assert [c.index for c in many.choices] == [0, 1, 2]
        for c, s in zip(many.choices, solo):
            assert (c.message.content, c.finish_reason) == (s.message.content, s.finish_reason)
            assert [t.logprob for t in c.logprobs.content] == [t.logprob for t in s.logprobs.content]
        assert len({c.message.content for c in many.choices}) == 3
        assert (many.usage.prompt_tokens, many.usage.completion_tokens) == (len(ids), 36)
    body = {"prompt": "Once upon a time", "max_tokens": 10, "n": 2, "seed": 7, "temperature": 1.0,
            "ignore_eos": True}
    whole = http.post("/v1/completions", json=body).json()
    with http.stream("POST", "/v1/completions",
                     json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"] == whole["usage"]
    texts, reasons = ["", ""], [[], []]
    for ev in events[:-2]:
        (c,) = ev["choices"]
        texts[c["index"]] += c["text"]
        reasons[c["index"]] += [c["finish_reason"]] if c["finish_reason"] else []
    assert texts == [c["text"] for c in whole["choices"]] and texts[0] != texts[1]
    assert reasons == [["length"], ["length"]] and whole["usage"]["completion_tokens"] == 20


def test_completions_prompt_batch(http):
    """A batch of prompts (text and token ids) with n=2: prompt i's choice j at index i * n + j, each the reply to
    that prompt alone; usage counts every prompt once; streamed the same, with the usage chunk last."""
    ids = http.post("/tokenize", json={"prompt": "The sea"}).json()["tokens"]
    body = {"max_tokens": 6, "n": 2, "seed": 3, "temperature": 1.0, "ignore_eos": True}
    batch = http.post("/v1/completions", json={**body, "prompt": ["Once upon a time", ids]}).json()
    alone = [http.post("/v1/completions", json={**body, "prompt": p}).json() for p in ("Once upon a time", ids)]
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in batch["choices"]] == [c["text"] for a in alone for c in a["choices"]]
    assert batch["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert batch["usage"]["completion_tokens"] == 24
    with http.stream("POST", "/v1/completions", json={**body, "prompt": ["Once upon a time", ids], "stream": True,
                                                      "stream_options": {"include_usage": True}}) as r:
        events = sse_events(r)
    texts = [""] * 4
    for ev in events[:-2]:
        (c,) = ev["choices"]
        texts[c["index"]] += c["text"]
    assert texts == [c["text"] for c in batch["choices"]] and events[-2]["usage"] == batch["usage"]


def test_penalties(client, model, http):
    """Penalties reach the engine: greedy replies under penalties that favour repeats, or under a repetition
    penalty, differ from the plain one and reproduce (with drafting off too); a logit bias of 100 on one token makes
    the reply that token over and over."""
    kw = dict(model=model, messages=MESSAGES, max_tokens=16, temperature=0.0)
    reply = lambda **more: client.chat.completions.create(**kw, **more).choices[0].message.content  # noqa: E731
    plain = reply(extra_body={"ignore_eos": True})
    favour = dict(presence_penalty=-2.0, frequency_penalty=-1.0)
    a = reply(**favour, extra_body={"ignore_eos": True})
    assert a != plain and a == reply(**favour, extra_body={"ignore_eos": True, "draft": False})
    b = reply(extra_body={"ignore_eos": True, "repetition_penalty": 1.8})
    assert b != plain and b == reply(extra_body={"ignore_eos": True, "repetition_penalty": 1.8})
    forced = reply(logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert forced == http.post("/detokenize", json={"tokens": [42] * 16}).json()["prompt"]

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                        "days": {"type": "array", "maxItems": 2,
                                                 "items": {"type": "integer", "minimum": 1, "maximum": 16}},
                                        "metric": {"type": "boolean"}},
        "required": ["city", "metric"], "additionalProperties": False}


def test_response_format(client, model, http):
    """response_format json_schema and json_object: a reply that ended by itself is JSON that follows the schema
    (chat, thinking off, greedy and seeded; completions), the streamed reply is the same text, n choices each
    follow it, and with thinking on the format starts after the reply's </think> (a logit bias of 100 makes it the
    first token)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    kw = dict(model=model, messages=MESSAGES, max_tokens=80, extra_body={"chat_template_kwargs":
                                                                           {"enable_thinking": False}})
    replies = []
    for extra in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 7, "n": 2}):
        r = client.chat.completions.create(**kw, **extra, response_format=fmt)
        for c in r.choices:
            replies.append(c.message.content)
            if c.finish_reason == "stop":
                value = json.loads(c.message.content)
                assert list(value)[:1] == ["city"] and "metric" in value and set(value) <= set(CITY["properties"])
                assert isinstance(value["city"], str) and len(value["city"]) <= 10
                assert isinstance(value["metric"], bool) and all(isinstance(d, int) and 1 <= d <= 16
                                                                  for d in value.get("days", []))
    assert sum(c is not None and c.startswith("{") for c in replies) == 3
    plain = client.chat.completions.create(**kw, temperature=0.0).choices[0].message.content
    assert plain != replies[0]
    streamed = client.chat.completions.create(**kw, temperature=0.0, response_format=fmt, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == replies[0]
    obj = client.chat.completions.create(**kw, temperature=0.0, response_format={"type": "json_object"})
    assert obj.choices[0].message.content.startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    done = http.post(COMPLETIONS, json={"prompt": "Weather:", "max_tokens": 80, "response_format": fmt}).json()
    assert done["choices"][0]["text"].startswith("{")
    end = http.post("/tokenize", json={"prompt": "</think>", "add_special_tokens": False}).json()["tokens"]
    think = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=40, temperature=0.0,
                                           response_format=fmt, logit_bias={str(end[0]): 100})
    head, _, tail = think.choices[0].message.content.partition("</think>")
    assert head == "" and tail.startswith("{")


WEATHER_TOOL = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer"}},
    "required": ["city"]}}}
# Its `at` is a $ref into its own $defs, which under "required" must move with it to #/items/anyOf/1/....
ALARM_TOOL = {"type": "function", "function": {"name": "alarm", "parameters": {
    "type": "object", "properties": {"at": {"$ref": "#/$defs/time"}, "repeat": {"type": "boolean"}},
    "required": ["at", "repeat"], "$defs": {"time": {"type": "object", "properties": {
        "hour": {"type": "integer"}, "minute": {"type": "integer"}}, "required": ["hour", "minute"]}}}}}


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def follows_parameters(name: str, args) -> bool:
    """Whether a call's arguments satisfy its tool's schema above (keys in the declared order, none extra)."""
    if name == "weather":
        return isinstance(args, dict) and list(args) in (["city"], ["city", "days"]) \
            and isinstance(args["city"], str) and len(args["city"]) <= 8 and _integer(args.get("days", 0))
    if name == "alarm":
        return isinstance(args, dict) and list(args) == ["at", "repeat"] and isinstance(args["at"], dict) \
            and list(args["at"]) == ["hour", "minute"] and all(_integer(v) for v in args["at"].values()) \
            and isinstance(args["repeat"], bool)
    return False


@pytest.fixture(scope="module")
def no_whitespace():
    """logit_bias -100 on the tiny vocabulary's whitespace-only tokens: the random model favours them, and JSON
    allows 16 bytes of them a run, so without this a forced reply rarely ends within its budget."""
    from qwen_jax.checkpoint import load_tokenizer
    from qwen_jax.structured import TokenBytes
    from server.loading import EMBEDDED_MODEL
    tok = load_tokenizer(EMBEDDED_MODEL)
    tokens = TokenBytes.from_tokenizer(tok, len(tok))
    return {str(t): -100 for t, b in enumerate(tokens.token_bytes) if b and not b.strip()}


def test_forced_tool_calls(client, model, no_whitespace):
    """tool_choice a named function, and "required" (over a tool whose parameters hold a $ref into their $defs):
    the greedy reply is its calls (content null, finish "tool_calls"), each of a declared tool (the named one when
    named) with arguments that satisfy its schema; streamed, the same calls in one delta, then the finish chunk;
    seeded n=3, each choice its own calls or, cut by max_tokens, its text as content."""
    kw = dict(model=model, messages=MESSAGES, max_tokens=120, logit_bias=no_whitespace,
              tools=[WEATHER_TOOL, ALARM_TOOL], extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    for choice in ({"type": "function", "function": {"name": "weather"}},
                   {"type": "function", "function": {"name": "alarm"}}, "required"):
        r = client.chat.completions.create(**kw, tool_choice=choice, temperature=0.0)
        (c,) = r.choices
        assert (c.finish_reason, c.message.content) == ("tool_calls", None), c.message
        calls = [(tc.function.name, tc.function.arguments) for tc in c.message.tool_calls]
        if choice != "required":
            assert [name for name, _ in calls] == [choice["function"]["name"]]
        assert calls and all(follows_parameters(name, json.loads(args)) for name, args in calls), calls
        chunks = list(client.chat.completions.create(**kw, tool_choice=choice, temperature=0.0, stream=True))
        deltas = [ch.choices[0] for ch in chunks]
        streamed = [tc for d in deltas for tc in d.delta.tool_calls or []]
        assert [(tc.index, tc.function.name, tc.function.arguments) for tc in streamed] == \
            [(k, name, args) for k, (name, args) in enumerate(calls)]
        assert not any(d.delta.content for d in deltas)
        assert [d.finish_reason for d in deltas if d.finish_reason] == ["tool_calls"]
        assert deltas[-1].delta.tool_calls is None and deltas[-2].delta.tool_calls is not None
    r = client.chat.completions.create(**kw, tool_choice="required", temperature=1.0, seed=7, n=3)
    for c in r.choices:
        if c.finish_reason == "tool_calls":
            assert c.message.content is None and c.message.tool_calls
            assert all(follows_parameters(tc.function.name, json.loads(tc.function.arguments))
                       for tc in c.message.tool_calls)
        else:
            assert c.finish_reason == "length" and c.message.tool_calls is None
            assert c.message.content.startswith("[")
    assert sum(c.finish_reason == "tool_calls" for c in r.choices) >= 2
    assert len({(c.message.content, tuple((tc.function.name, tc.function.arguments)
                                          for tc in c.message.tool_calls or ())) for c in r.choices}) == 3


def test_structured_outputs_extra(client, model, http):
    """vLLM's structured_outputs (extra_body): `choice` makes the reply one of the strings (one that starts another
    may end there), greedy and seeded, chat and completions; `regex` a whole match, ending as soon as nothing may
    follow; `grammar` (GBNF) a text of its root rule, brackets nested by recursion; `json` (a schema or its text) and
    `json_object` reach the same grammars as response_format: the greedy reply equals response_format's. vLLM's
    older guided_json / guided_regex / guided_choice give the same replies."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    kw = dict(model=model, messages=MESSAGES, max_tokens=16)
    choices = ["red", "green", "blue sky", "blue", "ünï"]
    for extra in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 5, "n": 4}):
        r = client.chat.completions.create(**kw, **extra, extra_body={**off, "structured_outputs": {"choice": choices}})
        for c in r.choices:
            assert c.message.content in choices and c.finish_reason == "stop"
    done = http.post(COMPLETIONS, json={"prompt": "Colour:", "max_tokens": 8,
                                        "structured_outputs": {"choice": choices}}).json()
    assert done["choices"][0]["text"] in choices
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    want = client.chat.completions.create(**kw, temperature=0.0, response_format=fmt, extra_body=off)
    for extra in ({"structured_outputs": {"json": CITY}}, {"structured_outputs": {"json": json.dumps(CITY)}},
                  {"guided_json": CITY}):
        got = client.chat.completions.create(**kw, temperature=0.0, extra_body={**off, **extra})
        assert got.choices[0].message.content == want.choices[0].message.content
    pattern = r"(yes|no|maybe)(, [a-z]{1,8}){0,2}\."
    for extra in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 3, "n": 3}):
        r = client.chat.completions.create(**kw, **extra, extra_body={**off, "structured_outputs": {"regex": pattern}})
        for c in r.choices:
            assert re.fullmatch(pattern, c.message.content) and c.finish_reason == "stop", c.message.content
    done = http.post(COMPLETIONS, json={"prompt": "Answer:", "max_tokens": 24, "temperature": 0.0,
                                        "structured_outputs": {"regex": pattern}}).json()
    assert re.fullmatch(pattern, done["choices"][0]["text"])
    guided = http.post(COMPLETIONS, json={"prompt": "Answer:", "max_tokens": 24, "temperature": 0.0,
                                          "guided_regex": pattern, "guided_decoding_backend": "xgrammar"}).json()
    assert guided["choices"][0]["text"] == done["choices"][0]["text"]  # vLLM's older spelling, the same grammar
    guided = http.post(COMPLETIONS, json={"prompt": "Colour:", "max_tokens": 8, "guided_choice": choices}).json()
    assert guided["choices"][0]["text"] in choices
    grammar = 'root ::= "(" sum ")"\nsum ::= [0-9] ("+" [0-9] | "+(" sum ")")*'
    nested = re.compile(r"\(\d(\+\d|\+\(.*\))*\)")
    for extra in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 4, "n": 3}):
        r = client.chat.completions.create(**{**kw, "max_tokens": 24}, **extra,
                                           extra_body={**off, "structured_outputs": {"grammar": grammar}})
        for c in r.choices:  # a finished reply is a sum in brackets; a cut one, a prefix of one
            text = c.message.content
            assert text.count("(") >= text.count(")") and text.startswith("(") and set(text) <= set("()+0123456789")
            if c.finish_reason == "stop":
                assert nested.fullmatch(text) and text.count("(") == text.count(")"), text
    obj = client.chat.completions.create(**kw, temperature=0.0, extra_body={**off, "structured_outputs":
                                                                              {"json_object": True}})
    assert obj.choices[0].message.content == client.chat.completions.create(
        **kw, temperature=0.0, response_format={"type": "json_object"}, extra_body=off).choices[0].message.content


def test_draft_false_equals_default(client, model):
    for extra in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 99}):
        kw = dict(model=model, messages=MESSAGES, max_tokens=16, logprobs=True, **extra)
        default = client.chat.completions.create(**kw)
        serial = client.chat.completions.create(**kw, extra_body={"draft": False})
        assert serial.choices[0].message.content == default.choices[0].message.content
        assert [t.logprob for t in serial.choices[0].logprobs.content] == \
            [t.logprob for t in default.choices[0].logprobs.content]
        assert serial.usage == default.usage


def test_stop_strings(client, model, http):
    base = dict(model=model, messages=MESSAGES, max_tokens=24, temperature=0.0, extra_body={"ignore_eos": True})
    text = client.chat.completions.create(**base).choices[0].message.content
    # A stop string taken from the middle of the reply: the reply must end right before its first occurrence.
    cut = next((i for i in range(len(text) // 3, len(text) - 2)
                if text[i:i + 2].strip() == text[i:i + 2] and "\ufffd" not in text[i:i + 2]), None)
    assert cut is not None, f"reply too short to pick a stop string from: {text!r}"
    stop = text[cut:cut + 2]
    expected = text[:text.find(stop)]
    r = client.chat.completions.create(**base, stop=[stop, "\u2603never"])
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    assert r.choices[0].stop_reason == stop  # vLLM's field: the stop string that matched
    assert r.usage.completion_tokens < 24
    streamed = list(client.chat.completions.create(**base, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop" and streamed[-1].choices[0].stop_reason == stop
    assert "stop_reason" not in client.chat.completions.create(**base).choices[0].model_dump(exclude_unset=True)
    # Completions route, same rule.
    ids = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    cr = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 24, "temperature": 0.0,
                                            "ignore_eos": True, "stop": stop}).json()
    assert cr["choices"][0]["text"] == expected and cr["choices"][0]["finish_reason"] == "stop"
    # vLLM's min_tokens: stop strings count only in the text after the first min_tokens tokens
    held = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 24, "temperature": 0.0,
                                              "ignore_eos": True, "stop": stop, "min_tokens": 24}).json()
    assert held["choices"][0]["text"] == text and held["choices"][0]["finish_reason"] == "length"


def test_max_tokens_and_max_completion_tokens(client, model):
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=5,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5


def test_chat_with_tools_renders_them(client, model, http):
    """`tools` reach the chat template (the prompt grows by their rendering, as /tokenize with the same tools
    shows; tool_choice "none" leaves them out), and whatever the tiny model says comes back as a message: content
    and tool_calls as parsed, finish_reason "tool_calls" only with calls."""
    plain = http.post("/tokenize", json={"messages": MESSAGES}).json()
    with_tools = http.post("/tokenize", json={"messages": MESSAGES, "tools": TOOLS}).json()
    assert with_tools["count"] > plain["count"]
    rendered = http.post("/detokenize", json={"tokens": with_tools["tokens"]}).json()["prompt"]
    assert "<tools>" in rendered and '"get_weather"' in rendered and "The weather in a city." in rendered
    for choice, prompt in (("auto", with_tools["count"]), ("none", plain["count"])):
        r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0.0,
                                           tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
        assert r.usage.prompt_tokens == prompt
        c = r.choices[0]
        # The tiny model's gibberish makes no calls: it all stays content.
        assert c.finish_reason in ("stop", "length") and c.message.tool_calls is None
        streamed = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8,
                                                       temperature=0.0, tools=TOOLS, tool_choice=choice,
                                                       stream=True))
        assert "".join(s.choices[0].delta.content or "" for s in streamed) == (c.message.content or "")
        assert streamed[-1].choices[0].finish_reason == c.finish_reason


def test_return_token_ids(http):
    """vLLM's return_token_ids: the reply's ids on each choice and each stream chunk (the chunks' ids together are
    the whole reply's), the prompt's on a chat response (its first chunk when streamed) and on each completions
    choice; absent without it."""
    body = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
            "chat_template_kwargs": {"enable_thinking": False}}
    prompt = http.post("/tokenize", json={"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}
                       ).json()["tokens"]
    plain = http.post(CHAT, json=body).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    r = http.post(CHAT, json={**body, "return_token_ids": True}).json()
    reply = r["choices"][0]["token_ids"]
    assert r["prompt_token_ids"] == prompt and len(reply) == r["usage"]["completion_tokens"] == 6
    assert http.post("/detokenize", json={"tokens": reply}).json()["prompt"] == plain["choices"][0]["message"][
        "content"]
    lines = http.post(CHAT, json={**body, "return_token_ids": True, "stream": True}).text.splitlines()
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert chunks[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == reply
    pair = [prompt[:5], prompt[5:12]]
    done = http.post(COMPLETIONS, json={"prompt": pair, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True,
                                        "return_token_ids": True}).json()
    assert [c["prompt_token_ids"] for c in done["choices"]] == pair
    assert all(len(c["token_ids"]) == 4 for c in done["choices"])
    lines = http.post(COMPLETIONS, json={"prompt": pair, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True,
                                         "return_token_ids": True, "stream": True}).text.splitlines()
    chunks = [json.loads(x[6:])["choices"][0] for x in lines if x.startswith("data: {")]
    for i, c in enumerate(done["choices"]):
        mine = [x for x in chunks if x["index"] == i]
        assert mine[0]["prompt_token_ids"] == pair[i] and [t for x in mine for t in x["token_ids"]] == c["token_ids"]


# ------------------------------------------------------------------------------------------ Anthropic's API

def _anthropic_events(text: str) -> list[tuple[str, dict]]:
    """An SSE body's (event, data) pairs; each data's type is its event's."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        out.append((lines["event"], data))
    return out


def test_anthropic_messages(http):
    """/v1/messages: the chat route's reply as a message (text block, usage, stop reasons end_turn / max_tokens /
    stop_sequence), the same streamed as Anthropic's events; a forced tool as a tool_use block, and a tool_result
    turn; count_tokens = /tokenize of the same conversation; errors in Anthropic's shape. (Streamed thinking and
    tool_use blocks: test_anthropic_stream_blocks.)"""
    system, user = "Answer briefly.", "What colour is the sky?"
    msg = {"max_tokens": 12, "temperature": 0.0, "system": [{"type": "text", "text": system,
                                                               "cache_control": {"type": "ephemeral"}}],
           "messages": [{"role": "user", "content": [{"type": "text", "text": user}]}]}
    chat = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": 12, "temperature": 0.0}
    want = http.post(CHAT, json=chat).json()
    r = http.post("/v1/messages", json=msg).json()
    text = want["choices"][0]["message"]["content"]
    assert r["type"] == "message" and r["role"] == "assistant" and r["id"].startswith("msg_")
    assert r["content"] == ([{"type": "text", "text": text}] if text else [])
    assert r["stop_reason"] == {"stop": "end_turn", "length": "max_tokens"}[want["choices"][0]["finish_reason"]]
    assert r["usage"]["input_tokens"] + r["usage"]["cache_read_input_tokens"] == want["usage"]["prompt_tokens"]
    assert r["usage"]["output_tokens"] == want["usage"]["completion_tokens"]
    events = _anthropic_events(http.post("/v1/messages", json={**msg, "stream": True}).text)
    kinds = [k for k, _ in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[0][1]["message"]["usage"]["input_tokens"] == want["usage"]["prompt_tokens"]
    assert "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta") == text
    assert events[-2][1]["delta"]["stop_reason"] == r["stop_reason"]
    assert events[-2][1]["usage"]["output_tokens"] == r["usage"]["output_tokens"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = http.post("/v1/messages", json={**msg, "stop_sequences": ["\u2603", stop]}).json()
    assert (cut["stop_reason"], cut["stop_sequence"]) == ("stop_sequence", stop)
    assert cut["content"][0]["text"] == text[:text.find(stop)]
    # tools: forced by name, then offered with a tool_result turn
    weather = {"name": "weather", "description": "The weather in a city.",
               "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                                "required": ["city"]}}
    # (whitespace between JSON tokens is allowed in runs of up to 16 bytes, which the random model favours: room)
    forced = {**msg, "max_tokens": 120, "tools": [weather], "tool_choice": {"type": "tool", "name": "weather"},
              "thinking": {"type": "disabled"}}
    r = http.post("/v1/messages", json=forced).json()
    call = r["content"][-1]
    assert r["stop_reason"] == "tool_use" and call["type"] == "tool_use" and call["name"] == "weather"
    assert isinstance(call["input"]["city"], str) and call["id"]
    turn = [{"role": "user", "content": user},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "weather",
                                               "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny."}]}]
    chat_turn = [{"role": "user", "content": user},
                 {"role": "assistant", "content": "", "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
                     "name": "weather", "arguments": json.dumps({"city": "Oslo"})}}]},
                 {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny."}]
    fn = [{"type": "function", "function": {"name": "weather", "description": weather["description"],
                                            "parameters": weather["input_schema"]}}]
    counted = http.post("/v1/messages/count_tokens", json={"messages": turn, "tools": [weather]}).json()
    assert counted == {"input_tokens": http.post("/tokenize", json={"messages": chat_turn, "tools": fn}).json()["count"]}
    r = http.post("/v1/messages", json={"max_tokens": 4, "messages": turn, "tools": [weather]})
    assert r.status_code == 200 and r.json()["usage"]["input_tokens"] + r.json()["usage"][
        "cache_read_input_tokens"] == counted["input_tokens"]
    for bad, where in (({"messages": turn}, "max_tokens"),
                       ({**msg, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
                        "document"),
                       ({**msg, "temprature": 1}, "temprature"),
                       ({**msg, "tool_choice": {"type": "sometimes"}}, "tool_choice")):
        r = http.post("/v1/messages", json=bad)
        assert r.status_code == 400
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert where in body["error"]["message"], body


def test_anthropic_stream_blocks():
    """MessagesStream over chat chunks (reasoning, content, a tool call, the finish, usage): thinking, text and
    tool_use blocks opened and closed in order with their deltas, the stop reason and usage in message_delta; a
    stop string as stop_sequence; a failure after the start as an error event."""
    import asyncio

    from server.anthropic import MessagesStream
    from server.serving import SSE_DONE, _sse

    def run(chunks):
        async def feed():
            for c in chunks:
                yield c if isinstance(c, str) else _sse(c)

        async def collect():
            return "".join([x async for x in MessagesStream(feed(), "m").events()])
        return _anthropic_events(asyncio.run(collect()))

    def choice(delta, finish=None, **extra):
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}

    usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}}
    events = run([{**choice({"role": "assistant", "content": ""}), "prompt_token_ids": [1] * 7},
                  choice({"reasoning_content": "hm"}), choice({"reasoning_content": "m"}),
                  choice({"content": "Hi"}), choice({"content": "!"}),
                  choice({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                          "function": {"name": "f", "arguments": '{"a": 1}'}}]}),
                  choice({}, "tool_calls"), usage, SSE_DONE])
    assert [k for k, _ in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    assert events[0][1]["message"]["usage"]["input_tokens"] == 7
    blocks = [d for k, d in events if k == "content_block_start"]
    assert [(b["index"], b["content_block"]["type"]) for b in blocks] == [(0, "thinking"), (1, "text"),
                                                                          (2, "tool_use")]
    assert blocks[2]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "f", "input": {}}
    deltas = [d["delta"] for k, d in events if k == "content_block_delta"]
    assert deltas == [{"type": "thinking_delta", "thinking": "hm"}, {"type": "thinking_delta", "thinking": "m"},
                      {"type": "text_delta", "text": "Hi"}, {"type": "text_delta", "text": "!"},
                      {"type": "input_json_delta", "partial_json": '{"a": 1}'}]
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == 5
    events = run([choice({"content": "a"}), choice({}, "stop", stop_reason="END"), usage, SSE_DONE])
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    events = run([choice({"content": "a"}), {"error": {"message": "boom"}}, SSE_DONE])
    assert [k for k, _ in events][-2:] == ["content_block_stop", "error"] and events[-1][1]["error"]["message"] == "boom"


def test_thinking_budget(http):
    """Chat's thinking_budget: with thinking on, the reply's token at the budget's index is </think> and the reply
    goes on from there; with thinking off it changes nothing; Anthropic's thinking.budget_tokens is the same field."""
    [end] = http.post("/tokenize", json={"prompt": "</think>", "add_special_tokens": False}).json()["tokens"]
    body = {"messages": MESSAGES, "max_tokens": 10, "temperature": 0.0, "return_token_ids": True,
            "chat_template_kwargs": {"enable_thinking": True}}
    free = http.post(CHAT, json=body).json()["choices"][0]["token_ids"]
    assert end not in free[:3]
    r = http.post(CHAT, json={**body, "thinking_budget": 2}).json()["choices"][0]
    assert r["token_ids"][:3] == free[:2] + [end] and len(r["token_ids"]) > 3
    off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    assert http.post(CHAT, json={**off, "thinking_budget": 2}).json()["choices"][0]["token_ids"] == \
        http.post(CHAT, json=off).json()["choices"][0]["token_ids"]
    msg = {"max_tokens": 10, "temperature": 0.0, "messages": MESSAGES,
           "thinking": {"type": "enabled", "budget_tokens": 2}}
    text = http.post("/v1/messages", json=msg).json()["content"]
    assert "".join(b.get("text", "") + b.get("thinking", "") for b in text) == r["message"]["content"]
    assert http.post(CHAT, json={**body, "thinking_budget": -1}).status_code == 400


def test_responses_api(http, client, model):
    """/v1/responses: the chat route's reply as a response (a message item, usage, completed / incomplete), through
    the official client too (`output_text`); streamed as typed events in sequence whose deltas are the text;
    text.format json_schema; a forced function call as a function_call item, and a turn of function_call +
    function_call_output items counted as /tokenize counts the same chat; logprobs (top_logprobs, include) as the
    chat route's; errors in OpenAI's shape naming the field. (Reasoning items and streamed calls:
    test_responses_stream_items.)"""
    instructions, user = "Answer briefly.", "What colour is the sky?"
    chat = {"messages": [{"role": "system", "content": instructions}, {"role": "user", "content": user}],
            "max_tokens": 12, "temperature": 0.0}
    want = http.post(CHAT, json=chat).json()
    text, finish = want["choices"][0]["message"]["content"], want["choices"][0]["finish_reason"]
    req = {"model": model, "instructions": instructions, "input": user, "max_output_tokens": 12, "temperature": 0.0}
    r = http.post("/v1/responses", json=req).json()
    assert r["object"] == "response" and r["id"].startswith("resp_") and r["model"] == model
    assert r["status"] == {"stop": "completed", "length": "incomplete"}[finish]
    assert r["incomplete_details"] == ({"reason": "max_output_tokens"} if finish == "length" else None)
    [item] = r["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["content"][0]["text"] == text
    u = r["usage"]
    assert (u["input_tokens"], u["output_tokens"]) == (want["usage"]["prompt_tokens"],
                                                       want["usage"]["completion_tokens"])
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"] and u["output_tokens_details"] == {
        "reasoning_tokens": 0}
    sdk = client.responses.create(model=model, instructions=instructions, input=[
        {"role": "user", "content": [{"type": "input_text", "text": user}]}], max_output_tokens=12, temperature=0.0)
    assert sdk.output_text == text and sdk.usage.input_tokens == u["input_tokens"]
    events = list(client.responses.create(model=model, instructions=instructions, input=user, max_output_tokens=12,
                                          temperature=0.0, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if finish == "stop" else "response.incomplete"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert events[-1].response.output[0].content[0].text == text and events[-1].response.usage.output_tokens == \
        u["output_tokens"]
    # logprobs: the chat route's, on the message's text part, streamed on its deltas
    lp = http.post(CHAT, json={**chat, "logprobs": True, "top_logprobs": 2}).json()["choices"][0]["logprobs"]["content"]
    r = http.post("/v1/responses", json={**req, "top_logprobs": 2}).json()
    assert r["output"][0]["content"][0]["logprobs"] == lp and len(lp[0]["top_logprobs"]) == 2
    events = _anthropic_events(http.post("/v1/responses", json={
        **req, "include": ["message.output_text.logprobs"], "stream": True}).text)
    deltas = [lp for k, d in events if k == "response.output_text.delta" for lp in d["logprobs"]]
    assert events[-1][1]["response"]["output"][0]["content"][0]["logprobs"] == [
        {**t, "top_logprobs": []} for t in lp] and deltas == [{**t, "top_logprobs": []} for t in lp][:len(deltas)]
    # structured output: one of three words, as JSON
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"],
              "additionalProperties": False}
    r = http.post("/v1/responses", json={**req, "max_output_tokens": 120, "reasoning": {"effort": "none"},
                                         "text": {"format": {"type": "json_schema", "name": "colour",
                                                             "schema": schema, "strict": True}}}).json()
    assert r["status"] == "completed" and json.loads(r["output"][0]["content"][0]["text"])["colour"] in (
        "red", "green", "blue")
    # tools: forced by name, then a turn of the call and its output
    weather = {"type": "function", "name": "weather", "description": "The weather in a city.",
               "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                              "required": ["city"]}}
    forced = {**req, "max_output_tokens": 120, "tools": [weather], "tool_choice": {"type": "function",
                                                                                    "name": "weather"},
              "reasoning": {"effort": "none"}}
    r = http.post("/v1/responses", json=forced).json()
    call = r["output"][-1]
    assert r["status"] == "completed" and call["type"] == "function_call" and call["name"] == "weather"
    assert isinstance(json.loads(call["arguments"])["city"], str) and call["call_id"] and call["id"].startswith("fc_")
    turn = [{"role": "user", "content": user},
            {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "Oslo"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny."}]
    chat_turn = [{"role": "user", "content": user},
                 {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                     "name": "weather", "arguments": '{"city": "Oslo"}'}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "Sunny."}]
    fn = [{"type": "function", "function": {k: weather[k] for k in ("name", "description", "parameters")}}]
    counted = http.post("/tokenize", json={"messages": chat_turn, "tools": fn}).json()["count"]
    r = http.post("/v1/responses", json={"input": turn, "tools": [weather], "max_output_tokens": 4}).json()
    assert r["usage"]["input_tokens"] == counted
    for bad, where in (({"input": user, "previous_response_id": "resp_1"}, "previous_response_id"),
                       ({"input": user, "tools": [{"type": "web_search"}]}, "tools[0]"),
                       ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
                       ({"input": user, "max_output_tokens": 0}, "max_output_tokens"),
                       ({"input": user, "temprature": 1}, "temprature"),
                       ({"input": user, "text": {"format": {"type": "yaml"}}}, "text.format")):
        r = http.post("/v1/responses", json=bad)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and where in err["message"] + str(err.get("param")), err


def test_responses_stream_items():
    """ResponsesStream over chat chunks (reasoning, content, a tool call, the finish, usage, token ids): a
    reasoning item, a message item and a function_call item opened and closed in order with their deltas and done
    events, the whole response last with the reasoning tokens counted up to the think block's end; a reply cut by
    length as response.incomplete; a failure after the start as an error event."""
    import asyncio

    from server.responses import ResponsesRequest, ResponsesStream
    from server.serving import SSE_DONE, _sse

    def run(chunks):
        async def feed():
            for c in chunks:
                yield c if isinstance(c, str) else _sse(c)

        async def collect():
            req = ResponsesRequest(input="hi")
            return "".join([x async for x in ResponsesStream(feed(), req, "m", think_end=9).events()])
        return _anthropic_events(asyncio.run(collect()))

    def choice(delta, finish=None, ids=()):
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish, "token_ids": list(ids)}]}

    usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 6, "total_tokens": 13}}
    events = run([choice({"role": "assistant", "content": ""}), choice({"reasoning_content": "hm"}, ids=[3, 4]),
                  choice({"content": "Hi"}, ids=[9, 5]), choice({"content": "!"}, ids=[6]),
                  choice({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                          "function": {"name": "f", "arguments": '{"a": 1}'}}]}, ids=[7]),
                  choice({}, "tool_calls"), usage, SSE_DONE])
    assert [k for k, _ in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    added = [d["item"] for k, d in events if k == "response.output_item.added"]
    assert [a["type"] for a in added] == ["reasoning", "message", "function_call"] and added[2]["arguments"] == ""
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and [o["type"] for o in final["output"]] == [
        "reasoning", "message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "hm" and final["output"][1]["content"][0]["text"] == "Hi!"
    assert (final["output"][2]["call_id"], final["output"][2]["arguments"]) == ("call_1", '{"a": 1}')
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}  # 3, 4 and the think block's end (9)
    assert [d["output_index"] for k, d in events if k == "response.output_item.done"] == [0, 1, 2]
    events = run([choice({"content": "a"}), choice({}, "length"), usage, SSE_DONE])
    assert events[-1][0] == "response.incomplete" and events[-1][1]["response"]["incomplete_details"] == {
        "reason": "max_output_tokens"}
    assert events[-1][1]["response"]["output"][0]["status"] == "incomplete"
    events = run([choice({"content": "a"}), {"error": {"message": "boom"}}, SSE_DONE])
    assert [k for k, _ in events][-2:] == ["response.output_item.done", "error"]
    assert events[-1][1]["message"] == "boom"


def _settled(http: httpx.Client, rid: str, timeout: float = 60.0) -> dict:
    """A background response once it has left queued / in_progress (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        r = http.get(f"/v1/responses/{rid}").json()
        if r["status"] not in ("queued", "in_progress") or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def test_responses_stored(http, client, model):
    """Stored responses: GET returns the response as it was returned (whole or streamed); previous_response_id
    answers as the whole conversation sent as input does (the earlier output items, then the new input), token for
    token, through the official client too; input_items lists the request's items with ids, newest first, paged
    by limit / order / after; store false keeps nothing; DELETE removes one (then 404, and previous_response_id
    naming it a 400 in OpenAI's shape). Background responses: queued at once, then the foreground reply; cancelled
    mid-reply, their request gone from the engine; the 400s of background with store false or streamed, and of
    cancelling a response that is not background."""
    first = {"model": model, "instructions": "Answer briefly.", "input": "What colour is the sky?",
             "max_output_tokens": 10, "temperature": 0.0}
    r1 = http.post("/v1/responses", json=first).json()
    assert r1["store"] is True and r1["previous_response_id"] is None
    assert http.get(f"/v1/responses/{r1['id']}").json() == r1
    follow = [{"role": "user", "content": "And at night?"}]
    r2 = http.post("/v1/responses", json={**first, "input": follow, "previous_response_id": r1["id"]}).json()
    assert r2["previous_response_id"] == r1["id"]
    whole = http.post("/v1/responses", json={**first, "store": False, "input": [
        {"role": "user", "content": first["input"]}, *r1["output"], *follow]}).json()
    assert whole["store"] is False and http.get(f"/v1/responses/{whole['id']}").status_code == 404
    assert r2["output"][0]["content"][0]["text"] == whole["output"][0]["content"][0]["text"]
    assert r2["usage"]["input_tokens"] == whole["usage"]["input_tokens"] > r1["usage"]["input_tokens"]
    sdk = client.responses.create(model=model, instructions="Answer briefly.", input=follow,
                                  previous_response_id=r1["id"], max_output_tokens=10, temperature=0.0)
    assert sdk.output_text == r2["output"][0]["content"][0]["text"] and client.responses.retrieve(sdk.id).id == sdk.id
    # streamed: the stored response is the one response.completed carried
    final = _anthropic_events(http.post("/v1/responses", json={**first, "stream": True}).text)[-1][1]["response"]
    assert final["store"] is True and http.get(f"/v1/responses/{final['id']}").json() == final
    # input items: ids given, newest first, pages
    turn = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Bye."}]}]
    r3 = http.post("/v1/responses", json={**first, "input": turn}).json()
    listed = http.get(f"/v1/responses/{r3['id']}/input_items").json()
    assert listed["object"] == "list" and listed["has_more"] is False
    assert [(i["role"], i["content"][0]["type"], i["content"][0]["text"]) for i in listed["data"]] == [
        ("user", "input_text", "Bye."), ("assistant", "output_text", "Hello."), ("user", "input_text", "Hi.")]
    assert all(i["id"].startswith("msg_") and i["type"] == "message" for i in listed["data"])
    ids = [i["id"] for i in listed["data"]][::-1]
    page = http.get(f"/v1/responses/{r3['id']}/input_items", params={"order": "asc", "limit": 2}).json()
    assert [i["id"] for i in page["data"]] == ids[:2] and page["has_more"] and page["last_id"] == ids[1]
    page = http.get(f"/v1/responses/{r3['id']}/input_items", params={"order": "asc", "after": ids[1]}).json()
    assert [i["id"] for i in page["data"]] == ids[2:] and not page["has_more"]
    assert [i.id for i in client.responses.input_items.list(r3["id"])] == ids[::-1]
    for query, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "msg_x"}, "after")):
        r = http.get(f"/v1/responses/{r3['id']}/input_items", params=query)
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    # background: queued at once, then the reply the same request gets in the foreground
    bg = http.post("/v1/responses", json={**first, "background": True}).json()
    assert (bg["status"], bg["background"], bg["output"]) == ("queued", True, [])
    done = _settled(http, bg["id"])
    assert (done["id"], done["status"], done["output"][0]["content"][0]["text"]) == (
        bg["id"], r1["status"], r1["output"][0]["content"][0]["text"])
    # ... and cancelled mid-reply: its request leaves the engine (a seeded reply that runs 200 tokens without an
    # end, asked for 800, cancelled as soon as it is queued)
    baseline = http.get("/health").json()
    long = {**first, "temperature": 1.0, "seed": 5, "store": False}
    assert http.post("/v1/responses", json={**long, "max_output_tokens": 200}).json()["status"] == "incomplete"
    bg = http.post("/v1/responses", json={**long, "max_output_tokens": 800, "store": True,
                                          "background": True}).json()
    assert http.post(f"/v1/responses/{bg['id']}/cancel").json()["status"] == "cancelled"
    assert wait_idle(http, baseline)["running"] == baseline["running"]
    assert _settled(http, bg["id"])["status"] == "cancelled"
    for body, param in (({**first, "background": True, "store": False}, "background"),
                        ({**first, "background": True, "stream": True}, "stream")):
        r = http.post("/v1/responses", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    r = http.post(f"/v1/responses/{r2['id']}/cancel")
    assert r.status_code == 400 and "background" in r.json()["error"]["message"]
    # deleted: gone from GET, DELETE and previous_response_id
    assert http.delete(f"/v1/responses/{r1['id']}").json() == {"id": r1["id"], "object": "response", "deleted": True}
    for r in (http.get(f"/v1/responses/{r1['id']}"), http.delete(f"/v1/responses/{r1['id']}"),
              http.get(f"/v1/responses/{r1['id']}/input_items")):
        assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = http.post("/v1/responses", json={**first, "previous_response_id": r1["id"]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"
    # r2's conversation went with it: continuing r2 still works after r1 is gone
    r4 = http.post("/v1/responses", json={**first, "input": "Thanks.", "previous_response_id": r2["id"]})
    assert r4.status_code == 200 and r4.json()["usage"]["input_tokens"] > r2["usage"]["input_tokens"]


def test_response_store():
    """ResponseStore alone: the oldest dropped past its capacity (a running background response cancelled as it
    goes); a background response not continued while it runs, its result kept once; capacity 0 stores nothing and
    refuses previous_response_id; a continued conversation's messages carry the stored reasoning into the assistant turn
    and leave the earlier instructions out; the flag's value checked."""
    from server.errors import APIError
    from server.responses import ResponsesRequest, ResponseStore, to_chat

    store = ResponseStore(2)
    out = [{"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
           {"type": "message", "id": "msg_1", "role": "assistant", "content": [{"type": "output_text", "text": "A"}]}]
    for k in range(3):
        req = ResponsesRequest(input=f"q{k}", instructions="old", previous_response_id=f"resp_{k - 1}" if k else None)
        history = store.history(req)
        store.keep(req, history, {"id": f"resp_{k}", "status": "completed", "output": out})
    assert len(store) == 2 and [k for k in store._kept] == ["resp_1", "resp_2"]
    with pytest.raises(APIError) as e:
        store.get("resp_0")
    assert e.value.status == 404
    req = ResponsesRequest(input="q3", instructions="new", previous_response_id="resp_2")
    msgs = [m.model_dump(exclude_none=True) for m in to_chat(req, store.history(req)).messages]
    assert [(m["role"], m.get("content"), m.get("reasoning_content")) for m in msgs] == [
        ("system", "new", None), ("user", "q0", None), ("assistant", "A", "hm"), ("user", "q1", None),
        ("assistant", "A", "hm"), ("user", "q2", None), ("assistant", "A", "hm"), ("user", "q3", None)]
    # a background response: not continued while it runs; finished once; dropped while running, its work stopped
    import asyncio
    store, stop = ResponseStore(1), asyncio.Event()
    store.keep(ResponsesRequest(input="q", background=True), None, {"id": "resp_bg", "status": "queued",
                                                                    "output": []}, cancel=stop)
    with pytest.raises(APIError, match="is queued"):
        store.history(ResponsesRequest(input="x", previous_response_id="resp_bg"))
    store.finish("resp_bg", {"id": "resp_bg", "status": "completed", "output": out})
    store.finish("resp_bg", {"id": "resp_bg", "status": "failed", "output": []})
    assert store.get("resp_bg").response["status"] == "completed" and not stop.is_set()
    store.keep(ResponsesRequest(input="q", background=True), None, {"id": "resp_bg2", "status": "in_progress",
                                                                    "output": []}, cancel=stop)
    store.keep(ResponsesRequest(input="y"), None, {"id": "resp_next", "status": "completed", "output": []})
    assert stop.is_set() and len(store) == 1
    none = ResponseStore(0)
    assert not none.stores(ResponsesRequest(input="q"))
    with pytest.raises(APIError) as e:
        none.history(req)
    assert e.value.status == 400 and "--responses-store" in e.value.message
    with pytest.raises(ValueError, match="--responses-store"):
        ResponseStore(-1)


# ----------------------------------------------------------------------------------------------- completions

def test_completions_string_and_token_ids(client, model, http):
    ids = http.post("/tokenize", json={"prompt": "The sky is"}).json()["tokens"]
    by_text = client.completions.create(model=model, prompt="The sky is", max_tokens=8, temperature=0.0)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0.0)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == by_ids.usage.prompt_tokens == len(ids)
    assert by_text.object == "text_completion" and by_text.id.startswith("cmpl-")
    # OpenAI's default budget for completions is 16 tokens.
    default = client.completions.create(model=model, prompt=ids, extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16 and default.choices[0].finish_reason == "length"

    chunks = list(client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0.0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == by_ids.choices[0].text
    assert chunks[-1].usage.completion_tokens == by_ids.usage.completion_tokens

    lp = client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0.0, logprobs=2,
                                   extra_body={"ignore_eos": True}).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)


# ------------------------------------------------------------------------------------------------ concurrency

def test_16_concurrent_streams_equal_solo(server, model):
    """Each of 16 streamed requests run together gives what it gives alone (greedy and seeded sampling)."""
    prompts = [[{"role": "user", "content": "word " * (1 + 3 * i)}] for i in range(16)]
    settings = [{"temperature": 0.0} if i % 2 == 0 else {"temperature": 1.0, "seed": 1000 + i} for i in range(16)]

    async def run(ac, i):
        text, finish = "", None
        stream = await ac.chat.completions.create(model=model, messages=prompts[i], max_tokens=12 + i % 5,
                                                  stream=True, extra_body={"ignore_eos": i % 3 == 0},
                                                  **settings[i])
        async for c in stream:
            if c.choices:
                text += c.choices[0].delta.content or ""
                finish = c.choices[0].finish_reason or finish
        return text, finish

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120.0) as ac:
            solo = [await run(ac, i) for i in range(16)]
            together = await asyncio.wait_for(asyncio.gather(*(run(ac, i) for i in range(16))), 240)
        return solo, together

    solo, together = asyncio.run(main())
    assert all(f in ("stop", "length") for _, f in solo)
    for i in range(16):
        assert together[i] == solo[i], f"request {i} differs when run with 15 others"


@pytest.mark.parametrize("n", [1, 3])
def test_client_disconnect_frees_state(server, http, model, n):
    """A client that leaves mid-stream or gives up on a non-streamed reply: every choice of it is cancelled."""
    baseline = wait_idle(http, http.get("/health").json())
    before = http.get("/metrics").text
    body = {"model": model, "messages": MESSAGES, "max_tokens": MAX_MODEL_LEN // 2, "ignore_eos": True,
            "stream": True, "n": n, "temperature": 1.0}
    with httpx.Client(base_url=server.url, timeout=60.0) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break
        # Leaving the block closes the connection mid-stream.
    mid = http.get("/health").json()
    after = wait_idle(http, baseline)
    assert {k: after[k] for k in baseline if k != "status"} == {k: baseline[k] for k in baseline if k != "status"}
    # The request really stopped early: far fewer tokens generated than it asked for.
    m = http.get("/metrics").text
    generated = metric(m, "qwen_jax:generation_tokens_total") - metric(before, "qwen_jax:generation_tokens_total")
    assert generated < n * MAX_MODEL_LEN // 2, (generated, mid)
    assert metric(m, "qwen_jax:request_success_total", finished_reason="abort") \
        == metric(before, "qwen_jax:request_success_total", finished_reason="abort") + n

    # Non-streamed: the client gives up (timeout) and the server cancels the request.
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=0.5)
    after = wait_idle(http, baseline)
    assert after["running"] == 0 and after["free_pages"] == baseline["free_pages"]
    assert after["free_slots"] == baseline["free_slots"]
    m2 = http.get("/metrics").text
    assert metric(m2, "qwen_jax:request_success_total", finished_reason="abort") \
        == metric(m, "qwen_jax:request_success_total", finished_reason="abort") + n


# --------------------------------------------------------------------------------------------------- metrics

def test_metrics(http, model):
    wait_idle(http, http.get("/health").json())
    before = http.get("/metrics").text
    ids = http.post("/tokenize", json={"prompt": "count these tokens please"}).json()["tokens"]
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 7, "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] == 7
    after = http.get("/metrics")
    assert after.headers["content-type"].startswith("text/plain")
    m = after.text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert f"# TYPE qwen_jax:{name} histogram" in m
        assert metric(m, f"qwen_jax:{name}_count", model_name=model) > metric(before, f"qwen_jax:{name}_count")
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"# TYPE qwen_jax:{name} gauge" in m and f'qwen_jax:{name}{{model_name="{model}"}}' in m
    for name in ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
                 "spec_decode_num_drafts_total"):
        assert f'qwen_jax:{name}{{model_name="{model}"}}' in m
    assert metric(m, "qwen_jax:prompt_tokens_total") - metric(before, "qwen_jax:prompt_tokens_total") == len(ids)
    assert metric(m, "qwen_jax:generation_tokens_total") - metric(before, "qwen_jax:generation_tokens_total") == 7
    assert metric(m, "qwen_jax:request_success_total", finished_reason="length", model_name=model) \
        == metric(before, "qwen_jax:request_success_total", finished_reason="length") + 1
    # 7 tokens: 6 gaps between them.
    assert metric(m, "qwen_jax:inter_token_latency_seconds_count") \
        - metric(before, "qwen_jax:inter_token_latency_seconds_count") == 6


def test_prompt_cache_resumes_a_repeated_prompt(http, model):
    """The server keeps prompt states by default (--prompt-cache 4): the same long prompt again resumes from one
    (usage.prompt_tokens_details.cached_tokens, the prefix_cache metrics) with the same reply and logprobs;
    /reset_prefix_cache drops the kept states and gives their pages back."""
    messages = [{"role": "system", "content": "Answer in the voice of a ship's log. " * 12}] + MESSAGES
    body = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0.8, "seed": 3, "logprobs": True}
    http.post("/reset_prefix_cache")
    idle = wait_idle(http, http.get("/health").json())
    before = http.get("/metrics").text
    first = http.post("/v1/chat/completions", json=body).json()
    prompt = first["usage"]["prompt_tokens"]
    assert prompt > 128 and first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    second = http.post("/v1/chat/completions", json=body).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (prompt - 1) // 64 * 64
    assert second["choices"][0]["message"] == first["choices"][0]["message"]
    assert second["choices"][0]["logprobs"] == first["choices"][0]["logprobs"]
    m = http.get("/metrics").text
    assert metric(m, "qwen_jax:prefix_cache_hits_total") - metric(before, "qwen_jax:prefix_cache_hits_total") == cached
    assert metric(m, "qwen_jax:prefix_cache_queries_total") \
        - metric(before, "qwen_jax:prefix_cache_queries_total") == 2 * prompt
    assert http.get("/health").json()["prompt_cache_entries"] >= 1
    assert http.post("/reset_prefix_cache").json()["cleared"] >= 1
    h = wait_idle(http, idle)
    assert h["free_pages"] == idle["free_pages"] and h["prompt_cache_entries"] == 0


# ---------------------------------------------------------------------------------------------------- errors

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
OK_CHAT = {"messages": MESSAGES, "max_tokens": 2}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# A parameters schema with a keyword the grammar cannot enforce, as the third tool.
PATTERN_TOOLS = TOOLS + [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in (
    ("now", None), ("code", {"type": "object", "properties": {"x": {"type": "integer", "multipleOf": 2}}}))]

# (route, raw body, status, param, code)
BAD_INPUTS = [
    (CHAT, b"{not json", 400, None, None),
    (CHAT, b"", 400, None, None),
    (CHAT, b"[1, 2]", 400, None, None),
    (CHAT, json.dumps({**OK_CHAT, "temprature": 0.5}).encode(), 400, "temprature", None),
    (CHAT, json.dumps({"max_tokens": 2}).encode(), 400, "messages", None),
    (CHAT, json.dumps({**OK_CHAT, "messages": []}).encode(), 400, "messages", None),
    (CHAT, json.dumps({**OK_CHAT, "messages": [{"role": "wizard", "content": "x"}]}).encode(), 400,
     "messages[0].role", None),
    (CHAT, json.dumps({**OK_CHAT, "messages": [{"role": "user", "content": 5}]}).encode(), 400,
     "messages[0].content", None),
    (CHAT, json.dumps({**OK_CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}).encode(), 400,
     "messages[0].content[0]", None),
    (CHAT, json.dumps({**OK_CHAT, "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {}}]}]}).encode(), 400, "messages[0].content", None),
    (CHAT, json.dumps({**OK_CHAT, "n": 0}).encode(), 400, "n", None),
    (CHAT, json.dumps({**OK_CHAT, "n": 129}).encode(), 400, "n", None),
    (CHAT, json.dumps({**OK_CHAT, "n": 1.5}).encode(), 400, "n", None),
    (CHAT, json.dumps({**OK_CHAT, "temperature": True}).encode(), 400, "temperature", None),
    (CHAT, json.dumps({**OK_CHAT, "max_tokens": True}).encode(), 400, "max_tokens", None),
    (CHAT, json.dumps({**OK_CHAT, "max_tokens": "5"}).encode(), 400, "max_tokens", None),
    (CHAT, json.dumps({**OK_CHAT, "max_tokens": 2.5}).encode(), 400, "max_tokens", None),
    (CHAT, json.dumps({**OK_CHAT, "max_tokens": 0}).encode(), 400, "max_tokens", None),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400, "temperature", None),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}', 400, "top_p", None),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "min_p": 1e999}', 400, "min_p", None),
    (CHAT, json.dumps({**OK_CHAT, "temperature": -1}).encode(), 400, "temperature", None),
    (CHAT, json.dumps({**OK_CHAT, "top_p": 0}).encode(), 400, "top_p", None),
    (CHAT, json.dumps({**OK_CHAT, "top_k": 1.5}).encode(), 400, "top_k", None),
    (CHAT, json.dumps({**OK_CHAT, "seed": -3}).encode(), 400, "seed", None),
    (CHAT, json.dumps({**OK_CHAT, "seed": 2 ** 64}).encode(), 400, "seed", None),
    (CHAT, json.dumps({**OK_CHAT, "stop": 7}).encode(), 400, "stop", None),
    (CHAT, json.dumps({**OK_CHAT, "stop": [""]}).encode(), 400, "stop", None),
    (CHAT, json.dumps({**OK_CHAT, "stream": "yes"}).encode(), 400, "stream", None),
    (CHAT, json.dumps({**OK_CHAT, "stream_options": {"include_usage": True}}).encode(), 400, "stream_options",
     None),
    (CHAT, json.dumps({**OK_CHAT, "top_logprobs": 3}).encode(), 400, "top_logprobs", None),
    (CHAT, json.dumps({**OK_CHAT, "logprobs": True, "top_logprobs": 50}).encode(), 400, "top_logprobs", None),
    (CHAT, json.dumps({**OK_CHAT, "presence_penalty": 2.5}).encode(), 400, "presence_penalty", None),
    (CHAT, json.dumps({**OK_CHAT, "frequency_penalty": "1"}).encode(), 400, "frequency_penalty", None),
    (CHAT, json.dumps({**OK_CHAT, "repetition_penalty": 0}).encode(), 400, "repetition_penalty", None),
    (CHAT, json.dumps({**OK_CHAT, "logit_bias": {"abc": 1}}).encode(), 400, "logit_bias", None),
    (CHAT, json.dumps({**OK_CHAT, "logit_bias": {"5": 101}}).encode(), 400, "logit_bias.5", None),
    (CHAT, json.dumps({**OK_CHAT, "logit_bias": {"-5": 1}}).encode(), 400, "logit_bias", None),
    (COMPLETIONS, json.dumps({"prompt": "a", "logit_bias": {"999999": 1}}).encode(), 400, "logit_bias", None),
    (CHAT, json.dumps({**OK_CHAT, "chat_template_kwargs": {"tokenize": True}}).encode(), 400,
     "chat_template_kwargs", None),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": NaN}}', 400,
     "chat_template_kwargs", None),
    (CHAT, json.dumps({**OK_CHAT, "messages": [{"role": "user", "content": "a"},
                                               {"role": "system", "content": "late"}]}).encode(), 400,
     "messages", None),
    (CHAT, json.dumps({**OK_CHAT, "max_tokens": MAX_MODEL_LEN}).encode(), 400, "messages",
     "context_length_exceeded"),
    (CHAT, json.dumps({"messages": [{"role": "user", "content": "word " * MAX_MODEL_LEN}]}).encode(), 400,
     "messages", "context_length_exceeded"),
    (COMPLETIONS, json.dumps({"prompt": [1 + i % 400 for i in range(MAX_MODEL_LEN)]}).encode(), 400, "prompt",
     "context_length_exceeded"),
    (COMPLETIONS, json.dumps({"prompt": [1, 2, 10 ** 6]}).encode(), 400, "prompt", None),
    (COMPLETIONS, json.dumps({"prompt": [1, -2]}).encode(), 400, "prompt", None),
    (COMPLETIONS, json.dumps({"prompt": [1, True]}).encode(), 400, "prompt", None),
    (COMPLETIONS, json.dumps({"prompt": []}).encode(), 400, "prompt", None),
    (COMPLETIONS, json.dumps({"prompt": ""}).encode(), 400, "prompt", None),
    (COMPLETIONS, json.dumps({"prompt": ["a", 5]}).encode(), 400, "prompt", None),
    (COMPLETIONS, json.dumps({"prompt": [[1, 2], []]}).encode(), 400, "prompt", None),
    (COMPLETIONS, json.dumps({"prompt": [[1, 2], [3, True]]}).encode(), 400, "prompt", None),
    (COMPLETIONS, json.dumps({"prompt": ["a"] * 129}).encode(), 400, "prompt", None),
    (COMPLETIONS, json.dumps({"prompt": ["a"] * 33, "n": 2}).encode(), 400, "n", None),  # 66 > the queue's 64
    (COMPLETIONS, json.dumps({"prompt": {"text": "a"}}).encode(), 400, "prompt", None),
    (COMPLETIONS, json.dumps({}).encode(), 400, "prompt", None),
    (COMPLETIONS, json.dumps({"prompt": "a", "logprobs": True}).encode(), 400, "logprobs", None),
    (COMPLETIONS, json.dumps({"prompt": "a", "echo": True}).encode(), 400, "echo", None),
    (COMPLETIONS, json.dumps({"prompt": "a", "n": MAX_QUEUED + 1}).encode(), 400, "n", None),  # never fits the queue
    (CHAT, json.dumps({**OK_CHAT, "tools": [{"type": "function"}]}).encode(), 400, "tools[0].function", None),
    (CHAT, json.dumps({**OK_CHAT, "tools": [{"type": "retrieval", "function": {"name": "f"}}]}).encode(), 400,
     "tools[0].type", None),
    (CHAT, json.dumps({**OK_CHAT, "tools": [{"type": "function", "function": {"name": ""}}]}).encode(), 400,
     "tools[0].function.name", None),
    (CHAT, json.dumps({**OK_CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]})
     .encode(), 400, "tools[0].function.parameters", None),
    (CHAT, json.dumps({**OK_CHAT, "tools": []}).encode(), 400, "tools", None),
    (CHAT, json.dumps({**OK_CHAT, "tools": {"name": "f"}}).encode(), 400, "tools", None),
    (CHAT, json.dumps({**OK_CHAT, "tool_choice": "required"}).encode(), 400, "tool_choice", None),
    (CHAT, json.dumps({**OK_CHAT, "tool_choice": NAMED}).encode(), 400, "tool_choice", None),
    (CHAT, json.dumps({**OK_CHAT, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}})
     .encode(), 400, "tool_choice", None),
    (CHAT, json.dumps({**OK_CHAT, "tools": TOOLS, "tool_choice": {"type": "function"}}).encode(), 400,
     "tool_choice", None),
    (CHAT, json.dumps({**OK_CHAT, "tools": TOOLS, "tool_choice": {**NAMED, "extra": 1}}).encode(), 400,
     "tool_choice", None),
    (CHAT, json.dumps({**OK_CHAT, "tools": TOOLS, "tool_choice": "required",
                       "response_format": {"type": "json_object"}}).encode(), 400, "response_format", None),
    (CHAT, json.dumps({**OK_CHAT, "tools": TOOLS, "tool_choice": NAMED, "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}}).encode(), 400,
     "response_format", None),
    (CHAT, json.dumps({**OK_CHAT, "tools": PATTERN_TOOLS, "tool_choice": "required"}).encode(), 400, "tools", None),
    (CHAT, json.dumps({**OK_CHAT, "tools": PATTERN_TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "code"}}}).encode(), 400, "tools", None),
    (CHAT, json.dumps({**OK_CHAT, "tool_choice": "sometimes"}).encode(), 400, "tool_choice", None),
    (CHAT, json.dumps({**OK_CHAT, "parallel_tool_calls": "yes"}).encode(), 400, "parallel_tool_calls", None),
    (CHAT, json.dumps({**OK_CHAT, "response_format": {"type": "xml"}}).encode(), 400, "response_format.type", None),
    (CHAT, json.dumps({**OK_CHAT, "response_format": {"type": "json_schema"}}).encode(), 400, "response_format",
     None),
    (CHAT, json.dumps({**OK_CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "string", "pattern": "(?=a)"}}}}).encode(), 400, "response_format", None),
    (CHAT, json.dumps({**OK_CHAT, "structured_outputs": {"regex": "(a)\\1"}}).encode(), 400, "structured_outputs",
     None),
    (CHAT, json.dumps({**OK_CHAT, "structured_outputs": {"regex": 5}}).encode(), 400, "structured_outputs.regex",
     None),
    (CHAT, json.dumps({**OK_CHAT, "structured_outputs": {"grammar": "root ::= x"}}).encode(), 400,
     "structured_outputs", None),
    (CHAT, json.dumps({**OK_CHAT, "structured_outputs": {"grammar": "root ::= root \"a\" | \"b\""}}).encode(), 400,
     "structured_outputs", None),
    (CHAT, json.dumps({**OK_CHAT, "structured_outputs": {"structural_tag": {}}}).encode(), 400,
     "structured_outputs", None),
    (CHAT, json.dumps({**OK_CHAT, "structured_outputs": {"regex": "a", "choice": ["a"]}}).encode(), 400,
     "structured_outputs", None),
    (CHAT, json.dumps({**OK_CHAT, "structured_outputs": {}}).encode(), 400, "structured_outputs", None),
    (CHAT, json.dumps({**OK_CHAT, "min_tokens": 3}).encode(), 400, "min_tokens", None),
    (CHAT, json.dumps({**OK_CHAT, "min_tokens": -1}).encode(), 400, "min_tokens", None),
    (CHAT, json.dumps({**OK_CHAT, "min_tokens": 1, "response_format": {"type": "json_object"}}).encode(), 400,
     "min_tokens", None),
    (CHAT, json.dumps({**OK_CHAT, "guided_regex": "a", "structured_outputs": {"regex": "a"}}).encode(), 400,
     "guided_regex", None),
    (CHAT, json.dumps({**OK_CHAT, "guided_regex": "a", "guided_choice": ["a"]}).encode(), 400, "guided_choice", None),
    (CHAT, json.dumps({**OK_CHAT, "guided_json": "{not json"}).encode(), 400, "guided_json", None),
    (CHAT, json.dumps({**OK_CHAT, "guided_regex": "(?=a)a"}).encode(), 400, "guided_regex", None),
    (CHAT, json.dumps({**OK_CHAT, "guided_choice": ["a", ""]}).encode(), 400, "guided_choice[1]", None),
    (CHAT, json.dumps({**OK_CHAT, "guided_json": {"type": "integer"},
                       "response_format": {"type": "json_object"}}).encode(), 400, "guided_json", None),
    (CHAT, json.dumps({**OK_CHAT, "structured_outputs": {"choice": ["a", ""]}}).encode(), 400,
     "structured_outputs.choice[1]", None),
    (CHAT, json.dumps({**OK_CHAT, "structured_outputs": {"json": {"type": "string", "format": "date",
                                                                  "maxLength": 5000}}}).encode(),
     400, "structured_outputs", None),
    (CHAT, json.dumps({**OK_CHAT, "structured_outputs": {"choice": ["a"]},
                       "response_format": {"type": "json_object"}}).encode(), 400, "structured_outputs", None),
    (COMPLETIONS, json.dumps({"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"$ref": "#/$defs/missing"}}}}).encode(), 400, "response_format", None),
    ("/tokenize", json.dumps({"messages": MESSAGES, "tools": [{"type": "function"}]}).encode(), 400,
     "tools[0].function", None),
    ("/tokenize", json.dumps({"prompt": 5}).encode(), 400, "prompt", None),
    ("/tokenize", json.dumps({"prompt": "a", "extra": 1}).encode(), 400, "extra", None),
    ("/tokenize", json.dumps({"messages": [{"role": "user"}], "add_generation_prompt": 1}).encode(), 400,
     "add_generation_prompt", None),
    ("/tokenize", b"{", 400, None, None),
    ("/detokenize", json.dumps({"tokens": [1, 10 ** 7]}).encode(), 400, "tokens", None),
    ("/detokenize", json.dumps({"tokens": "abc"}).encode(), 400, "tokens", None),
    (CHAT, json.dumps({**OK_CHAT, "model": "no-such-model"}).encode(), 404, "model", "model_not_found"),
    (COMPLETIONS, json.dumps({"prompt": "a", "model": "no-such-model"}).encode(), 404, "model", "model_not_found"),
    ("/tokenize", json.dumps({"prompt": "a", "model": "no-such-model"}).encode(), 404, "model", "model_not_found"),
]


@pytest.mark.parametrize("route,body,status,param,code", BAD_INPUTS,
                         ids=[f"{i}-{r.rsplit('/', 1)[-1]}-{s}" for i, (r, _, s, _, _) in enumerate(BAD_INPUTS)])
def test_bad_input(http, route, body, status, param, code):
    r = http.post(route, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param and err["code"] == code
    if code == "context_length_exceeded":
        assert str(MAX_MODEL_LEN) in err["message"]


def test_forced_call_schema_refused(http):
    """A parameters schema the grammar cannot enforce: the 400 names the tool, the keyword and where it is."""
    for choice in ("required", {"type": "function", "function": {"name": "code"}}):
        r = http.post(CHAT, json={**OK_CHAT, "tools": PATTERN_TOOLS, "tool_choice": choice})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == \
            "tools[2].function.parameters: 'multipleOf' is not supported (at #/properties/x)"


def test_bad_input_via_openai_client(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=MESSAGES, n=0)
    assert e.value.status_code == 400 and e.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=[i % 400 for i in range(MAX_MODEL_LEN + 5)], max_tokens=1)
    assert e.value.code == "context_length_exceeded"


def test_not_found_and_method(http):
    for method, path in (("GET", "/v1/nothing"), ("POST", "/v2/chat/completions"), ("GET", "/")):
        r = http.request(method, path)
        assert r.status_code == 404
        assert r.json()["error"]["type"] == "invalid_request_error" and path in r.json()["error"]["message"]
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_body_too_large(server, http):
    big = b'{"prompt": "' + b"a" * (MAX_BODY + 10) + b'"}'
    r = http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit is enforced while the body arrives
        for i in range(0, len(big), 1 << 16):
            yield big[i:i + (1 << 16)]

    r = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert http.get("/health").status_code == 200


def test_server_survived(http, server):
    """After every bad request above, the same process still serves."""
    assert server.proc.poll() is None
    r = http.post("/v1/completions", json={"prompt": "still", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert "Traceback" not in server.log_text()


def test_bench_against_server(server, tmp_path, capsys):
    from server import bench
    out = tmp_path / "bench.json"
    rc = bench.main(["--url", server.url, "--concurrency", "1,3", "--prompt-tokens", "40", "--max-tokens", "6",
                     "--num-prompts", "3", "--warmup", "1", "--json", str(out)])
    assert rc == 0
    levels = json.loads(out.read_text())["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 3]
    for lv in levels:
        assert lv["completed"] == 3 and lv["failed"] == 0
        # ignore_eos: every request yields exactly max_tokens, after an exact 40-token prompt.
        assert lv["output_tokens"] == 3 * 6 and lv["input_tokens"] == 3 * 40
        for key in ("ttft_ms", "itl_ms", "tpot_ms"):
            d = lv[key]
            assert 0 < d["p50"] <= d["p90"] <= d["p99"]
        assert lv["output_throughput"] > 0
    printed = capsys.readouterr().out
    assert printed.count("TTFT (ms)") == 2 and "Output token throughput" in printed
