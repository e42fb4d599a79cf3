"""The engine on captures/tiny (reference path, CPU): concurrent ≡ solo token for token (greedy and seeded, fp32
and bf16), greedy ≡ HF transformers, reproducible sampling, streaming (sync and async), stop ids / stop strings /
lengths, logprobs, cancellation, per-request errors, admission errors, and pools back to baseline every time."""

import asyncio
import dataclasses
import json
import time

import jax.numpy as jnp
import numpy as np
import pytest

from qwen_jax import programs as P
from qwen_jax import sampling, structured
from qwen_jax.checkpoint import load_checkpoint, load_tokenizer
from qwen_jax.config import QuantConfig
from qwen_jax.engine.api import ContextLengthExceeded, EngineOverloaded, GenerationRequest, SamplingOptions
from qwen_jax.engine.engine import Engine
from qwen_jax.model import Backend
from tests.conftest import CAPTURES
from tests.tiny_model import tiny

MAX_LEN = 512
TIMEOUT = 120  # seconds per event before a test gives up (the shared CI box is slow, never this slow)


def _engine(dtype: str, **kw) -> Engine:
    ck = load_checkpoint(CAPTURES / "tiny", dtype=jnp.float32 if dtype == "float32" else jnp.bfloat16,
                         progress=False)
    # Prompt chunks of up to 256 rows when the engine is idle and 128 rows a call while others decode, so a
    # prompt that arrives during decoding is cut (and packed with others) differently from the same prompt alone.
    buckets = P.Buckets(prompt_rows=(64, 128, 256), prompt_lanes=(4,), decode_streams=(16,), logprobs=3)
    args = dict(dtype=dtype, max_model_len=MAX_LEN, parallel=16, max_queued=32, backend=Backend(),
                buckets=buckets, prefill_step=128, max_logprobs=3, progress=False)
    args.update(kw)
    return Engine(ck.params, ck.config, load_tokenizer(CAPTURES / "tiny"), **args)


@pytest.fixture(scope="module")
def eng():
    e = _engine("float32")
    e.start()
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def eng_bf16():
    e = _engine("bfloat16")
    e.start()
    yield e
    e.shutdown()


def _baseline(e: Engine):
    s = e.stats()
    assert (s.running, s.waiting, s.free_pages, s.free_slots) == (0, 0, s.total_pages, s.total_slots), s


def _requests(seed: int) -> list[GenerationRequest]:
    rng = np.random.default_rng(seed)
    lengths = [3, 300, 17, 64, 65, 129, 200, 5, 250, 90, 1, 128, 40, 180, 33, 77]
    reqs = []
    for i, n in enumerate(lengths):
        greedy = i % 2 == 0
        opts = SamplingOptions() if greedy else SamplingOptions(
            temperature=[0.7, 1.0, 1.3][i % 3], top_k=[0, 40, 5][i % 3], top_p=[1.0, 0.9, 0.95][i % 3],
            min_p=[0.0, 0.05, 0.0][i % 3], seed=None if i % 4 == 1 else 1000 + i)
        reqs.append(GenerationRequest(tuple(int(t) for t in rng.integers(0, 490, size=n)),
                                      max_tokens=int(rng.integers(4, 30)), sampling=opts, ignore_eos=i % 3 != 0,
                                      logprobs=[None, 0, 3][i % 3], request_id=f"r{i}"))
    return reqs


def _solo(e: Engine, reqs):
    out = []
    for r in reqs:
        out.append(e.submit(r).result(TIMEOUT))
        _baseline(e)
    return out


def _concurrent(e: Engine, reqs):
    """Half the requests at once; the rest once the first ones are decoding (their prompts are cut differently)."""
    first = [e.submit(r) for r in reqs[:8]]
    deadline = time.monotonic() + TIMEOUT
    while first[1].first_token_time is None:  # request 1 (300 tokens) has its first token: the others decode
        assert time.monotonic() < deadline
        time.sleep(0.005)
    rest = [e.submit(r) for r in reqs[8:]]
    out = [h.result(TIMEOUT) for h in first + rest]
    return out


def _check_same(solo, together):
    for a, b in zip(solo, together):
        assert b.finish_reason in ("stop", "length")
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert a.logprobs == b.logprobs  # float equality: the same bits


