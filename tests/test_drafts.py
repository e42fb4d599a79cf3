"""Copy drafts: the index's proposals (qwen_jax.engine.drafts); the draft program's chain rows ≡ one-row windows bit for
bit (`model.verify(chain=True)`); and the engine's drafting on captures/tiny-mlx-4bit (its first 3 layers,
`first_layers`) with the Pallas kernels in interpret mode (the row-invariant path drafting needs; the reference path
is refused).

The tiny checkpoint's random weights rarely repeat themselves, so the engine tests draft with oracles in the index's
place. One proposes tokens the model never picks (every window keeps only its first row); the others propose the
reply's next tokens with one of them changed, at an offset that moves from round to round, so windows are kept whole,
in part and not at all. Every token then comes from a chain window, cut differently by each oracle, and the replies
must be the same bits (the engine's draft policy is pinned to "always": the adaptive one would decode some rounds
serially where windows do not pay, tests/test_draft_policy.py). That the chain rows are the fused serial step's bits
is the device's gate (`tests/test_engine_gpu.py::test_drafted_equals_serial_on_gpu`): on this CPU the interpreted
fused GDN step and the one-row window + commit part ways on some inputs, XLA:CPU compiling the interpreted kernels'
arithmetic differently in the two programs (`tools/step_probe.py`; docs/kernels/attention.md, session 38)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from qwen_jax import programs as P
from qwen_jax import structured
from qwen_jax.checkpoint import load_checkpoint, load_tokenizer
from qwen_jax.engine import stream as stream_mod
from qwen_jax.engine.api import GenerationRequest, SamplingOptions
from qwen_jax.engine.drafts import CopyIndex
from qwen_jax.engine.engine import Engine
from qwen_jax.engine.policy import DraftPolicy
from qwen_jax.model import Backend
from tests.conftest import CAPTURES, first_layers
from tests.test_engine import _baseline

MODEL = CAPTURES / "tiny-mlx-4bit"
TIMEOUT = 600


def test_propose_copies_what_followed_the_last_match():
    idx = CopyIndex([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 50, 1, 2, 3, 4, 5, 6, 7], n=8)
    assert idx.propose(3) == []  # its last 8 tokens (50 1 2 ... 7) occur nowhere else
    idx.append(8)  # now its last 8 (1 2 ... 8) repeat the start, which 9 10 11 50 1 2 ... followed
    assert idx.propose(3) == [9, 10, 11]
    assert idx.propose(6) == [9, 10, 11, 50, 1, 2]
    assert idx.propose(100) == [9, 10, 11, 50, 1, 2, 3, 4, 5, 6, 7, 8]  # up to the history's end
    assert idx.propose(0) == []


def test_propose_prefers_the_latest_match_with_a_full_continuation():
    a = [7] * 7
    idx = CopyIndex(a + [1, 20, 21, 22] + a + [1, 30, 31, 32, 33] + a + [1], n=8)
    assert idx.propose(4) == [30, 31, 32, 33]  # the latest occurrence holds 4 tokens after it
    assert idx.propose(12) == [30, 31, 32, 33] + a + [1]  # the latest still has 12 after it
    assert idx.propose(30) == [20, 21, 22] + a + [1, 30, 31, 32, 33] + a + [1]  # none has 30: the longest


def test_propose_needs_the_whole_match():
    idx = CopyIndex([1, 2, 3, 4, 5, 6, 7, 8, 9] + [0, 2, 3, 4, 5, 6, 7, 8], n=8)  # 7 of 8 tokens match
    assert idx.propose(4) == []
    assert idx.may_propose()  # the last 7 (2..8) occurred with a token after them
    idx2 = CopyIndex([1, 2, 3, 4, 5, 6, 7, 8, 9], n=8)
    assert not idx2.may_propose() and idx2.propose(4) == []


def test_periodic_history_copies_its_period():
    idx = CopyIndex([5, 6, 7] * 6, n=4)
    assert idx.propose(7) == [5, 6, 7, 5, 6, 7, 5]


def test_propose_after_assumed_tokens_leaves_the_index():
    base = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4, 5]
    idx = CopyIndex(base, n=4)
    ends = {k: list(v) for k, v in idx._ends.items()}
    assert idx.propose_after([6, 7], 3) == [8, 9, 10]  # as if 6 7 had been appended
    assert idx.propose_after([], 2) == idx.propose(2) == [6, 7]
    assert idx.tokens == base and idx._ends == ends
    full = CopyIndex(base + [6, 7], n=4)
    assert idx.propose_after([6, 7], 5) == full.propose(5)


def test_copy_index_errors():
    with pytest.raises(ValueError, match="match length"):
        CopyIndex(n=1)
    with pytest.raises(ValueError, match="limit"):
        CopyIndex([1, 2, 3]).propose(-1)


def test_chain_accepted():
    """The draft program's acceptance: row 0 always; row r while it is a chain row whose token is row r - 1's
    sample; padding rows (hanging off the root's parent) and dummy streams (slot 0) never."""
    lay = P.Layout(64, 4, 9, 4)
    tokens = [[5, 6, 7, 8], [5, 6, 7], [5, 6], [5, 9, 7, 8]]
    window = P.tree_window(lay, 5, 4, tokens, [list(range(-1, len(t) - 1)) for t in tokens], [10] * 4,
                           [1, 2, 3, 1], [np.arange(1, 5, dtype=np.int32)] * 4)
    sampled = np.array([[6, 7, 8, 1], [6, 7, 7, 7], [6, 7, 7, 7], [6, 7, 8, 1], [0, 0, 0, 0]], np.int32)
    assert P.chain_accepted(window, sampled).tolist() == [4, 3, 2, 1, 0]
    sampled[0, 1] = 3  # row 2's token (7) is not row 1's sample: rows 0-1 stand
    assert P.chain_accepted(window, sampled).tolist()[0] == 2


# ------------------------------------------------------------------------------------------------ the model


def test_chain_rows_equal_one_row_windows():
    """`verify(chain=True)` over a chain of 6 rows (padded to 8, beside a dummy stream) gives each row the logits of
    a one-row verify at its position after the rows before it were committed, bit for bit; the chain's commit of
    its first 4 rows leaves the state those one-row commits leave. At 150 committed keys the rows share pass 1's
    first 128-key chunk (`attention.window_rows`). On the model's first layers (`first_layers`), as the engine
    tests."""
    import jax

    from qwen_jax import model as M
    ck = first_layers(load_checkpoint(MODEL, dtype=jnp.bfloat16, progress=False))
    cfg, params = ck.config, ck.params
    be = Backend(kernels=True, interpret=True)
    prefill = jax.jit(lambda p, s, b: M.prefill(p, s, b, cfg, be)[:2])
    verify = jax.jit(lambda p, s, w, c: M.verify(p, s, w, cfg, be, chain=c), static_argnums=3)
    commit = jax.jit(lambda s, k, w, pa, n: M.commit(s, k, w, pa, n, cfg, be))
    rng = np.random.default_rng(4)
    c = 150
    toks = rng.integers(0, cfg.text.vocab_size, size=c + 20)
    table = np.array([[1, 2, 3], [0, 0, 0]], np.int32)
    state = M.init_state(cfg.text, num_slots=3, num_pages=5, page_size=64, dtype=jnp.bfloat16)
    _, state = prefill(params, state, M.make_prefill_batch(toks[None, :c], [0], [c], [1], table[:1]))
    n, rows, keep = 6, 8, 4
    parents = [list(range(-1, n - 1)) + [-1] * (rows - n), [-1] * rows]
    chain = M.make_window(np.stack([np.r_[toks[c:c + n], [0, 0]], np.zeros(rows, np.int64)]), parents, [c, 0],
                          [1, 0], table)
    logits, kept, _, drafted = verify(params, state, chain, True)
    drafted = commit(drafted, kept, chain, jnp.asarray([list(range(keep)) + [0] * (rows - keep), [0] * rows]),
                     jnp.asarray([keep, 0]))
    serial = state
    for r in range(n):
        one = M.make_window(np.array([[toks[c + r]], [0]]), [[-1], [-1]], [c + r, 0], [1, 0], table)
        lr, kr, _ = verify(params, serial, one, False)
        assert np.array_equal(np.asarray(lr[0, 0]), np.asarray(logits[0, r])), f"row {r}"
        serial = commit(serial, kr, one, jnp.zeros((2, 1), jnp.int32), jnp.asarray([1, 0]))
        if r + 1 == keep:
            kept_serial = serial
    for name in ("rec", "conv"):
        for a, b in zip(getattr(drafted, name), getattr(kept_serial, name)):
            assert np.array_equal(np.asarray(a[1]), np.asarray(b[1])), name  # slot 1 (slot 0 is scratch)
    for a, b in zip(drafted.kv, kept_serial.kv):  # positions 0 .. 127 and 128 .. c + keep - 1 (the rest unread)
        for x, y in ((a.k, b.k), (a.v, b.v)):
            x, y = np.asarray(x), np.asarray(y)
            live = c + keep - 128
            assert np.array_equal(x[:, 1:3], y[:, 1:3]) and np.array_equal(x[:, 3, :live], y[:, 3, :live])


# ------------------------------------------------------------------------------------------------ the engine


class OracleCopies:
    """CopyIndex's interface over a known reply: proposes its next tokens, the one at offset (tokens so far) %
    period changed (no change when that offset is past the proposal); with no reply, tokens that are never right
    (ids past the reply vocabulary's top, so every window keeps its first row only)."""

    def __init__(self, tokens, replies: dict, vocab: int, period: int, limit: int):
        self.prompt = tuple(int(t) for t in tokens)
        self.tokens = list(self.prompt)
        self.reply = replies.get(self.prompt)
        self.vocab, self.period, self.limit = vocab, period, limit

    def append(self, token):
        self.tokens.append(int(token))

    def may_propose(self) -> bool:
        return True

    def propose_after(self, assumed, limit: int) -> list[int]:
        size = len(self.tokens)
        self.tokens += [int(t) for t in assumed]
        try:
            return self.propose(limit)
        finally:
            del self.tokens[size:]

    def propose(self, limit: int) -> list[int]:
        limit = min(limit, self.limit)
        done = len(self.tokens) - len(self.prompt)  # reply tokens decided, the pending one included
        if self.reply is None:
            return [self.vocab - 1 - (done + i) % 7 for i in range(limit)]
        out = list(self.reply[done:done + limit])
        bad = done % self.period
        if bad < len(out):
            out[bad] = (out[bad] + 1) % self.vocab
        return out


def _request(prompt, seed, **kw):
    sampled = seed is not None
    opts = SamplingOptions(temperature=0.9, top_k=30, top_p=0.95, seed=seed) if sampled else SamplingOptions()
    return GenerationRequest(tuple(prompt), sampling=opts, ignore_eos=True, logprobs=2 if sampled else None, **kw)


@pytest.fixture(scope="module")
def eng():
    ck = first_layers(load_checkpoint(MODEL, dtype=jnp.bfloat16, progress=False))
    backend = Backend(kernels=True, interpret=True)
    buckets = P.Buckets(prompt_rows=(64,), prompt_lanes=(1,), decode_streams=(2,), chain_rows=(8,),
                        packing=P.Packing.BATCHED, logprobs=2)
    e = Engine(ck.params, ck.config, load_tokenizer(MODEL), dtype="bfloat16", max_model_len=192, parallel=2,
               max_queued=8, backend=backend, buckets=buckets, max_logprobs=2, progress=False, copy_drafts=True,
               draft_rows=8,
               draft_policy=DraftPolicy(adaptive=False))  # every token from a chain window (the module doc)
    e.start()
    yield e
    e.shutdown()


def _oracle(monkeypatch, eng, replies, period, limit=16):
    monkeypatch.setattr(stream_mod, "CopyIndex",
                        lambda tokens: OracleCopies(tokens, replies, eng.vocab_size, period, limit))


def _prompts():
    rng = np.random.default_rng(3)
    base = [int(t) for t in rng.integers(0, 500, size=12)]
    return [base * 4, [int(t) for t in rng.integers(0, 500, size=70)]]


def _same(a, b):
    assert (a.token_ids, a.logprobs, a.finish_reason) == (b.token_ids, b.logprobs, b.finish_reason)


def test_drafted_replies_do_not_depend_on_the_drafts(eng, monkeypatch):
    """Each request drafted three ways (drafts never right; right but for one token every 5th or 3rd round, at most
    7 or 4 a window): the same tokens and logprobs, windows kept whole, in part and not at all, every reply
    max_tokens long, and the pools back to baseline. Windows are enqueued behind a stream's previous window (its
    first token and length on the device, its drafts guessed past what that window may yield) and the guesses
    come out right and wrong."""
    reqs = [_request(p, seed, max_tokens=n) for p in _prompts() for seed, n in ((None, 30), (11, 27))]
    replies = {}
    _oracle(monkeypatch, eng, replies, 5)
    first = [eng.submit(r).result(TIMEOUT) for r in reqs]
    for r, a in zip(reqs, first):
        assert a.finish_reason == "length" and len(a.token_ids) == r.max_tokens
        replies[r.prompt_ids] = a.token_ids
    _baseline(eng)
    for period, limit in ((5, 16), (3, 4)):
        _oracle(monkeypatch, eng, replies, period, limit)
        before, windows = eng.stats(), dict(eng._counters)
        again = [eng.submit(r).result(TIMEOUT) for r in reqs]
        after = eng.stats()
        for a, b in zip(first, again):
            _same(a, b)
        accepted = after.draft_accepted_total - before.draft_accepted_total
        assert 0 < accepted < after.draft_proposed_total - before.draft_proposed_total
        chained = eng._counters["draft_windows_chained"] - windows["draft_windows_chained"]
        assert 0 < chained < eng._counters["draft_windows"] - windows["draft_windows"]
        _baseline(eng)


def test_drafted_streams_beside_a_serial_one(eng, monkeypatch):
    """Two drafted streams and a serial one (`draft` False) at once: each as it was alone."""
    reqs = [_request(p, seed, max_tokens=20) for p, seed in zip(_prompts(), (None, 5))]
    serial_req = dataclasses.replace(_request(_prompts()[1], 9, max_tokens=20), draft=False)
    replies = {}
    _oracle(monkeypatch, eng, replies, 4)
    alone = [eng.submit(r).result(TIMEOUT) for r in reqs]
    for r, a in zip(reqs, alone):
        replies[r.prompt_ids] = a.token_ids
    serial = eng.submit(serial_req).result(TIMEOUT)
    handles = [eng.submit(reqs[0]), eng.submit(serial_req), eng.submit(reqs[1])]
    together = [h.result(TIMEOUT) for h in handles]
    for a, b in zip([alone[0], serial, alone[1]], together):
        _same(a, b)
    _baseline(eng)


def test_drafted_penalties_equal_serial(eng, monkeypatch):
    """A seeded request with all three penalties, drafted (drafts right but for one token every 4th round), alone and
    beside a drafted stream without: its serial reply (`draft` False), windows kept whole and in part. Each row's
    penalties count the tokens fed along its path, and the rows that stand are counted after the window. (Negative
    presence and frequency penalties favour tokens already generated, so a row's count that missed a token on its
    path would change its draw: a window rule that left the path out passed the same test with positive ones.)
    Then with min_tokens holding back a stop id: drafted from min_tokens on, its serial reply; and with a thinking
    budget forcing the think block's end: drafted once the block is closed, its serial reply."""
    req = _request(_prompts()[1][:50], 13, max_tokens=24)
    req = dataclasses.replace(req, sampling=dataclasses.replace(
        req.sampling, presence_penalty=-2.0, frequency_penalty=-2.0, repetition_penalty=1.3,
        logit_bias=((17, 2.0), (211, -1.0))))
    other = _request(_prompts()[0], None, max_tokens=20)
    replies = {}
    _oracle(monkeypatch, eng, replies, 4)
    serial = eng.submit(dataclasses.replace(req, draft=False)).result(TIMEOUT)
    replies[req.prompt_ids] = serial.token_ids
    replies[other.prompt_ids] = eng.submit(dataclasses.replace(other, draft=False)).result(TIMEOUT).token_ids
    before = eng.stats()
    _same(serial, eng.submit(req).result(TIMEOUT))
    after = eng.stats()
    assert 0 < after.draft_accepted_total - before.draft_accepted_total < \
        after.draft_proposed_total - before.draft_proposed_total
    handles = [eng.submit(other), eng.submit(req)]
    assert handles[0].result(TIMEOUT).token_ids == replies[other.prompt_ids]
    _same(serial, handles[1].result(TIMEOUT))
    # min_tokens holding back a stop id the serial reply samples: serial rounds until min_tokens, then windows
    held = dataclasses.replace(req, stop_token_ids=(serial.token_ids[2],), min_tokens=8)
    held_serial = eng.submit(dataclasses.replace(held, draft=False)).result(TIMEOUT)
    assert held_serial.token_ids[:2] == serial.token_ids[:2] and held_serial.token_ids[2] != serial.token_ids[2]
    replies[req.prompt_ids] = held_serial.token_ids
    before = eng.stats()
    _same(held_serial, eng.submit(held).result(TIMEOUT))
    assert eng.stats().draft_accepted_total > before.draft_accepted_total
    # a thinking budget closing the block at token 5: serial rounds while it thinks, then windows; beside another
    end = next(t for t in range(480, 0, -1) if t not in serial.token_ids)
    budget = dataclasses.replace(req, thinking_budget=5, think_end=end)
    budget_serial = eng.submit(dataclasses.replace(budget, draft=False)).result(TIMEOUT)
    assert budget_serial.token_ids[:6] == serial.token_ids[:5] + (end,)
    replies[req.prompt_ids] = budget_serial.token_ids
    before = eng.stats()
    handles = [eng.submit(other), eng.submit(budget)]
    assert handles[0].result(TIMEOUT).token_ids == replies[other.prompt_ids]
    _same(budget_serial, handles[1].result(TIMEOUT))
    assert eng.stats().draft_accepted_total > before.draft_accepted_total
    plain = dataclasses.replace(req, sampling=dataclasses.replace(
        req.sampling, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0), draft=False)
    assert eng.submit(plain).result(TIMEOUT).token_ids != serial.token_ids  # the penalties are in effect
    _baseline(eng)


def test_drafted_structured_outputs_equal_serial(eng, monkeypatch):
    """Structured-output requests (a JSON schema, greedy and seeded; and one whose grammar starts after a token of
    its free reply) drafted by the oracle (the serial reply with one token changed every 3rd round: a change the
    grammar refuses cuts the window's rows there, one it allows is drafted and refused by the row's sample), alone
    and beside a free drafted stream: their serial replies (`draft` False), logprobs included; windows keep drafts.
    Each row samples under its grammar's mask after the drafts before it (`Engine._row_masks`)."""
    from tests.test_engine import SCHEMA, whitespace_bias
    grammar = structured.compile_json_schema(SCHEMA)
    spaces = whitespace_bias(eng.token_bytes())
    prompts = _prompts()
    reqs = [_request(prompts[1][:40], None, max_tokens=90), _request(prompts[0], 21, max_tokens=90)]
    reqs = [dataclasses.replace(r, grammar=grammar, ignore_eos=False,
                                sampling=dataclasses.replace(r.sampling, logit_bias=spaces)) for r in reqs]
    free = _request(prompts[1][5:60], 4, max_tokens=30)
    later = _request(prompts[1][8:60], 6, max_tokens=40)  # its grammar starts after its free reply's 5th token
    replies = {}
    _oracle(monkeypatch, eng, replies, 3)
    replies[free.prompt_ids] = eng.submit(dataclasses.replace(free, draft=False)).result(TIMEOUT).token_ids
    after = eng.submit(dataclasses.replace(later, draft=False)).result(TIMEOUT).token_ids[4]
    reqs.append(dataclasses.replace(later, grammar=grammar, grammar_after=after))
    serial = [eng.submit(dataclasses.replace(r, draft=False)).result(TIMEOUT) for r in reqs]
    for r, a in zip(reqs, serial):
        replies[r.prompt_ids] = a.token_ids
    before = eng.stats()
    eng.programs._all_allowed.clear()  # the free windows' masks are put on the device again, inside the watch
    with P.CompileWatch() as watch:
        drafted = [eng.submit(r).result(TIMEOUT) for r in reqs + [free]][:len(reqs)]
    assert (watch.traces, watch.compiles) == (0, 0)  # masks, packed rows and the bias row: nothing compiles
    done = eng.stats()
    for a, b in zip(serial, drafted):
        _same(a, b)
    assert serial[0].finish_reason == "stop"  # a whole document, ended where it closed
    assert serial[2].token_ids.index(after) < 5  # free up to that token, then the grammar
    assert 0 < done.draft_accepted_total - before.draft_accepted_total < \
        done.draft_proposed_total - before.draft_proposed_total
    handles = [eng.submit(free), eng.submit(reqs[1])]
    assert handles[0].result(TIMEOUT).token_ids == replies[free.prompt_ids]
    _same(serial[1], handles[1].result(TIMEOUT))
    _baseline(eng)


def test_a_stop_inside_a_window_ends_the_reply_there(eng, monkeypatch):
    replies = {}
    _oracle(monkeypatch, eng, replies, 6)
    prompt = _prompts()[1]
    full = eng.submit(_request(prompt, None, max_tokens=30)).result(TIMEOUT)
    replies[tuple(prompt)] = full.token_ids
    stop = full.token_ids[12]
    cut = full.token_ids.index(stop) + 1
    got = eng.submit(_request(prompt, None, max_tokens=30, stop_token_ids=(stop,))).result(TIMEOUT)
    assert got.token_ids == full.token_ids[:cut] and got.finish_reason == "stop"
    _baseline(eng)


def test_chain_windows_shrink_as_more_streams_draft():
    """The default buckets' row budget: a window call of S streams gets at most 16 / S rows a stream (the compiled
    bucket at or below it), and none past 8 streams; without a budget every compiled row count is open."""
    assert P.chain_row_buckets(16) == (2, 4, 8, 16) and P.chain_row_buckets(6) == (2, 4, 6)
    b = P.Buckets((64,), (1,), P.pow2_buckets(1, 16), chain_rows=P.chain_row_buckets(16),
                  chain_budget=P.CHAIN_ROW_BUDGET)
    assert [b.chain_cap(n) for n in (1, 2, 3, 4, 5, 8, 9, 16)] == [16, 8, 4, 4, 2, 2, 0, 0]
    assert dataclasses.replace(b, chain_budget=0).chain_cap(16) == 16


def test_copy_drafts_refused_where_rows_are_not_invariant():
    ck = load_checkpoint(CAPTURES / "tiny", dtype=jnp.float32, progress=False)
    with pytest.raises(ValueError, match="copy_drafts"):
        Engine(ck.params, ck.config, None, dtype="float32", max_model_len=128, parallel=2, backend=Backend(),
               progress=False, copy_drafts=True)
    with pytest.raises(ValueError, match="draft_rows"):
        Engine(ck.params, ck.config, None, dtype="float32", max_model_len=128, parallel=2, backend=Backend(),
               progress=False, draft_rows=17)
