"""The exact prompt cache (qwen_jax.engine.prefix): where states are kept, lookup and eviction order; and on
captures/tiny (reference path, CPU) resumed ≡ fresh: a prompt resumed from a kept state gets the reply, logprobs
included, that an engine without the cache gives, greedy and seeded, alone and with others; kept states give way
when a request needs their pages, and the pools return to baseline."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from qwen_jax import programs as P
from qwen_jax.checkpoint import load_checkpoint, load_tokenizer
from qwen_jax.engine.api import GenerationRequest, SamplingOptions
from qwen_jax.engine.engine import Engine
from qwen_jax.engine.prefix import PrefixCache, user_marker
from qwen_jax.model import Backend
from tests.conftest import CAPTURES
from tests.test_engine import _baseline

MAX_LEN = 1024
TIMEOUT = 300
TINY = CAPTURES / "tiny"


# ------------------------------------------------------------------------------------------ the bookkeeping


def test_keep_points():
    c = PrefixCache([5, 6], 64, user_marker=[7, 8])
    p = np.arange(10, 300, dtype=np.int32)  # 290 tokens, no user marker
    assert c.keep_points(p) == [256]
    assert c.keep_points(p[:257]) == [256] and c.keep_points(p[:256]) == [192]  # one token or more left after it
    assert c.keep_points(p[:64]) == [] and c.keep_points(p[:65]) == [64]
    q = p.copy()
    q[[100, 101, 200, 201]] = [7, 8, 7, 8]  # the last user start at 200
    assert c.keep_points(q) == [192, 256]
    assert c.keep_points(q, after=192) == [256] and c.keep_points(q, after=256) == []
    c.add(q[:192], c.take_slot(), [1, 2, 3])
    assert c.keep_points(q) == [256]  # kept already
    assert PrefixCache([1], 64).keep_points(q) == [256]  # no marker: the end only


def test_lookup_takes_the_longest_strict_prefix():
    c = PrefixCache([5, 6, 7], 64)
    p = np.arange(300, dtype=np.int32)
    a = c.add(p[:64], c.take_slot(), [1])
    b = c.add(p[:128], c.take_slot(), [1, 2])
    assert c.lookup(p) is b and c.lookup(p[:128]) is a  # at least one token left to run
    assert c.lookup(p[:64]) is None
    other = p.copy()
    other[100] = 999
    assert c.lookup(other) is a  # differs inside b
    assert c.find(p[:128]) is b and c.find(p[:100]) is None
    assert c.take_slot() == 7 and c.take_slot() is None and c.capacity == 2


def test_eviction_order():
    c = PrefixCache([1, 2, 3], 64)
    p = np.arange(400, dtype=np.int32)
    e = [c.add(p[:64 * (i + 1)], c.take_slot(), []) for i in range(3)]
    c.hit(e[0])
    assert c.victim() is e[1]  # never hit, oldest
    assert c.victim(keep=e[1]) is e[2]
    c.hit(e[1]), c.hit(e[2]), c.hit(e[0])
    assert c.victim() is e[1]  # all hit: the least recently used
    assert c.remove(e[1]) == [] and c.take_slot() == e[1].slot
    assert (c.hits, c.hit_tokens) == (4, 64 + 128 + 192 + 64)


def test_user_marker_from_the_tokenizer():
    tok = load_tokenizer(TINY)
    m = user_marker(tok)
    assert m == [tok.convert_tokens_to_ids("<|im_start|>")] + tok.encode("user", add_special_tokens=False)
    assert user_marker(None) is None


# ------------------------------------------------------------------------------------------------ the engine


def _engine(prompt_cache: int, **kw) -> Engine:
    ck = load_checkpoint(TINY, dtype=jnp.bfloat16, progress=False)
    buckets = P.Buckets(prompt_rows=(64, 128, 256), prompt_lanes=(4,), decode_streams=(8,), logprobs=3,
                        slot_copy=prompt_cache > 0)
    args = dict(dtype="bfloat16", max_model_len=MAX_LEN, parallel=8, max_queued=32, backend=Backend(),
                buckets=buckets, prefill_step=128, max_logprobs=3, progress=False, prompt_cache=prompt_cache)
    args.update(kw)
    return Engine(ck.params, ck.config, load_tokenizer(TINY), **args)


@pytest.fixture(scope="module")
def engines():
    cached, plain = _engine(4), _engine(0)
    cached.start()
    plain.start()
    yield cached, plain
    cached.shutdown()
    plain.shutdown()


def _chat(tok, system: str, *turns: str) -> list[int]:
    msgs = [{"role": "system", "content": system}]
    msgs += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])


def _request(ids, i: int, max_tokens: int = 12) -> GenerationRequest:
    """i even: greedy; odd: seeded; 2: seeded, with penalties (their prompt history set whatever was resumed)."""
    opts = SamplingOptions() if i % 2 == 0 else SamplingOptions(temperature=0.9, top_k=40, top_p=0.95, seed=77 + i)
    if i == 2:
        opts = SamplingOptions(temperature=0.9, seed=79, presence_penalty=0.4, frequency_penalty=0.3,
                               repetition_penalty=1.2)
    return GenerationRequest(tuple(ids), max_tokens=max_tokens, sampling=opts, ignore_eos=True, logprobs=3,
                             request_id=f"p{i}")


def _same(a, b):
    assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
    assert [(x.token_id, x.logprob, x.top) for x in a.logprobs] == [(x.token_id, x.logprob, x.top) for x in b.logprobs]


def test_resumed_equals_fresh(engines):
    """A shared system prompt (kept at the user turn's start), the same prompt again (kept at its end) and a
    follow-up turn (the earlier prompt and reply, then more) each resume from a kept state and give, greedy,
    seeded and with penalties, what the engine without a cache gives."""
    cached, plain = engines
    tok = cached.tokenizer
    system = "You are a careful assistant who answers briefly. " * 9
    first = _chat(tok, system, "Tell me about the sea.")
    assert len(first) > 256
    for i in range(3):  # greedy, seeded, seeded with penalties
        cached.clear_prompt_cache()
        base = cached.stats()
        h = cached.submit(_request(first, i))
        a = h.result(TIMEOUT)
        _same(a, plain.submit(_request(first, i)).result(TIMEOUT))
        assert h.cached_tokens == 0 and cached.stats().prompt_cache_entries == 2  # the user start and the end
        follow = first + list(a.token_ids) + _chat(tok, "", "And the sky?")[-12:]
        cases = [(_chat(tok, system, "Why is the grass green?"), 64 * (first.index(492, 5) // 64)),
                 (first, 64 * ((len(first) - 1) // 64)),
                 (follow, 64 * ((len(first) - 1) // 64))]
        for ids, resumed_at in cases:
            h = cached.submit(_request(ids, i))
            got = h.result(TIMEOUT)
            assert h.cached_tokens == resumed_at > 0
            _same(got, plain.submit(_request(ids, i)).result(TIMEOUT))
        s = cached.stats()
        assert s.prompt_cache_hits_total - base.prompt_cache_hits_total == 3
        assert s.prompt_cache_hit_tokens_total - base.prompt_cache_hit_tokens_total == sum(r for _, r in cases)
        assert cached.clear_prompt_cache() == s.prompt_cache_entries
        _baseline(cached)


def test_resumed_streams_together_equal_solo(engines):
    """Six prompts that share a kept prefix resume together (one prompt call, then decode calls with each other)
    and each gets its solo reply from the engine without a cache."""
    cached, plain = engines
    rng = np.random.default_rng(5)
    shared = [int(t) for t in rng.integers(0, 490, size=200)]
    cached.clear_prompt_cache()
    cached.submit(_request(shared + [1, 2, 3], 0, max_tokens=2)).result(TIMEOUT)  # keeps 192
    prompts = [shared + [int(t) for t in rng.integers(0, 490, size=n)] for n in (1, 30, 64, 100, 5, 77)]
    handles = [cached.submit(_request(p, i, max_tokens=10 + i)) for i, p in enumerate(prompts)]
    got = [h.result(TIMEOUT) for h in handles]
    assert [h.cached_tokens for h in handles] == [192] * 6
    for i, p in enumerate(prompts):
        _same(got[i], plain.submit(_request(p, i, max_tokens=10 + i)).result(TIMEOUT))
    cached.clear_prompt_cache()
    _baseline(cached)


def test_choices_queued_together_prefill_once(engines):
    """A reply's n choices (the same prompt, queued at once with `submit_all`, seeds per choice): the first runs the
    prompt, the others wait for its kept state and resume from it; each reply is the engine without a cache's."""
    cached, plain = engines
    prompt = [int(t) for t in np.random.default_rng(8).integers(0, 490, size=150)]
    cached.clear_prompt_cache()
    reqs = [dataclasses.replace(_request(prompt, 1), sampling=SamplingOptions(temperature=0.9, seed=300 + i))
            for i in range(3)]
    handles = cached.submit_all(reqs)
    got = [h.result(TIMEOUT) for h in handles]
    assert [h.cached_tokens for h in handles] == [0, 128, 128]
    for r, g in zip(reqs, got):
        _same(g, plain.submit(r).result(TIMEOUT))
    assert len({g.token_ids for g in got}) == 3
    cached.clear_prompt_cache()
    _baseline(cached)


def test_kept_states_give_way():
    """One kept slot. Pages: a request that needs the pages a kept state holds evicts it and runs; one that could
    not fit even then (pages held elsewhere) evicts nothing."""
    e = _engine(1, num_pages=12, max_model_len=512)  # 64-token pages: 11 usable
    e.start()
    try:
        rng = np.random.default_rng(9)
        p = [int(t) for t in rng.integers(0, 490, size=300)]
        e.submit(_request(p, 0, max_tokens=4)).result(TIMEOUT)
        s = e.stats()
        assert s.prompt_cache_entries == 1 and s.free_pages == s.total_pages - 4  # kept at 256: four pages
        h = e.submit(_request(p + [5], 0, max_tokens=4))
        h.result(TIMEOUT)
        assert h.cached_tokens == 256
        # 8 pages (500 positions) with 7 free: the kept state's 4 pages must go
        big = [int(t) for t in rng.integers(0, 490, size=480)]
        h = e.submit(_request(big, 0, max_tokens=20))
        assert h.result(TIMEOUT).finish_reason == "length" and h.cached_tokens == 0
        s = e.stats()
        assert s.prompt_cache_entries == 1 and s.free_pages == 4  # its own state, kept at 448 (7 pages)
        with e._lock:  # the scheduler is idle; pages held by others: 3 taken, one of the entry's shared
            held = e._pages.take(3)
            entry = e._cache.entries[0]
            e._pages.share(entry.pages[:1])
            assert e._take_pages(8) is None and len(e._cache.entries) == 1  # 1 free + 6 freeable < 8
            got = e._take_pages(7)
            assert len(got) == 7 and not e._cache.entries
            e._pages.give_back(got + held + entry.pages[:1])
        _baseline(e)
    finally:
        e.shutdown()


def test_prompt_cache_refusals():
    with pytest.raises(ValueError, match="prompt_cache must be an integer >= 0"):
        _engine(-1)
    ck = load_checkpoint(TINY, dtype=jnp.bfloat16, progress=False)
    with pytest.raises(ValueError, match="slot_copy"):
        Engine(ck.params, ck.config, None, max_model_len=256, parallel=2, backend=Backend(), progress=False,
               prompt_cache=2, buckets=P.Buckets(prompt_rows=(64,), prompt_lanes=(1,), decode_streams=(2,)))