def concurrent_equals_solo(e: Engine, reqs) -> list:
    """Each request alone, then all of them with half arriving while the others decode: the same replies, the
    pools back to baseline, nothing traced or compiled in the steady state. -> the solo replies."""
    solo = _solo(e, reqs)
    with P.CompileWatch() as watch:
        together = _concurrent(e, reqs)
    _check_same(solo, together)
    _baseline(e)
    assert (watch.traces, watch.compiles) == (0, 0)  # steady state: nothing traced or compiled
    return solo


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_concurrent_equals_solo(dtype, eng, eng_bf16):
    e = eng if dtype == "float32" else eng_bf16
    reqs = _requests(0)
    solo = concurrent_equals_solo(e, reqs)
    # the odd requests sampled: their replies are not the greedy ones
    greedy = _solo(e, [dataclasses.replace(r, sampling=SamplingOptions()) for r in reqs[1:7:2]])
    assert all(s.token_ids != g.token_ids for s, g in zip(solo[1:7:2], greedy))


def test_greedy_matches_hf_transformers(eng):
    z = np.load(CAPTURES / "refs" / "hf-tiny-f32.npz")
    for name in ("long", "repeat"):
        want = z[f"{name}.gen_ids"].tolist()
        req = GenerationRequest(tuple(z[f"{name}.prompt_ids"].tolist()), len(want), ignore_eos=True)
        assert eng.submit(req).result(TIMEOUT).token_ids == tuple(want)
    _baseline(eng)


def _penalized_reference(e: Engine, req: GenerationRequest) -> tuple[int, ...]:
    """The reply by the serial runner (captures/tiny, fp32, reference ops): each token the sampling rule's draw
    (`sampling.sample_reference`) from the logits penalized by `sampling.penalize_reference` over the prompt and
    the tokens before it. With a grammar, a matcher of its own (`structured.Matcher`) sets -inf in the bias row
    where the grammar forbids a token, from the first token or once `grammar_after` came, and the reply ends where
    the grammar's document does (or at a stop id, unless ignore_eos). With a thinking budget, the token at that index
    is the think block's end unless an earlier one was."""
    from qwen_jax.runner import Runner
    ck = load_checkpoint(CAPTURES / "tiny", dtype=jnp.float32, progress=False)
    runner = Runner(ck.params, ck.config, dtype=jnp.float32, backend=Backend(), max_len=MAX_LEN)
    s = req.sampling
    rp = sampling.RequestPenalties(s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.logit_bias,
                                   masked=req.grammar is not None or req.thinking_budget is not None)
    pen, base = sampling.pack_penalties([rp], 1), rp.bias_row(ck.config.text.vocab_size)
    stops = set(req.stop_token_ids) | (set() if req.ignore_eos else set(ck.config.eos_token_ids))
    matcher = structured.Matcher(req.grammar, e.token_bytes(), stops) if req.grammar is not None else None
    on = matcher is not None and req.grammar_after is None
    prompt = list(req.prompt_ids)
    logits, out, pos = runner.prefill(prompt), [], len(prompt)
    for _ in range(req.max_tokens):
        bias = np.where(matcher.allowed(), base, -np.inf) if on else base
        if len(out) == req.thinking_budget and req.think_end not in out:
            bias = np.where(np.arange(len(base)) == req.think_end, 0.0, -np.inf)
        z = sampling.penalize_reference(logits[None], pen, [prompt], [out], bias[None]).astype(np.float32)
        out.append(int(sampling.sample_reference(z, P.sample_params([e._sampling_rule(req)], [pos], 1))[0]))
        if out[-1] in stops:
            break
        if on:
            matcher.advance(out[-1])
            if matcher.terminated:
                break
        elif matcher is not None and out[-1] == req.grammar_after:
            on = True
        logits = runner.step(out[-1], pos)
        pos += 1
    return tuple(out)


