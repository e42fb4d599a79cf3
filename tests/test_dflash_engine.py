"""DFlash block drafts in the programs and the engine (qwen_jax.dflash_programs): the drafter runs on the device after
each prompt chunk and each window, and the next window reads its drafts there.

Programs, on the reference path in float32 against dflash 0.1.0's greedy loop (captures/refs/dflash-tiny-f32.npz, the
tiny drafter captures/tiny-dflash): the same tokens, and at every step where dflash drafted a whole block, the same
drafts. The engine, on captures/tiny-mlx-4bit's first 4 layers with the kernels in interpret mode (the row-invariant
path drafting needs): replies drafted by the random tiny drafter (windows nearly always cut after their first row)
and by an oracle that proposes the reply itself with one token in `PERIOD` wrong (windows kept whole, in part, not at
all) are the same bits, alone and beside other streams, with the pools back to baseline. As in tests/test_drafts.py,
drafted replies are compared with drafted replies here; that chain rows are the serial step's bits is the device's
gate (tests/test_engine_gpu.py), the interpreted fused step on this CPU rounding apart from a one-row window."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from qwen_jax import dflash_programs as D
from qwen_jax import programs as P
from qwen_jax import sampling
from qwen_jax import structured
from qwen_jax.checkpoint import load_checkpoint, load_dflash, load_tokenizer
from qwen_jax.engine.api import GenerationRequest, SamplingOptions
from qwen_jax.engine.engine import Engine
from qwen_jax.model import Backend
from tests.conftest import CAPTURES, first_layers, first_layers_drafter
from tests.test_engine import _baseline

REF = CAPTURES / "refs" / "dflash-tiny-f32.npz"
DRAFTER = CAPTURES / "tiny-dflash"
MODEL = CAPTURES / "tiny-mlx-4bit"
TIMEOUT = 600
PERIOD = 5


# --- programs against dflash's loop ------------------------------------------------------------------------------


def test_windows_draft_what_dflash_drafts():
    """Prompt call, then back-to-back windows whose first token, length and drafts all come from the device: every
    prompt's greedy tokens are dflash_generate's, and so are the drafts at each of its whole-block steps."""
    target = load_checkpoint(CAPTURES / "tiny", dtype=jnp.float32, progress=False)
    drafter = load_dflash(DRAFTER, target=target.config.text, dtype=jnp.float32)
    b = drafter.config.block_size
    layout = P.Layout(64, 8, 9, 2, "float32", "bf16")
    buckets = P.Buckets(prompt_rows=(64,), prompt_lanes=(1,), decode_streams=(1,), chain_rows=(b,))
    pr = P.Programs(target.params, target.config, layout, buckets, Backend(), drafter=D.Drafter(
        drafter.params, drafter.config, 512))
    pr.compile([("prompt", (1, 64)), ("draft", (1, b))])
    z = np.load(REF)
    greedy = sampling.RequestSampling(seed=0, temperature=0.0)
    for name in ("short", "long", "repeat", "chat"):
        pr.reset_state()
        prompt = z[f"gen.{name}.prompt_ids"].tolist()
        want = z[f"gen.{name}.gen_ids"].tolist()
        table = np.arange(1, 9, dtype=np.int32)
        for c0 in range(0, len(prompt), 64):
            chunk = prompt[c0:c0 + 64]
            out = pr.prompt(P.prompt_batch(layout, 1, 64, [P.PromptChunk(chunk, c0, 1, table)]),
                            P.sample_params([greedy], [c0 + len(chunk)], 1))
        got = [int(out.tokens[0])]
        start, steps = len(prompt), {}
        while len(got) < len(want):
            drafts = np.asarray(pr.dstate.drafts[1])
            first = got[-1] if not steps else P.FROM_LAST
            window = P.tree_window(layout, 1, b, [[first] + [D.FROM_DRAFT] * (b - 1)], [list(range(-1, b - 1))],
                                   [start if not steps else -1], [1], [table])
            sampled, took, _ = pr.draft(window, P.sample_params([greedy] * b, [start + r + 1 for r in range(b)], b))
            k = int(took[0])
            steps[start] = drafts.tolist()
            got += sampled.tokens[0, :k].tolist()
            start += k
        assert got[:len(want)] == want, name
        whole = [i for i, s in enumerate(z[f"gen.{name}.block_start"]) if s + b <= len(prompt) + len(want)]
        assert whole, name
        for i in whole:
            s = int(z[f"gen.{name}.block_start"][i])
            assert steps[s] == z[f"gen.{name}.block_ids"][i, 1:].tolist(), (name, s)


# --- the engine ----------------------------------------------------------------------------------------------------


# The engine tests below run the tiny model's first 4 layers (tests/conftest.py, first_layers: their time is
# compiling, per layer); the programs against dflash's loop above run the whole model.
LAYERS = 4


def _engine(**kw):
    full = load_checkpoint(MODEL, dtype=jnp.bfloat16, progress=False)
    drafter = first_layers_drafter(load_dflash(DRAFTER, target=full.config.text, dtype=jnp.bfloat16), LAYERS)
    ck = first_layers(full, LAYERS)
    buckets = P.Buckets(prompt_rows=(64,), prompt_lanes=(1,), decode_streams=(2,), chain_rows=(4,),
                        packing=P.Packing.BATCHED, logprobs=2, slot_copy=kw.get("prompt_cache", 0) > 0)
    e = Engine(ck.params, ck.config, load_tokenizer(MODEL), dtype="bfloat16", max_model_len=192, parallel=2,
               max_queued=8, backend=Backend(kernels=True, interpret=True), buckets=buckets, max_logprobs=2,
               progress=False, drafter=drafter, **kw)
    e.start()
    return e


def _prompts():
    rng = np.random.default_rng(5)
    return [[int(t) for t in rng.integers(0, 500, size=n)] for n in (40, 70)]


def _request(prompt, seed, **kw):
    sampled = seed is not None
    opts = SamplingOptions(temperature=0.9, top_k=30, top_p=0.95, seed=seed) if sampled else SamplingOptions()
    return GenerationRequest(tuple(prompt), sampling=opts, ignore_eos=True, logprobs=2 if sampled else None, **kw)


def _idle(e):
    """The engine at rest once its prompt cache is emptied: every page and slot free."""
    e.clear_prompt_cache()
    _baseline(e)


def _same(a, b):
    assert (a.token_ids, a.logprobs, a.finish_reason) == (b.token_ids, b.logprobs, b.finish_reason)


# Engines of their own first (the oracle's beside the shared one, whose reply it takes), then the tests sharing one
# engine.


def test_oracle_drafts_equal_random_ones(monkeypatch, drafted):
    """An engine whose drafts are a reply's own next tokens, one position in PERIOD changed: windows kept whole, in
    part and not at all; the same reply, bit for bit, as with the random drafter (the `drafted` engine's reply to
    the same request), from an engine compiled with the oracle in the drafter's place."""
    _, reqs, replies, _ = drafted
    r, a = reqs[0], replies[0]
    assert r == _request(_prompts()[0], None, max_tokens=30)
    reply = np.asarray(list(r.prompt_ids) + list(a.token_ids) + [0] * 8, np.int32)
    reply[np.arange(len(reply)) % PERIOD == 2] += 1

    def oracle(logits, slot, anchor_position):
        # The table enters the program as a numpy constant, not a device array the trace closes over (CI's XLA:CPU
        # segfaulted compiling the latter twice in this test; not reproduced outside CI).
        pos = anchor_position[:, None] + 1 + jnp.arange(logits.shape[1])[None, :]
        return jnp.asarray(reply)[jnp.clip(pos, 0, len(reply) - 1)]

    monkeypatch.setattr(D, "propose", oracle)
    e = _engine()
    try:
        before = e.stats()
        got = e.submit(r).result(TIMEOUT)
        after = e.stats()
        _same(a, got)
        acc = after.draft_accepted_total - before.draft_accepted_total
        assert 0 < acc < after.draft_proposed_total - before.draft_proposed_total
        _baseline(e)
    finally:
        e.shutdown()


