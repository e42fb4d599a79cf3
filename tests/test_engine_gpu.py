"""The engine on the device with the Pallas kernels on (`pytest -m gpu`), on captures/tiny-mlx-4bit, whose every
matmul goes through the qmm kernel. Both bucket policies: the fixed shapes and the batched one (prompt lanes in
one forward, power-of-two decode buckets 1..16; the default with kernels on quantized weights since session 10),
which must hold from the kernels' row invariance alone: concurrent ≡ solo, chunk cuts bit-identical, a decode
row's bits the same in every stream bucket. The batched policy failed here in session 2 and holds since
session 3 (programs.BATCHED_BY_DEFAULT)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen_jax import programs as P
from qwen_jax import sampling
from qwen_jax.checkpoint import load_checkpoint, load_tokenizer
from qwen_jax.engine.api import GenerationRequest, SamplingOptions
from qwen_jax.engine.engine import Engine
from qwen_jax.model import Backend
from tests.conftest import CAPTURES
from tests.test_engine import _baseline, _check_same, _requests, _solo, concurrent_equals_solo

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (run with -m gpu)")]

MODEL = CAPTURES / "tiny-mlx-4bit"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _params(dtype):
    return load_checkpoint(MODEL, dtype=DTYPES[dtype], progress=False)


@pytest.mark.parametrize("dtype,fixed,kv_cache", [("bfloat16", False, "bf16"), ("float32", False, "bf16"),
                                                   ("bfloat16", True, "bf16"), ("bfloat16", False, "fp8"),
                                                   ("bfloat16", False, "fp8-vkeys"),
                                                   ("bfloat16", False, "fp8-vkeys-chunkmax"),
                                                   ("bfloat16", False, "fp8-vkeys-chunkmax-e4m3")])
def test_concurrent_equals_solo_on_gpu(dtype, fixed, kv_cache, monkeypatch):
    """fixed=True: mapped lanes, one decode bucket of 16; fixed=False: the batched policy (lanes in one forward,
    decode buckets 1..16; the default here since session 10), which failed on the H200 in session 2 (see
    programs.BATCHED_BY_DEFAULT and tools/gpu/rowinv_probe.py); kv_cache "fp8": e4m3 pools with the window's pass 1
    the model's default picks for them; "fp8-vkeys": the same with v key-major (`kv_quant.FP8_V_LAYOUT`);
    "-chunkmax": and V's scales relative to the chunk's max (`attention.FP8_V_MAX`); "-e4m3": and the Mosaic GPU
    pass 1 with both MMAs on the e4m3 codes (`attention_window_mgpu.FP8`)."""
    from pallas_kernels import attention, attention_window_mgpu, kv_quant
    if kv_cache.endswith("-e4m3"):
        monkeypatch.setattr(attention_window_mgpu, "FP8", True)
        kv_cache = kv_cache.removesuffix("-e4m3")
    if kv_cache.startswith("fp8-vkeys"):
        monkeypatch.setattr(kv_quant, "FP8_V_LAYOUT", "keys")
        monkeypatch.setattr(attention, "FP8_V_MAX", "chunk" if kv_cache.endswith("chunkmax") else "block")
        kv_cache = "fp8"
    ck = _params(dtype)
    backend = Backend.default()
    assert backend.kernels and P.row_invariant(ck.params, backend)
    buckets = P.default_buckets(ck.params, backend, parallel=16, max_chunk=128, logprobs=3, fixed_shapes=fixed)
    if not fixed:
        assert buckets.packing is P.Packing.BATCHED and buckets.decode_streams == (1, 2, 4, 8, 16)
    e = Engine(ck.params, ck.config, load_tokenizer(MODEL), dtype=dtype, kv_cache=kv_cache, max_model_len=512,
               parallel=16,
               buckets=buckets, prefill_step=64, max_logprobs=3, progress=False)
    e.start()
    try:
        assert all(pool.v_layout == kv_quant.FP8_V_LAYOUT for pool in e.programs.state.kv) or kv_cache == "bf16"
        if attention_window_mgpu.FP8:  # the gate is the Mosaic GPU pass 1's, not a fallback's
            pool = e.programs.state.kv[0]
            tiles = attention.model_window_tiles(jnp.bfloat16, pool, ck.config.text.num_heads,
                                                 max_keys=512, interpret=False)
            assert tiles.impl == "mgpu" and pool.keys_major, tiles
        # alone: the smallest lane and decode buckets; together: lanes packed, decode buckets up to 16, prompts re-cut
        concurrent_equals_solo(e, _requests(0))
    finally:
        e.shutdown()


def test_structured_and_penalized_on_gpu():
    """Structured outputs (a JSON schema, greedy and seeded; any JSON object) and penalties (all three kinds and a
    logit bias) with the kernels on, the batched policy: each such reply is the same alone and among plain ones,
    nothing compiles while serving (the bias row's program included), and a constrained reply is a document of its
    grammar, or a prefix of one when max_tokens cut it."""
    from qwen_jax import structured
    from tests.test_engine import SCHEMA
    ck = _params("bfloat16")
    tok = load_tokenizer(MODEL)
    e = Engine(ck.params, ck.config, tok, dtype="bfloat16", max_model_len=512, parallel=16, prefill_step=64,
               max_logprobs=3, progress=False)
    e.start()
    try:
        rng = np.random.default_rng(3)
        prompt = lambda n: tuple(int(t) for t in rng.integers(0, 490, size=n))  # noqa: E731
        schema, any_object = structured.compile_json_schema(SCHEMA), structured.compile_json_schema(None)
        special = [GenerationRequest(prompt(30), 60, grammar=schema, logprobs=2),
                   GenerationRequest(prompt(50), 60, SamplingOptions(temperature=1.0, seed=3), grammar=schema),
                   GenerationRequest(prompt(20), 40, SamplingOptions(temperature=0.7, seed=8), grammar=any_object),
                   GenerationRequest(prompt(40), 24, SamplingOptions(temperature=0.9, top_k=40, seed=5,
                                                                     presence_penalty=1.0, frequency_penalty=0.5,
                                                                     repetition_penalty=1.2,
                                                                     logit_bias=((7, 5.0), (300, -3.0))),
                                     ignore_eos=True, logprobs=3)]
        reqs = special + _requests(1)[:8]
        solo = _solo(e, reqs)
        with P.CompileWatch() as watch:
            together = [h.result(120) for h in [e.submit(r) for r in reqs]]
        _check_same(solo, together)
        _baseline(e)
        assert (watch.traces, watch.compiles) == (0, 0)
        for req, reply in zip(special[:3], together):
            m = structured.Matcher(req.grammar, e.token_bytes(), e.stop_ids)
            for t in reply.token_ids:
                m.advance(t)
            assert m.terminated == (reply.finish_reason == "stop")
    finally:
        e.shutdown()


@pytest.mark.parametrize("kv_cache", ["bf16", "fp8"])
def test_drafted_equals_serial_on_gpu(kv_cache, monkeypatch):
    """Copy drafts (`copy_drafts`, the draft program's chain windows of up to 16 rows) against serial decoding
    (`draft` False: the fused decode step), token for token and logprob for logprob, greedy and seeded-sampled,
    alone and two drafted streams beside a serial one; drafts from an oracle in the index's place (the serial
    reply with one token changed every 5th round, tests/test_drafts.py), so windows are kept whole, in part and
    not at all; no compile while serving."""
    ck = _params("bfloat16")
    e = Engine(ck.params, ck.config, None, dtype="bfloat16", kv_cache=kv_cache, max_model_len=512, parallel=4,
               max_logprobs=2, progress=False, copy_drafts=True)
    copy_drafts_equal_serial(e, monkeypatch)


def test_thinking_budget_drafted_equals_serial_on_gpu(monkeypatch):
    """A thinking budget with the kernels on: a seeded reply whose think block is forced shut after 5 tokens is the
    serial reply with `think_end` at token 6; drafted by copy drafts (the oracle over that reply), it decodes
    serially while it thinks and in windows after, alone and beside a drafted greedy stream: the serial replies,
    token for token and logprob for logprob, drafts kept, nothing compiled while serving."""
    from qwen_jax.engine import stream as stream_mod
    from tests.test_drafts import OracleCopies, _prompts, _request
    ck = _params("bfloat16")
    e = Engine(ck.params, ck.config, None, dtype="bfloat16", max_model_len=512, parallel=4, max_logprobs=2,
               progress=False, copy_drafts=True)
    replies = {}
    monkeypatch.setattr(stream_mod, "CopyIndex", lambda tokens: OracleCopies(tokens, replies, e.vocab_size, 5, 16))
    e.start()
    try:
        req, other = _request(_prompts()[1], 11, max_tokens=40), _request(_prompts()[0], None, max_tokens=30)
        free = e.submit(dataclasses.replace(req, draft=False)).result(120)
        end = next(t for t in range(480, 0, -1) if t not in free.token_ids)
        budget = dataclasses.replace(req, thinking_budget=5, think_end=end)
        serial = [e.submit(dataclasses.replace(r, draft=False)).result(120) for r in (budget, other)]
        assert serial[0].token_ids[:6] == free.token_ids[:5] + (end,)
        replies.update({budget.prompt_ids: serial[0].token_ids, other.prompt_ids: serial[1].token_ids})
        before = e.stats()
        with P.CompileWatch() as watch:
            alone = e.submit(budget).result(120)
            together = [h.result(120) for h in [e.submit(budget), e.submit(other)]]
        for a, b in zip(serial[:1] + serial, [alone] + together):
            assert (a.token_ids, a.logprobs, a.finish_reason) == (b.token_ids, b.logprobs, b.finish_reason)
        assert e.stats().draft_accepted_total > before.draft_accepted_total
        assert (watch.traces, watch.compiles) == (0, 0)
        _baseline(e)
    finally:
        e.shutdown()


def copy_drafts_equal_serial(e: Engine, monkeypatch):
    """e (copy drafts on, not started): each request serial, then drafted alone and two drafted beside a serial one,
    drafts from the oracle over the serial replies; the same replies, drafts kept, nothing compiled."""
    from qwen_jax.engine import stream as stream_mod
    from tests.test_drafts import OracleCopies, _prompts, _request
    replies = {}
    monkeypatch.setattr(stream_mod, "CopyIndex", lambda tokens: OracleCopies(tokens, replies, e.vocab_size, 5, 16))
    e.start()
    try:
        reqs = [_request(p, seed, max_tokens=n) for p in _prompts() for seed, n in ((None, 40), (11, 37))]
        serial = [e.submit(dataclasses.replace(r, draft=False)).result(120) for r in reqs]
        for r, a in zip(reqs, serial):
            replies[r.prompt_ids] = a.token_ids
        before = e.stats()
        with P.CompileWatch() as watch:
            drafted = [e.submit(r).result(120) for r in reqs]
            handles = [e.submit(reqs[0]), e.submit(dataclasses.replace(reqs[1], draft=False)), e.submit(reqs[3])]
            together = [h.result(120) for h in handles]
        after = e.stats()
        for a, b in zip(serial + [serial[0], serial[1], serial[3]], drafted + together):
            assert (a.token_ids, a.logprobs, a.finish_reason) == (b.token_ids, b.logprobs, b.finish_reason)
        assert 0 < after.draft_accepted_total - before.draft_accepted_total
        assert (watch.traces, watch.compiles) == (0, 0)
        _baseline(e)
    finally:
        e.shutdown()


def _structured_drafts_equal_serial(e: Engine, max_tokens: int, replies: dict | None = None):
    """Structured-output requests (a JSON schema, greedy and seeded) and a free one, each serial first (their replies
    into `replies` when given: an oracle's), then drafted alone and the free one beside a structured one: every reply
    its serial one token for token and logprob for logprob, nothing compiled while serving. -> the engine's stats
    before and after the drafted runs."""
    from qwen_jax import structured
    from tests.test_drafts import _prompts, _request
    from tests.test_engine import SCHEMA, whitespace_bias
    grammar = structured.compile_json_schema(SCHEMA)
    spaces = whitespace_bias(e.token_bytes())
    reqs = [_request(p, seed, max_tokens=max_tokens) for p in _prompts() for seed in (None, 11)]
    reqs = [dataclasses.replace(r, grammar=grammar, ignore_eos=False,
                                sampling=dataclasses.replace(r.sampling, logit_bias=spaces)) for r in reqs]
    free = _request(_prompts()[1][3:], 5, max_tokens=40)
    serial = [e.submit(dataclasses.replace(r, draft=False)).result(120) for r in reqs + [free]]
    if replies is not None:  # a prompt's seeded reply is the oracle's for its greedy one too
        replies.update((r.prompt_ids, a.token_ids) for r, a in zip(reqs + [free], serial))
    before = e.stats()
    with P.CompileWatch() as watch:
        drafted = [e.submit(r).result(120) for r in reqs]
        together = [h.result(120) for h in [e.submit(free), e.submit(reqs[1])]]
    after = e.stats()
    for a, b in zip(serial + [serial[1]], drafted + together, strict=True):
        assert (a.token_ids, a.logprobs, a.finish_reason) == (b.token_ids, b.logprobs, b.finish_reason)
    assert (watch.traces, watch.compiles) == (0, 0)
    _baseline(e)
    return before, after


def test_drafted_structured_equals_serial_on_gpu(monkeypatch):
    """Structured-output requests drafted by copy drafts from an oracle (the serial reply with one token changed
    every 3rd round): each row masked along the drafts before it, the drafts cut where the grammar refuses one;
    `_structured_drafts_equal_serial`, drafts accepted."""
    from qwen_jax.engine import stream as stream_mod
    from tests.test_drafts import OracleCopies
    ck = _params("bfloat16")
    e = Engine(ck.params, ck.config, load_tokenizer(MODEL), dtype="bfloat16", max_model_len=512, parallel=4,
               max_logprobs=2, progress=False, copy_drafts=True)
    replies = {}
    monkeypatch.setattr(stream_mod, "CopyIndex", lambda tokens: OracleCopies(tokens, replies, e.vocab_size, 3, 16))
    e.start()
    try:
        before, after = _structured_drafts_equal_serial(e, 60, replies)
        assert 0 < after.draft_accepted_total - before.draft_accepted_total
    finally:
        e.shutdown()


def test_tree_structured_equals_serial_on_gpu():
    """A tree engine (`draft_tree` 3, captures/tiny-dflash) with the kernels on: structured-output requests draft the
    tree's likeliest chain, masked along it, beside a free stream drafting trees; `_structured_drafts_equal_serial`,
    drafts proposed."""
    from qwen_jax.checkpoint import load_dflash
    ck = _params("bfloat16")
    drafter = load_dflash(CAPTURES / "tiny-dflash", target=ck.config.text, dtype=jnp.bfloat16)
    e = Engine(ck.params, ck.config, load_tokenizer(MODEL), dtype="bfloat16", max_model_len=512, parallel=4,
               max_logprobs=2, progress=False, drafter=drafter, draft_tree=3)
    e.start()
    try:
        before, after = _structured_drafts_equal_serial(e, 48)
        assert 0 < after.draft_proposed_total - before.draft_proposed_total
    finally:
        e.shutdown()


@pytest.mark.parametrize("kv_cache,tree", [("bf16", 0), ("fp8", 0), ("bf16", 3), ("fp8", 3)])
def test_block_drafted_equals_serial_on_gpu(kv_cache, tree, monkeypatch):
    """DFlash block drafts (`drafter`: captures/tiny-dflash, blocks of 4; drafts made and read on the device)
    against serial decoding, token for token and logprob for logprob, greedy and seeded-sampled, alone and beside a
    serial stream: first with the tiny random drafter's own drafts (windows nearly always cut after their first
    row), then with an oracle's in their place (each stream's serial reply with every 5th position changed, by its
    slot: windows kept whole, in part and not at all); no compile while serving. tree: windows are the drafter's
    trees (`draft_tree`, a node's most children), and the oracle's a ladder kept through second children only."""
    from qwen_jax import dflash_programs as D
    from qwen_jax.checkpoint import load_dflash
    from tests.test_drafts import _prompts, _request
    from tests.test_tree_drafts import ladder_oracle
    ck = _params("bfloat16")
    drafter = load_dflash(CAPTURES / "tiny-dflash", target=ck.config.text, dtype=jnp.bfloat16)
    reqs = [_request(p, seed, max_tokens=n) for p in _prompts() for seed, n in ((None, 40), (11, 37))]
    table = np.zeros((len(reqs) + 1, 512), np.int32)  # the oracle's drafts by slot and absolute position
    serial = None
    for oracle in (False, True):
        if oracle:
            def propose(logits, slot, anchor_position, t=jnp.asarray(table)):
                pos = anchor_position[:, None] + 1 + jnp.arange(logits.shape[1])[None, :]
                return t[slot[:, None], jnp.clip(pos, 0, t.shape[1] - 1)]
            monkeypatch.setattr(D, "propose", propose)
            monkeypatch.setattr(D, "propose_tree", ladder_oracle(table))
        e = Engine(ck.params, ck.config, None, dtype="bfloat16", kv_cache=kv_cache, max_model_len=512,
                   parallel=len(reqs), max_logprobs=2, progress=False, drafter=drafter, draft_tree=tree)
        e.start()
        try:
            if serial is None:
                serial = [e.submit(dataclasses.replace(r, draft=False)).result(120) for r in reqs]
                for i, (r, a) in enumerate(zip(reqs, serial)):
                    reply = np.asarray(r.prompt_ids + a.token_ids, np.int32)
                    table[i + 1, :len(reply)] = reply  # the lowest free slots in submission order: 1, 2, ...
                    table[i + 1, np.arange(512) % 5 == 3] += 1
            before = e.stats()
            with P.CompileWatch() as watch:
                if oracle:  # all at once, each on its own slot
                    drafted = [h.result(120) for h in [e.submit(r) for r in reqs]]
                else:
                    drafted = [e.submit(r).result(120) for r in reqs]
                    handles = [e.submit(reqs[0]), e.submit(dataclasses.replace(reqs[1], draft=False)),
                               e.submit(reqs[3])]
                    drafted += [h.result(120) for h in handles]
            after = e.stats()
            want = serial + ([] if oracle else [serial[0], serial[1], serial[3]])
            for a, b in zip(want, drafted, strict=True):
                assert (a.token_ids, a.logprobs, a.finish_reason) == (b.token_ids, b.logprobs, b.finish_reason)
            proposed = after.draft_proposed_total - before.draft_proposed_total
            accepted = after.draft_accepted_total - before.draft_accepted_total
            assert proposed > 0 and (not oracle or 0 < accepted < proposed)
            assert (watch.traces, watch.compiles) == (0, 0)
            _baseline(e)
        finally:
            e.shutdown()


@pytest.mark.parametrize("kv_cache", ["bf16", "fp8"])
def test_resumed_equals_fresh_on_gpu(kv_cache):
    """The prompt cache (`prompt_cache`) on the device's kernels, batched shapes: prompts that extend a kept one
    (the same prefix with other endings, the same prompt again, a follow-up of prompt + reply + more) resume from
    it, alone and four together, and give token for token and logprob for logprob what they give with the cache
    emptied before each; no compile while serving."""
    ck = _params("bfloat16")
    e = Engine(ck.params, ck.config, None, dtype="bfloat16", kv_cache=kv_cache, max_model_len=1024, parallel=8,
               max_logprobs=2, progress=False, prompt_cache=4, prefill_step=128)
    e.start()
    try:
        rng = np.random.default_rng(21)
        shared = [int(t) for t in rng.integers(0, 490, size=300)]
        reqs = [GenerationRequest(tuple(shared + [int(t) for t in rng.integers(0, 490, size=n)]), max_tokens=24,
                                  sampling=SamplingOptions() if i % 2 == 0 else
                                  SamplingOptions(temperature=0.9, top_p=0.95, seed=40 + i),
                                  ignore_eos=True, logprobs=2) for i, n in enumerate((1, 40, 100, 7))]
        fresh = []
        for r in reqs:
            e.clear_prompt_cache()
            fresh.append(e.submit(r).result(120))
        first = fresh[0]
        follow = dataclasses.replace(reqs[0], prompt_ids=reqs[0].prompt_ids + first.token_ids + (5, 6, 7))
        e.clear_prompt_cache()
        fresh_follow = e.submit(follow).result(120)
        e.submit(reqs[0]).result(120)  # 301 tokens: keeps 256 (within the shared 300)
        with P.CompileWatch() as watch:
            handles = [e.submit(r) for r in reqs[1:]]  # three resumed together
            together = [h.result(120) for h in handles]
            again = e.submit(reqs[0])
            h_follow = e.submit(follow)
            solo = [again.result(120), h_follow.result(120)]
        # the follow-up resumes from the state its own fresh run kept at 320
        assert [h.cached_tokens for h in handles + [again, h_follow]] == [256] * 4 + [320]
        for a, b in zip(fresh[1:] + [fresh[0], fresh_follow], together + solo):
            assert (a.token_ids, a.logprobs, a.finish_reason) == (b.token_ids, b.logprobs, b.finish_reason)
        assert (watch.traces, watch.compiles) == (0, 0)
        e.clear_prompt_cache()
        _baseline(e)
    finally:
        e.shutdown()


@pytest.fixture(scope="module")
def progs():
    ck = _params("bfloat16")
    layout = P.Layout(64, 8, 6 * 8 + 1, 6, "bfloat16")
    buckets = P.Buckets((64, 128, 256), (1, 4), (1, 4, 16, 64), packing=P.Packing.BATCHED, logprobs=4)
    pr = P.Programs(ck.params, ck.config, layout, buckets, Backend.default())
    pr.compile()
    return pr


def _table(slot):
    return np.arange(1 + 8 * (slot - 1), 1 + 8 * slot, dtype=np.int32)


def _slot_state(pr, slot, length):
    st = pr.state

    def rows(x):
        x = np.asarray(x[:, _table(slot)].astype(jnp.float32))
        return x.reshape(x.shape[0], -1, x.shape[-1])[:, :length]

    return ([np.asarray(r[slot]) for r in st.rec], [np.asarray(c[slot].astype(jnp.float32)) for c in st.conv],
            [rows(kv.k) for kv in st.kv] + [rows(kv.v) for kv in st.kv])


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


RULE = sampling.RequestSampling(seed=3, temperature=0.8, top_p=0.9)


def _prefill(pr, prompt, cuts, slot, lanes, rng):
    pos = 0
    for cut in cuts:
        n = min(cut, len(prompt) - pos)
        chunks = [P.PromptChunk(prompt[pos:pos + n], pos, slot, _table(slot))]
        chunks += [P.PromptChunk(rng.integers(0, 490, size=int(rng.integers(1, 64))), 0, 5, _table(5))
                   for _ in range(lanes - 1)]
        shape = pr.buckets.prompt_bucket(lanes, n)
        out = pr.prompt(P.prompt_batch(pr.layout, *shape, chunks),
                        P.sample_params([RULE] * lanes, [c.start + len(c.tokens) for c in chunks], shape[0]))
        pos += n
    return (out.tokens[0], out.logprob[0], out.top_logprobs[0]), _slot_state(pr, slot, len(prompt))


def test_chunk_cuts_bit_identical_on_gpu(progs):
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 490, size=300)
    ref = _prefill(progs, prompt, [256, 256], 1, 1, rng)
    for cuts, lanes in (([64] * 5, 4), ([128, 128, 128], 1), ([64, 256], 4)):
        assert _same(_prefill(progs, prompt, cuts, 2, lanes, rng), ref), cuts


def test_decode_row_same_bits_in_every_stream_bucket(progs):
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 490, size=90)
    results = []
    for bucket in (1, 4, 16, 64):  # 64: one 64-row piece of the Mosaic GPU decode qmm (qmm_mgpu.pieces)
        _prefill(progs, prompt, [128], 1, 1, rng)
        others = list(range(2, min(bucket, 5) + 1))
        for s in others:
            _prefill(progs, rng.integers(0, 490, size=40), [64], s, 1, rng)
        toks = [17] + [int(t) for t in rng.integers(0, 490, size=len(others))]
        w = P.decode_window(progs.layout, bucket, toks, [90] + [40] * len(others), [1] + others,
                            [_table(1)] + [_table(s) for s in others])
        out = progs.decode(w, P.sample_params([RULE] * len(toks), [91] + [41] * len(others), bucket))
        results.append(((out.tokens[0], out.logprob[0], out.top_logprobs[0]), _slot_state(progs, 1, 91)))
    for r in results[1:]:
        assert _same(r, results[0])


def test_pools_updated_in_place_on_gpu(progs):
    from tests.test_programs import pool_copies
    copies = pool_copies(progs)
    assert all(n == 0 for n in copies.values()), copies