def test_thinking_budget_closes_the_think_block(eng):
    """A thinking budget (with `think_end` some token id): the reply's token at the budget's index is think_end unless
    an earlier token was, then it goes on as the serial reference with that token forced does
    (`_penalized_reference`), greedy and seeded; budget 0 forces the first token (the prompt pass's draw); a reply
    that closed the block itself is the one without a budget; all at once beside other requests, as alone; the slot's
    bias row is every id's again after the forced token (the next request in the slot is its solo reply)."""
    rng = np.random.default_rng(13)
    prompt = tuple(int(t) for t in rng.integers(0, 490, size=40))
    free = eng.submit(GenerationRequest(prompt, 20, ignore_eos=True)).result(TIMEOUT).token_ids
    end = next(t for t in range(480, 0, -1) if t not in free)
    early = next(i for i in range(2, 8) if free[i] not in free[:i])
    seeded = SamplingOptions(temperature=0.9, top_k=40, seed=21)
    reqs = [GenerationRequest(prompt, 20, ignore_eos=True, thinking_budget=6, think_end=end),
            GenerationRequest(prompt, 20, seeded, ignore_eos=True, thinking_budget=3, think_end=end),
            GenerationRequest(prompt, 12, ignore_eos=True, thinking_budget=0, think_end=end),
            GenerationRequest(prompt, 20, ignore_eos=True, thinking_budget=10, think_end=free[early])]
    others = _requests(4)[:6]
    solo = [eng.submit(r).result(TIMEOUT).token_ids for r in reqs]
    for req, got in zip(reqs, solo):
        assert got == _penalized_reference(eng, req)
    assert solo[0][6] == end and solo[0][:6] == free[:6] and solo[1][3] == end and solo[2][0] == end
    assert solo[3] == free  # closed at `early` < 10 by the model: nothing forced
    together = [h.result(TIMEOUT) for h in [eng.submit(r) for r in reqs + others]]
    assert [r.token_ids for r in together[:4]] == solo
    _check_same([eng.submit(r).result(TIMEOUT) for r in others], together[4:])
    _baseline(eng)
    for bad in (dict(thinking_budget=-1, think_end=end), dict(thinking_budget=2, think_end=None),
                dict(thinking_budget=2, think_end=10 ** 6)):
        with pytest.raises(ValueError, match="thinking_budget"):
            eng.submit(GenerationRequest(prompt, 4, **bad))


def test_penalties_follow_the_serial_reference(eng):
    """Requests with penalties (greedy and seeded, all three kinds, and a logit bias) among requests without, all at
    once: each penalized reply is the serial reference's (`_penalized_reference`), the others their solo replies;
    penalties that favour repeats and ones against them both change the greedy reply; a bias of 100 decides it."""
    rng = np.random.default_rng(11)
    prompt = lambda n: tuple(int(t) for t in rng.integers(0, 490, size=n))  # noqa: E731
    penalized = [
        GenerationRequest(prompt(30), 16, SamplingOptions(repetition_penalty=1.8), ignore_eos=True),
        GenerationRequest(prompt(20), 16, SamplingOptions(presence_penalty=-2.0, frequency_penalty=-1.0),
                          ignore_eos=True),
        GenerationRequest(prompt(45), 16, SamplingOptions(temperature=0.9, top_k=40, seed=5, presence_penalty=1.0,
                                                          frequency_penalty=0.5, repetition_penalty=1.2),
                          ignore_eos=True),
        GenerationRequest(prompt(25), 16, SamplingOptions(temperature=0.8, seed=9, repetition_penalty=1.1,
                                                          logit_bias=((7, 6.0), (11, 4.0), (300, -3.0))),
                          ignore_eos=True),
    ]
    plain = _requests(0)[:4]
    solo = _solo(eng, plain)
    handles = [eng.submit(r) for r in penalized + plain]
    got = [h.result(TIMEOUT) for h in handles]
    _check_same(solo, got[len(penalized):])
    _baseline(eng)
    for req, reply in zip(penalized, got):
        assert reply.token_ids == _penalized_reference(eng, req)
    unpenalized = _solo(eng, [dataclasses.replace(r, sampling=dataclasses.replace(
        r.sampling, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)) for r in penalized[:2]])
    assert all(a.token_ids != b.token_ids for a, b in zip(got, unpenalized))
    assert len(set(got[1].token_ids)) < len(set(unpenalized[1].token_ids))  # favouring repeats: fewer distinct
    assert {7, 11} & set(got[3].token_ids)  # the biased tokens come up
    only = eng.submit(GenerationRequest(prompt(10), 6, SamplingOptions(logit_bias=((42, 100.0),)),
                                        ignore_eos=True)).result(TIMEOUT)
    assert only.token_ids == (42,) * 6  # a bias of 100 on one token: greedy picks it every time


# A schema of the kinds users send (pydantic-like): required and optional properties, bounded strings and arrays,
# enums, integers, booleans, a nested object.
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "count": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 2},
                         "ok": {"type": "boolean"},
                         "where": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
          "required": ["name", "count", "where"], "additionalProperties": False}


def whitespace_bias(tokens: structured.TokenBytes) -> tuple[tuple[int, float], ...]:
    """A logit bias of -100 on every whitespace-only token: the random tiny models favour whitespace, which JSON
    allows between tokens (16 bytes a run), so without it their constrained replies rarely end within a test's
    budget."""
    return tuple((t, -100.0) for t, b in enumerate(tokens.token_bytes) if b and not b.strip())