@pytest.fixture(scope="module")
def tree_engine():
    """An engine of tree windows (a node's most children: 2), with a prompt cache."""
    e = _engine(prompt_cache=2, draft_tree=2)
    yield e
    e.shutdown()


@pytest.mark.parametrize("tree", [0, 2])
def test_resumed_with_the_drafter_equals_fresh(tree, request):
    """The prompt cache keeps and restores a slot's draft cache and drafts with its GDN state: a prompt resumed from
    a kept prefix gets the reply it gets with the cache emptied first, and its drafter ends on the same drafts (so
    its context was the same all along). tree: tree windows (`draft_tree`), whose drafts' parents are kept too; 0:
    chains, on the `drafted` engine."""
    e = request.getfixturevalue("tree_engine") if tree else request.getfixturevalue("drafted")[0]
    rng = np.random.default_rng(9)
    head = [int(t) for t in rng.integers(0, 500, size=100)]
    first = _request(head, None, max_tokens=6)
    follow = _request(head + [int(t) for t in rng.integers(0, 500, size=20)], 3, max_tokens=12)
    other = _request([int(t) for t in rng.integers(0, 500, size=90)], None, max_tokens=2)
    runs = []
    for resume in (False, True):
        e.clear_prompt_cache()
        e.submit(first).result(TIMEOUT)  # keeps its state at 64 tokens
        e.submit(other).result(TIMEOUT)  # its slot's draft cache now holds another prompt
        if not resume:
            e.clear_prompt_cache()
        h = e.submit(follow)
        reply = h.result(TIMEOUT)
        assert h.cached_tokens == (64 if resume else 0)
        runs.append((reply, np.asarray(e.programs.dstate.drafts[1]), np.asarray(e.programs.dstate.parents[1])))
    _same(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    np.testing.assert_array_equal(runs[0][2], runs[1][2])
    _idle(e)


def test_structured_outputs_in_a_tree_engine(tree_engine):
    """With tree windows, a structured-output stream drafts chains: the tree's likeliest chain read back
    (`Programs.slot_drafts`), cut where the grammar refuses a draft, its rows masked. Its replies (greedy and seeded)
    are its serial ones, alone and beside a free stream drafting trees; it drafted; nothing compiles."""
    from tests.test_engine import SCHEMA, whitespace_bias
    e = tree_engine
    grammar = structured.compile_json_schema(SCHEMA)
    spaces = whitespace_bias(e.token_bytes())
    cons = []
    for p, seed in zip(_prompts(), (None, 7)):
        r = _request(p, seed, max_tokens=24)
        cons.append(dataclasses.replace(r, grammar=grammar, ignore_eos=False,
                                        sampling=dataclasses.replace(r.sampling, logit_bias=spaces)))
    serial = [e.submit(dataclasses.replace(r, draft=False)).result(TIMEOUT) for r in cons]
    before = e.stats()
    with P.CompileWatch() as watch:
        got = [e.submit(r).result(TIMEOUT) for r in cons]
    assert (watch.traces, watch.compiles) == (0, 0)
    assert e.stats().draft_proposed_total > before.draft_proposed_total  # they drafted
    free = _request(_prompts()[0], 3, max_tokens=20)
    alone = e.submit(free).result(TIMEOUT)
    handles = [e.submit(free), e.submit(cons[1])]
    _same(alone, handles[0].result(TIMEOUT))
    got.append(handles[1].result(TIMEOUT))
    for a, b in zip(serial + serial[1:], got):
        _same(a, b)
    for a in serial:
        m = structured.Matcher(grammar, e.token_bytes(), e.stop_ids)
        for t in a.token_ids:
            m.advance(t)
        assert m.terminated == (a.finish_reason == "stop")
    e.clear_prompt_cache()
    _baseline(e)


@pytest.fixture(scope="module")
def drafted():
    """Replies drafted by the random tiny drafter: each prompt greedy and seeded, alone. The engine keeps prompt
    states (test_resumed_with_the_drafter_equals_fresh[0] resumes from them; for the others, a seeded prompt may
    resume from its greedy twin's state, which gives the fresh reply)."""
    e = _engine(prompt_cache=2)
    reqs = [_request(p, seed, max_tokens=n) for p in _prompts() for seed, n in ((None, 30), (7, 27))]
    before = e.stats()
    replies = [e.submit(r).result(TIMEOUT) for r in reqs]
    after = e.stats()
    counters = dict(e._counters)
    yield e, reqs, replies, (after.draft_proposed_total - before.draft_proposed_total,
                             after.draft_accepted_total - before.draft_accepted_total, counters)
    e.shutdown()


def test_random_drafts_run_every_token_through_windows(drafted):
    e, reqs, replies, (proposed, accepted, counters) = drafted
    for r, a in zip(reqs, replies):
        assert a.finish_reason == "length" and len(a.token_ids) == r.max_tokens
    assert proposed > 0 and accepted < proposed
    assert counters["draft_windows_chained"] > 0  # windows enqueued behind the previous one
    _idle(e)


def test_concurrent_drafted_equals_solo(drafted):
    """The four requests at once, and a serial one (`draft` False) beside them."""
    e, reqs, replies, _ = drafted
    serial_req = dataclasses.replace(reqs[1], draft=False)
    handles = [e.submit(r) for r in reqs] + [e.submit(serial_req)]
    together = [h.result(TIMEOUT) for h in handles]
    for a, b in zip(replies, together):
        _same(a, b)
    assert together[-1].finish_reason == "length"
    _idle(e)


def test_structured_outputs_drafted(drafted):
    """Structured-output requests (a JSON schema, greedy and seeded) with the drafter's blocks: each window reads the
    stream's drafts back to the host and cuts them where the grammar refuses one (the random drafter's mostly), its
    rows masked along them. Each reply is its serial one (`draft` False), alone and beside a drafted free stream, and a
    document of the grammar, or a prefix of one where max_tokens cut it. Beside the free stream, the structured one
    sits out every other window call (its last one in flight), and no window waits for the one before it to land."""
    from tests.test_engine import SCHEMA, whitespace_bias
    e, reqs, replies, _ = drafted
    grammar = structured.compile_json_schema(SCHEMA)
    tb = e.token_bytes()
    spaces = whitespace_bias(tb)
    cons = [dataclasses.replace(r, grammar=grammar, ignore_eos=False, max_tokens=40,
                                sampling=dataclasses.replace(r.sampling, logit_bias=spaces)) for r in reqs[:2]]
    serial = [e.submit(dataclasses.replace(r, draft=False)).result(TIMEOUT) for r in cons]
    before = e.stats()
    with P.CompileWatch() as watch:
        got = [e.submit(r).result(TIMEOUT) for r in cons]
    assert (watch.traces, watch.compiles) == (0, 0)  # the drafts read back, the packed masks: nothing compiles
    assert e.stats().draft_proposed_total > before.draft_proposed_total  # they drafted
    calls = []
    dispatch = e.programs.draft_async

    def traced(window, sp, pen=None, mask=None):
        lanes = {int(s) for s, n in zip(np.asarray(window.slot), np.asarray(window.cache_len)) if n != 0}
        calls.append((len(e._inflight), sorted("json" if s.matcher else "free" for s in e._running
                                                if s.slot in lanes)))
        return dispatch(window, sp, pen, mask)

    e.programs.draft_async = traced
    try:
        handles = [e.submit(reqs[3]), e.submit(cons[1])]
        _same(replies[3], handles[0].result(TIMEOUT))
        got.append(handles[1].result(TIMEOUT))
    finally:
        del e.programs.draft_async
    for a, b in zip(serial + serial[1:], got):
        _same(a, b)
    both = [i for i, (_, ids) in enumerate(calls) if ids == ["free", "json"]]
    last_free = max(i for i, (_, ids) in enumerate(calls) if "free" in ids)
    assert len(both) >= 4 and all(b - a == 2 for a, b in zip(both, both[1:]) if b <= last_free), calls
    assert all(depth == 1 for depth, _ in calls[both[0] + 1:last_free + 1]), calls  # pipelined
    for r, a in zip(cons, serial):
        m = structured.Matcher(grammar, tb, e.stop_ids)
        for t in a.token_ids:
            m.advance(t)
        assert m.terminated == (a.finish_reason == "stop")
    _idle(e)


def test_stop_inside_a_window(drafted):
    e, reqs, replies, _ = drafted
    full = replies[0]
    stop = full.token_ids[12]
    cut = full.token_ids.index(stop) + 1
    got = e.submit(dataclasses.replace(reqs[0], stop_token_ids=(stop,))).result(TIMEOUT)
    assert got.token_ids == full.token_ids[:cut] and got.finish_reason == "stop"
    _idle(e)


def test_drafter_refused_off_the_row_invariant_path():
    ck = load_checkpoint(CAPTURES / "tiny", dtype=jnp.float32, progress=False)
    drafter = load_dflash(DRAFTER, target=ck.config.text, dtype=jnp.float32)
    with pytest.raises(ValueError, match="drafter"):
        Engine(ck.params, ck.config, None, dtype="float32", max_model_len=128, parallel=2, backend=Backend(),
               progress=False, drafter=drafter)


def test_slot_drafts_read_a_trees_likeliest_chain():
    """`Programs.slot_drafts` with tree drafts: from the pending token, each node's first child (the first found is
    the likeliest); a chain's drafts whole; padding (parent -1) never."""
    import types
    tree = types.SimpleNamespace(dstate=types.SimpleNamespace(
        drafts=np.array([[5, 6, 7, 8, 9, 0], [1, 2, 3, 4, 5, 6]]), parents=np.array([[0, 0, 1, 3, 2, -1],
                                                                                 [0, 1, 2, 3, 4, 5]])))
    assert P.Programs.slot_drafts(tree, 0).tolist() == [5, 7, 8]
    assert P.Programs.slot_drafts(tree, 1).tolist() == [1, 2, 3, 4, 5, 6]