def _follows_schema(value) -> bool:
    keys = list(value)
    return (isinstance(value, dict) and {"name", "count", "where"} <= set(keys)
            and keys == [k for k in SCHEMA["properties"] if k in value]
            and isinstance(value["name"], str) and len(value["name"]) <= 8
            and isinstance(value["count"], int) and not isinstance(value["count"], bool)
            and all(t in ("red", "green", "blue") for t in value.get("tags", [])) and len(value.get("tags", [])) <= 2
            and isinstance(value.get("ok", True), bool)
            and list(value["where"]) == ["x"] and isinstance(value["where"]["x"], (int, float)))


def test_structured_outputs_follow_the_grammar(eng):
    """Structured-output requests (a JSON schema greedy and seeded, any JSON object, a grammar that starts after a
    given token) beside free ones, all at once: each constrained reply is the serial reference's, masks applied
    (`_penalized_reference`), and its solo reply; the free ones are their solo replies; a reply that ended by itself
    is a document of the grammar (json.loads, the schema's rules), one cut by max_tokens a prefix of one."""
    rng = np.random.default_rng(5)
    prompt = lambda n: tuple(int(t) for t in rng.integers(0, 490, size=n))  # noqa: E731
    schema, any_object = structured.compile_json_schema(SCHEMA), structured.compile_json_schema(None)
    free = GenerationRequest(prompt(25), 60, SamplingOptions(temperature=0.8, seed=4))
    after = eng.submit(free).result(TIMEOUT).token_ids[2]  # the grammar starts after the free reply's third token
    # The random model favours whitespace, which JSON allows between tokens (16 bytes a run): a logit bias against
    # the whitespace tokens (it adds to the grammar's mask) lets the first two replies end within their budget.
    spaces = whitespace_bias(eng.token_bytes())
    constrained = [
        GenerationRequest(prompt(30), 120, SamplingOptions(logit_bias=spaces), grammar=schema),
        GenerationRequest(prompt(40), 120, SamplingOptions(temperature=1.0, top_k=50, seed=3, logit_bias=spaces),
                          grammar=schema),
        GenerationRequest(prompt(20), 40, SamplingOptions(temperature=0.7, seed=8), grammar=any_object),
        dataclasses.replace(free, grammar=schema, grammar_after=after),
    ]
    plain = _requests(0)[:4]
    solo_plain, solo = _solo(eng, plain), _solo(eng, constrained)
    got = [h.result(TIMEOUT) for h in [eng.submit(r) for r in constrained + plain]]
    _check_same(solo, got[:len(constrained)])
    _check_same(solo_plain, got[len(constrained):])
    _baseline(eng)
    for req, reply in zip(constrained, got):
        assert reply.token_ids == _penalized_reference(eng, req)
        ids = list(reply.token_ids)
        if req.grammar_after is not None:
            k = ids.index(after) + 1
            assert ids[:k] == list(eng.submit(free).result(TIMEOUT).token_ids[:k])  # free up to it
            ids = ids[k:]
        text = eng.tokenizer.decode(ids, skip_special_tokens=True)
        if reply.finish_reason == "stop":
            value = json.loads(text)
            assert isinstance(value, dict) and (req.grammar is any_object or _follows_schema(value)), text
        else:
            m = structured.Matcher(req.grammar, eng.token_bytes(), eng.stop_ids)
            for t in ids:
                m.advance(t)  # a prefix of a document: every token allowed in turn
    assert [r.finish_reason for r in got[:2]] == ["stop", "stop"]  # the schema's replies end
    assert got[3].token_ids != eng.submit(free).result(TIMEOUT).token_ids  # the grammar changed the free reply


def test_structured_outputs_refused(eng):
    ok = GenerationRequest((1, 2, 3), 4)
    for bad, field in ((dataclasses.replace(ok, grammar={"type": "object"}), "grammar"),
                       (dataclasses.replace(ok, grammar_after=5), "grammar"),
                       (dataclasses.replace(ok, grammar=structured.compile_json_schema(None), grammar_after=10 ** 6),
                        "grammar_after")):
        with pytest.raises(ValueError, match=field):
            eng.submit(bad)
    _baseline(eng)


def test_repetition_penalty_matches_hf_transformers(eng):
    """Greedy under repetition_penalty 1.3: transformers' RepetitionPenaltyLogitsProcessor's continuations
    (captures/refs/hf-tiny-penalties-f32.npz, tools/captures/refs_penalties.py), token for token."""
    z = np.load(CAPTURES / "refs" / "hf-tiny-penalties-f32.npz")
    for name in ("short", "repeat"):
        want = z[f"{name}.rep1.3.gen_ids"].tolist()
        req = GenerationRequest(tuple(z[f"{name}.prompt_ids"].tolist()), len(want), ignore_eos=True,
                                sampling=SamplingOptions(repetition_penalty=1.3))
        assert eng.submit(req).result(TIMEOUT).token_ids == tuple(want)
        plain = np.load(CAPTURES / "refs" / "hf-tiny-f32.npz")[f"{name}.gen_ids"].tolist()
        assert want != plain  # the penalty changes the capture's greedy reply
    _baseline(eng)


def test_seeded_sampling_reproduces(eng):
    prompt = tuple(range(40, 90))
    opts = SamplingOptions(temperature=1.0, top_p=0.95, seed=123)
    req = GenerationRequest(prompt, 20, sampling=opts, ignore_eos=True)
    a, b = eng.submit(req).result(TIMEOUT), eng.submit(req).result(TIMEOUT)
    assert a.token_ids == b.token_ids
    # no seed: the one derived from the prompt (documented in qwen_jax.sampling)
    derived = eng.submit(dataclasses.replace(req, sampling=dataclasses.replace(opts, seed=None))).result(TIMEOUT)
    explicit = eng.submit(dataclasses.replace(req, sampling=dataclasses.replace(
        opts, seed=sampling.derive_seed(prompt)))).result(TIMEOUT)
    assert derived.token_ids == explicit.token_ids
    others = [eng.submit(dataclasses.replace(req, sampling=dataclasses.replace(opts, seed=s))).result(TIMEOUT)
              for s in (1, 2)]
    assert any(o.token_ids != a.token_ids for o in others)
    _baseline(eng)


def test_async_iteration_streams_the_same_reply(eng):
    req = GenerationRequest(tuple(range(100, 160)), 12, ignore_eos=True)
    want = eng.submit(req).result(TIMEOUT)

    async def collect():
        events = [ev async for ev in eng.submit(req)]
        return events

    events = asyncio.run(collect())
    assert all(len(ev.token_ids) == 1 for ev in events)  # one event per decided token
    assert tuple(t for ev in events for t in ev.token_ids) == want.token_ids
    assert "".join(ev.text for ev in events) == want.text
    assert [ev.finish_reason for ev in events] == [None] * 11 + ["length"]
    _baseline(eng)


def test_stop_ids_lengths_and_logprobs(eng):
    prompt = tuple(range(200, 260))
    full = eng.submit(GenerationRequest(prompt, 20, ignore_eos=True, logprobs=3)).result(TIMEOUT)
    assert len(full.token_ids) == 20 and full.finish_reason == "length"
    for tok, lp in zip(full.token_ids, full.logprobs):  # greedy: the chosen token is the top one
        assert lp.token_id == tok and lp.top[0] == (tok, lp.logprob) and len(lp.top) == 3
        assert lp.logprob <= 0 and [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    # a stop id ends the reply at its first occurrence; the id is reported, its text is not
    k = 6
    stop_tok = full.token_ids[k]
    first = full.token_ids.index(stop_tok)
    r = eng.submit(GenerationRequest(prompt, 20, stop_token_ids=(stop_tok,))).result(TIMEOUT)
    assert r.token_ids == full.token_ids[:first + 1] and (r.finish_reason, r.stop_reason) == ("stop", stop_tok)
    assert full.stop_reason is None
    tok = eng.tokenizer
    assert r.text == tok.decode([t for t in full.token_ids[:first] if t < len(tok)], skip_special_tokens=True)
    # the end of the context is a "length" finish, whatever max_tokens says
    r = eng.submit(GenerationRequest(tuple(range(MAX_LEN - 3)), 50, ignore_eos=True)).result(TIMEOUT)
    assert len(r.token_ids) == 3 and r.finish_reason == "length"
    _baseline(eng)


def test_min_tokens_hold_back_stop_ids_and_strings(eng):
    """min_tokens: no stop id among the reply's first min_tokens tokens (the draw goes to the best other token, the
    logprobs staying the raw ones), stop strings looked for only in the text after them; the same reply alone and
    among other streams; bad values refused naming the field."""
    prompt = tuple(range(200, 260))
    full = eng.submit(GenerationRequest(prompt, 24, ignore_eos=True, logprobs=3)).result(TIMEOUT)
    stop_tok = full.token_ids[6]
    first = full.token_ids.index(stop_tok)
    held = GenerationRequest(prompt, 24, stop_token_ids=(stop_tok,), ignore_eos=True, logprobs=3,
                             min_tokens=first + 3)
    r = eng.submit(held).result(TIMEOUT)
    assert r.token_ids[:first] == full.token_ids[:first] and stop_tok not in r.token_ids[:first + 3]
    lp = r.logprobs[first]
    assert lp.top[0][0] == stop_tok and r.token_ids[first] == lp.top[1][0]  # the best token but the stop id
    assert r.finish_reason == "length" or (r.finish_reason == "stop" and r.token_ids[-1] == stop_tok)
    tok = eng.tokenizer
    early = tok.decode([full.token_ids[0]])  # a stop string in the first token's text: it ends the reply there,
    assert early  # but nothing before min_tokens
    plain = GenerationRequest(prompt, 10, ignore_eos=True, stop=(early,))
    assert len(eng.submit(plain).result(TIMEOUT).token_ids) == 1
    both = eng.submit(dataclasses.replace(plain, min_tokens=4)).result(TIMEOUT)
    assert both.token_ids[:4] == full.token_ids[:4] and len(both.token_ids) > 4
    reqs = [held] + _requests(1)[:5]
    solo = _solo(eng, reqs)
    together = [h.result(TIMEOUT) for h in [eng.submit(q) for q in reqs]]
    _check_same(solo, together)
    for bad in (dataclasses.replace(held, min_tokens=25), dataclasses.replace(held, min_tokens=-1),
                dataclasses.replace(held, grammar=structured.compile_json_schema(None))):
        with pytest.raises(ValueError, match="min_tokens"):
            eng.submit(bad)
    _baseline(eng)


def test_stop_string_across_token_boundaries(eng):
    tok = eng.tokenizer
    prompt = tuple(tok("Licensed under the Apache License", add_special_tokens=False)["input_ids"])
    full = eng.submit(GenerationRequest(prompt, 30, ignore_eos=True, skip_special_tokens=False)).result(TIMEOUT)
    pieces = [tok.decode([t]) for t in full.token_ids]
    text = full.text
    # a stop string made of the end of one token's text and the start of the next one's
    i = next(i for i in range(3, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 1
             and "\ufffd" not in pieces[i] + pieces[i + 1])
    stop = pieces[i][-2:] + pieces[i + 1][:1]
    at = text.find(stop)
    r = eng.submit(GenerationRequest(prompt, 30, ignore_eos=True, stop=("never-there", stop),
                                     skip_special_tokens=False)).result(TIMEOUT)
    assert (r.finish_reason, r.stop_reason) == ("stop", stop)
    assert r.text == text[:at]
    # the reply ends on the token that completes the match
    done = next(n for n in range(1, len(full.token_ids) + 1) if stop in tok.decode(list(full.token_ids[:n])))
    assert r.token_ids == full.token_ids[:done]
    _baseline(eng)


def test_cancel_mid_stream_frees_the_stream(eng):
    h = eng.submit(GenerationRequest(tuple(range(10, 50)), 400, ignore_eos=True))
    events = h.events(TIMEOUT)
    got = [next(events) for _ in range(3)]
    assert all(ev.finish_reason is None for ev in got)
    assert eng.stats().running == 1
    h.cancel()
    rest = list(events)
    assert rest[-1].finish_reason == "cancelled"
    assert h.completion_tokens < 400
    _baseline(eng)
    h.cancel()  # after the end: nothing happens


def test_cancelled_while_queued_never_starts(eng):
    busy = [eng.submit(GenerationRequest((5, 6, 7, i), 400, ignore_eos=True)) for i in range(16)]
    queued = eng.submit(GenerationRequest((8, 9), 10, ignore_eos=True))
    for h in busy:  # every slot is taken once each of them has a token
        next(h.events(TIMEOUT))
    assert eng.stats().waiting == 1
    queued.cancel()
    events = list(queued.events(TIMEOUT))
    assert [(ev.token_ids, ev.finish_reason) for ev in events] == [((), "cancelled")]
    assert queued.first_token_time is None
    for h in busy:
        h.cancel()
        assert h.result(TIMEOUT).finish_reason == "cancelled"
    _baseline(eng)


def test_stop_strings_mid_reply_among_other_streams(eng):
    """Streams that a stop string ends mid-reply, decoding among others: the decode call that was already running
    when the stop string showed computed one more row for each of them, which must be dropped without touching
    anyone's reply (or leaking its pages), the same as when each runs alone."""
    base = _requests(3)[:8]
    plain = _solo(eng, base)
    reqs = []
    for i, (r, c) in enumerate(zip(base, plain)):
        text = c.text
        if i % 2 == 0 and len(text) > 6:  # a piece of the reply's middle: a stop string that fires mid-reply
            mid = len(text) // 2
            r = dataclasses.replace(r, stop=(text[mid:mid + 3],))
        reqs.append(r)
    assert sum(bool(r.stop) for r in reqs) >= 2
    solo = _solo(eng, reqs)
    assert any(c.finish_reason == "stop" and len(c.token_ids) < len(p.token_ids) for c, p in zip(solo, plain))
    together = [h.result(TIMEOUT) for h in [eng.submit(r) for r in reqs]]
    _check_same(solo, together)
    _baseline(eng)


def test_decode_calls_are_pipelined(eng):
    """Decode call i + 1 is dispatched before call i is fetched (its input token comes from the device), and call
    i's tokens are delivered after that: the device never waits for the host's events, text and stop strings. A
    stream whose last token is known from the count (max_tokens) sits out the calls after it."""
    log = []
    progs = eng.programs
    dispatch, fetch = progs.decode_async, progs.fetch

    def traced_dispatch(window, sp, pen=None):
        log.append("dispatch")
        return dispatch(window, sp, pen)

    def traced_fetch(pending):
        log.append("fetch")
        return fetch(pending)

    progs.decode_async, progs.fetch = traced_dispatch, traced_fetch
    eng.on_token = lambda stream, token: log.append("token")
    try:
        r = GenerationRequest(tuple(range(20, 60)), max_tokens=6, ignore_eos=True, request_id="pipelined")
        got = eng.submit(r).result(TIMEOUT)
    finally:
        del progs.decode_async, progs.fetch, eng.on_token
    assert len(got.token_ids) == 6
    # token 1 from the prompt call; calls 1..5 give tokens 2..6, each fetched after the next one's dispatch
    assert log == (["token", "dispatch"] + ["dispatch", "fetch", "token"] * 4 + ["fetch", "token"]), log
    _baseline(eng)


def test_structured_streams_sit_out_calls_and_others_stay_pipelined(eng):
    """A structured-output stream beside a free one: while its last call is in flight it sits the next call out
    (calls alternate between both streams and the free one alone), and no call waits for the one before it to land
    (each is dispatched with one in flight); both replies are their solo ones."""
    spaces = whitespace_bias(eng.token_bytes())
    reqs = [GenerationRequest(tuple(range(30, 50)), 24, SamplingOptions(logit_bias=spaces),
                              grammar=structured.compile_json_schema(SCHEMA), request_id="json"),
            GenerationRequest(tuple(range(60, 90)), 40, ignore_eos=True, request_id="free")]
    solo = _solo(eng, reqs)
    calls = []
    progs = eng.programs
    dispatch = progs.decode_async

    def traced(window, sp, pen=None):
        lanes = {int(s) for s, n in zip(np.asarray(window.slot), np.asarray(window.cache_len)) if n > 0}
        calls.append((len(eng._inflight), sorted(s.request.request_id for s in eng._running if s.slot in lanes)))
        return dispatch(window, sp, pen)

    progs.decode_async = traced
    try:
        got = [h.result(TIMEOUT) for h in [eng.submit(r) for r in reqs]]
    finally:
        del progs.decode_async
    _check_same(solo, got)
    last_free = max(i for i, (_, ids) in enumerate(calls) if "free" in ids)
    assert all(depth == 1 for depth, _ in calls[1:last_free + 1]), calls  # the free stream's calls pipelined
    json_calls = [i for i, (_, ids) in enumerate(calls) if "json" in ids]
    assert len(json_calls) >= 10 and all(b - a == 2 for a, b in zip(json_calls, json_calls[1:]) if b <= last_free)
    _baseline(eng)


def test_an_error_fails_only_its_request(eng):
    reqs = _requests(1)[:6]
    want = _solo(eng, reqs)

    def fault(stream, token):
        if stream.request.request_id == "r2" and len(stream.generated) == 2:
            raise RuntimeError("injected fault")

    eng.on_token = fault
    try:
        got = [h.result(TIMEOUT) for h in [eng.submit(r) for r in reqs]]
    finally:
        del eng.on_token
    assert got[2].finish_reason == "error" and "injected fault" in got[2].error
    assert len(got[2].token_ids) == 2
    for i in (0, 1, 3, 4, 5):
        assert got[i].token_ids == want[i].token_ids and got[i].finish_reason == want[i].finish_reason
    _baseline(eng)


def test_admission_errors():
    e = _engine("float32", max_queued=2)  # never started: nothing compiles, requests only queue
    ok = GenerationRequest((1, 2, 3), 5)
    with pytest.raises(ContextLengthExceeded, match="maximum context length is 512"):
        e.submit(GenerationRequest(tuple(range(MAX_LEN)), 5))
    for bad, field in ((GenerationRequest((), 5), "prompt_ids"), (GenerationRequest((1, 600), 5), "prompt_ids"),
                       (GenerationRequest((1,), 0), "max_tokens"),
                       (dataclasses.replace(ok, sampling=SamplingOptions(temperature=-1)), "temperature"),
                       (dataclasses.replace(ok, sampling=SamplingOptions(top_p=0)), "top_p"),
                       (dataclasses.replace(ok, logprobs=4), "logprobs"),
                       (dataclasses.replace(ok, stop=(3,)), "stop"),
                       (dataclasses.replace(ok, sampling=SamplingOptions(presence_penalty=2.5)), "presence_penalty"),
                       (dataclasses.replace(ok, sampling=SamplingOptions(repetition_penalty=0)), "repetition_penalty"),
                       (dataclasses.replace(ok, sampling=SamplingOptions(logit_bias=((600, 1.0),))), "logit_bias")):
        with pytest.raises(ValueError, match=field):
            e.submit(bad)
    # Several at once (a reply's n choices): all queued or none.
    with pytest.raises(ValueError, match="max_queued"):
        e.submit_all([ok] * 3)  # more than the queue ever holds
    with pytest.raises(ValueError, match="max_tokens"):
        e.submit_all([ok, GenerationRequest((1,), 0)])  # one bad request: none queued
    assert e.stats().waiting == 0
    held = [e.submit(ok)]
    with pytest.raises(EngineOverloaded, match="max_queued=2"):
        e.submit_all([ok, ok])  # one place left for two
    assert e.stats().waiting == 1
    held += e.submit_all([ok])
    with pytest.raises(EngineOverloaded, match="max_queued=2"):
        e.submit(ok)
    assert e.stats().waiting == 2
    e.shutdown()
    assert all(h.result(1).finish_reason == "error" for h in held)


def test_admission_waits_for_pages():
    """A request whose KV pages are not free waits (even with a slot free) and starts when they are; one that
    could never get enough pages is refused. Tiny random model without a tokenizer: ids only, no stop strings."""
    cfg, params = tiny()
    e = Engine(params, cfg, None, dtype="float32", max_model_len=256, parallel=2, num_pages=4, backend=Backend(),
               buckets=P.Buckets((64,), (2,), (2,)), progress=False)  # 3 usable pages of 64 positions
    with pytest.raises(ContextLengthExceeded, match="KV pages"):
        e.submit(GenerationRequest((1,) * 100, 150))  # 250 positions: 4 pages
    with pytest.raises(ValueError, match="tokenizer"):
        e.submit(GenerationRequest((1, 2), 5, stop=("x",)))
    e.start()
    try:
        big = e.submit(GenerationRequest(tuple(range(60)), 100, ignore_eos=True))  # 160 positions: 3 pages
        small = e.submit(GenerationRequest(tuple(range(10)), 60, ignore_eos=True))  # 70 positions: 2 pages
        deadline = time.monotonic() + TIMEOUT
        while big.first_token_time is None:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        s = e.stats()
        assert (s.running, s.waiting, s.free_pages, s.free_slots) == (1, 1, 0, 1)
        a, b = big.result(TIMEOUT), small.result(TIMEOUT)
        assert (len(a.token_ids), len(b.token_ids), a.text, b.text) == (100, 60, "", "")
        assert small.first_token_time >= big.finish_time
        _baseline(e)
    finally:
        e.shutdown()


def test_batched_shapes_refused_without_row_invariance():
    """Batched shapes (power-of-two decode buckets, packed prompt lanes) are exact only where every matmul row is
    computed alone (the Pallas qmm kernel on quantized weights): with the reference ops, or with float weights
    even under the kernels, the engine refuses them rather than let a reply depend on the load, and picks fixed
    shapes by default."""
    cfg, params = tiny()
    for backend in (Backend(kernels=False), Backend(kernels=True)):
        assert not P.row_invariant(params, backend)  # tiny() has float weights
        with pytest.raises(ValueError, match="batched shapes"):
            Engine(params, cfg, None, dtype="float32", max_model_len=128, parallel=2, backend=backend,
                   fixed_shapes=False, progress=False)
        e = Engine(params, cfg, None, dtype="float32", max_model_len=128, parallel=2, backend=backend,
                   progress=False)
        assert e.shape_policy == "fixed" and e.buckets.decode_streams == (2,)
    # Quantized weights under the kernels: every row is computed alone, so batched shapes are the default.
    cfg, params = tiny(quant=QuantConfig(4, 32))
    assert P.row_invariant(params, Backend(kernels=True)) and P.BATCHED_BY_DEFAULT
    e = Engine(params, cfg, None, dtype="float32", max_model_len=128, parallel=4, backend=Backend(kernels=True),
               progress=False)
    assert e.shape_policy == "batched" and e.buckets.decode_streams == (1, 2, 4)
