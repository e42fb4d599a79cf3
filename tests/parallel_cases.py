"""Tensor parallelism over two CPU devices (run by tests/test_parallel.py in a pytest of its own, with
QWEN_JAX_TEST_CPU_DEVICES=2; not collected by the suite itself): the model's entry points against one device's
(numerically: the output projections' sums are split), and the engine's exactness under two devices, token for
token: concurrent = solo, greedy and seeded, an image's rows among them, a prompt resumed from the prompt cache =
fresh (an fp8 KV cache), and a DFlash drafter's windows with the kernels on (interpreted) = serial decoding."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen_jax import model as M
from qwen_jax import programs as P
from qwen_jax.checkpoint import load_checkpoint, load_tokenizer
from qwen_jax.engine.api import GenerationRequest, SamplingOptions
from qwen_jax.engine.engine import Engine
from qwen_jax.model import parallel
from tests.conftest import CAPTURES

TIMEOUT = 300

pytestmark = pytest.mark.skipif(jax.device_count() < 2, reason="needs two devices (tests/test_parallel.py)")


def _pt(first: int) -> np.ndarray:
    return np.arange(first, first + 10, dtype=np.int32)[None]


def _entry_points(params, cfg, be, state, toks) -> list[np.ndarray]:
    """prefill's logits for every row of a 50-token prompt, a 5-node tree window's, then 3 serial steps' after the
    commit of a 3-node path."""
    logits, st, _ = jax.jit(lambda p, s, b: M.prefill(p, s, b, cfg, be, all_logits=True))(
        params, state, M.make_prefill_batch(toks[:, :50], [0], [50], [1], _pt(1)))
    w = M.make_window(toks[:, 50:55], [[-1, 0, 0, 1, 3]], [50], [1], _pt(1))
    tree, kept, _ = jax.jit(lambda p, s, w: M.verify(p, s, w, cfg, be))(params, st, w)
    path = jnp.asarray([[0, 1, 3, 0, 0]], jnp.int32)
    st = jax.jit(lambda s, k, w, a, n: M.commit(s, k, w, a, n, cfg, be))(st, kept, w, path, jnp.asarray([3]))
    steps, step = [], jax.jit(lambda p, s, w: M.step(p, s, w, cfg, be))  # (one jit: each new lambda compiles anew)
    for i, t in enumerate(toks[0, 55:58]):
        lg, st = step(params, st, M.make_window([[t]], [[-1]], [53 + i], [1], _pt(1)))
        steps.append(lg[:, 0])
    if be.parallel is not None:  # the pools split by head
        assert st.kv[0].k.sharding.spec == parallel.P(parallel.AXIS)
        assert st.rec[0].addressable_shards[0].data.shape[1] == cfg.text.linear_num_value_heads // 2
    return [np.asarray(a, np.float32) for a in (logits, tree, jnp.concatenate(steps))]


def test_entry_points_match_one_device():
    """prefill, a tree window's verify, the commit of a path and serial steps over two devices against one
    device's: captures/tiny in fp32 within 1e-4 (logits ~10); the 4-bit checkpoint in bf16 as close to its fp32
    one-device run as one device's bf16 run is, to within 2x (the devices' sums round apart: bf16 rounding, not an
    error). The lm_head split by vocabulary rows (untied), the pools by head."""
    tp = parallel.TensorParallel.over(2)
    err = lambda a, b: max(float(np.abs(x - y).max()) for x, y in zip(a, b))  # noqa: E731

    def runs(name, dtype, devices):
        ck = load_checkpoint(CAPTURES / name, dtype=dtype, progress=False)
        cfg = ck.config
        state = M.init_state(cfg.text, num_slots=3, num_pages=24, page_size=16, dtype=dtype)
        toks = np.random.default_rng(0).integers(0, cfg.text.vocab_size, size=(1, 60))
        out = {}
        if 1 in devices:
            out[1] = _entry_points(ck.params, cfg, M.Backend(), state, toks)
        if 2 in devices:
            laid = parallel.shard_layout(ck.params, cfg, 2)
            split = parallel.place(laid, parallel.param_specs(laid), tp)
            assert jax.tree.leaves(split["lm_head"])[0].sharding.spec == parallel.P(parallel.AXIS, None)
            out[2] = _entry_points(split, cfg, M.Backend(parallel=tp),
                                   parallel.place(state, parallel.state_specs(state), tp), toks)
        return out

    fp32 = runs("tiny", jnp.float32, (1, 2))
    assert err(fp32[1], fp32[2]) < 1e-4
    ref = runs("tiny-mlx-4bit", jnp.float32, (1,))[1]
    bf16 = runs("tiny-mlx-4bit", jnp.bfloat16, (1, 2))
    one, two = err(ref, bf16[1]), err(ref, bf16[2])
    assert 0 < two < 2 * one, (one, two)


def _engine(tensor_parallel: int, **kw) -> Engine:
    ck = load_checkpoint(CAPTURES / "tiny", dtype=jnp.float32, progress=False)
    buckets = P.Buckets(prompt_rows=(64, 128), prompt_lanes=(4,), decode_streams=(8,), logprobs=2,
                        slot_copy=kw.get("prompt_cache", 0) > 0)
    return Engine(ck.params, ck.config, load_tokenizer(CAPTURES / "tiny"), dtype="float32", kv_cache="fp8",
                  max_model_len=256, parallel=8, backend=M.Backend(), buckets=buckets, prefill_step=64,
                  max_logprobs=2, progress=False, media_rows=48, tensor_parallel=tensor_parallel, **kw)


def _requests() -> list[GenerationRequest]:
    rng = np.random.default_rng(7)
    reqs = []
    for i, n in enumerate([3, 150, 17, 64, 65, 100, 1, 40]):
        opts = SamplingOptions() if i % 2 == 0 else SamplingOptions(temperature=0.9, top_k=20, top_p=0.95,
                                                                     seed=500 + i)
        reqs.append(GenerationRequest(tuple(int(t) for t in rng.integers(0, 490, size=n)), max_tokens=12,
                                      sampling=opts, ignore_eos=True, logprobs=[None, 2][i % 2], request_id=f"r{i}"))
    # an image's rows (given embeddings, M-RoPE positions), as the vision tower hands them to the engine
    from tests.test_media import _image_prompt
    reqs.append(dataclasses.replace(_image_prompt(rng, 50, (4, 5), 30, 128), request_id="image"))
    return reqs


def _baseline(e: Engine):
    """Nothing running or waiting, every stream's pages and slot back; the prompt cache's entries hold theirs."""
    s = e.stats()
    kept = len({page for entry in e._cache.entries for page in entry.pages}) if e._cache is not None else 0
    assert (s.running, s.waiting, s.free_pages, s.free_slots) == (0, 0, s.total_pages - kept, s.total_slots), s


def test_engine_concurrent_equals_solo_and_the_prompt_cache_resumes_exactly():
    """Under two devices, an fp8 KV cache (its codes and scales split by head with the pages): 8 requests of
    different lengths, greedy and seeded, and an image's rows, together = each alone (ids and logprobs, bit for
    bit), steady state compiles nothing, pools back to baseline; a prompt resumed from the prompt cache = the same
    prompt fresh; the greedy replies = one device's (the tiny model's top tokens are not near ties at fp32)."""
    e = _engine(2, prompt_cache=2)
    assert e.backend.parallel is not None and e.backend.parallel.size == 2
    e.start()
    try:
        reqs = _requests()
        solo = [e.submit(r).result(TIMEOUT) for r in reqs]
        _baseline(e)
        with P.CompileWatch() as watch:
            together = [h.result(TIMEOUT) for h in [e.submit(r) for r in reqs]]
        assert (watch.traces, watch.compiles) == (0, 0)
        for a, b in zip(solo, together):
            assert (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs)
        _baseline(e)
        # the prompt cache: a prompt extending request 1's resumes from its kept state
        long = dataclasses.replace(reqs[1], prompt_ids=reqs[1].prompt_ids + (5, 6, 7), request_id="resumed")
        hits = e.stats().prompt_cache_hits_total
        handle = e.submit(long)
        resumed = handle.result(TIMEOUT)
        assert e.stats().prompt_cache_hits_total == hits + 1 and handle.cached_tokens == 128
        e.clear_prompt_cache()
        fresh = e.submit(long).result(TIMEOUT)
        assert e.stats().prompt_cache_hits_total == hits + 1
        assert (resumed.token_ids, resumed.logprobs) == (fresh.token_ids, fresh.logprobs)
    finally:
        e.shutdown()
    ref = _engine(1)
    ref.start()
    try:
        greedy = [r for r in reqs if r.sampling.temperature == 0]
        assert [ref.submit(r).result(TIMEOUT).token_ids for r in greedy] == \
            [s.token_ids for s, r in zip(solo, reqs) if r.sampling.temperature == 0]
    finally:
        ref.shutdown()


def test_block_drafts_equal_serial_with_the_kernels():
    """A DFlash drafter's windows under two devices, the Pallas kernels on (interpreted; the 4-bit checkpoint's first
    layers and the drafter's, as tests/test_dflash_engine.py runs them): drafted replies = serial ones, greedy and
    seeded, ids and logprobs."""
    from qwen_jax.checkpoint import load_dflash
    from tests.conftest import first_layers, first_layers_drafter
    from tests.test_dflash_engine import LAYERS, _prompts, _request
    full = load_checkpoint(CAPTURES / "tiny-mlx-4bit", dtype=jnp.bfloat16, progress=False)
    drafter = first_layers_drafter(load_dflash(CAPTURES / "tiny-dflash", target=full.config.text,
                                               dtype=jnp.bfloat16), LAYERS)
    ck = first_layers(full, LAYERS)
    buckets = P.Buckets(prompt_rows=(64,), prompt_lanes=(1,), decode_streams=(2,), chain_rows=(4,),
                        packing=P.Packing.BATCHED, logprobs=2)
    e = Engine(ck.params, ck.config, load_tokenizer(CAPTURES / "tiny-mlx-4bit"), dtype="bfloat16",
               max_model_len=192, parallel=2, max_queued=8, backend=M.Backend(kernels=True, interpret=True),
               buckets=buckets, max_logprobs=2, progress=False, drafter=drafter, tensor_parallel=2)
    e.start()
    try:
        reqs = [_request(p, seed, max_tokens=16) for p, seed in zip(_prompts(), (None, 7))]
        serial = [e.submit(dataclasses.replace(r, draft=False)).result(TIMEOUT) for r in reqs]
        before = e.stats()
        drafted = [h.result(TIMEOUT) for h in [e.submit(r) for r in reqs]]
        assert e.stats().draft_proposed_total > before.draft_proposed_total
        for a, b in zip(serial, drafted):
            assert (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs)
        _baseline(e)
    finally:
        e.shutdown()


def test_eval_over_two_devices():
    """`eval ppl` and `eval kv` (teacher-forced, compiled chunks) over two devices: one device's figures to fp32
    rounding on captures/tiny."""
    from qwen_jax.engine import evaluate
    ck = load_checkpoint(CAPTURES / "tiny", dtype=jnp.float32, progress=False)
    tokens = np.random.default_rng(3).integers(0, 490, size=300)
    two = M.Backend(parallel=parallel.TensorParallel.over(2))
    kw = dict(dtype="float32", context=256, chunk=128)
    a, b = (evaluate.perplexity(ck.params, ck.config, tokens, backend=be, **kw) for be in (M.Backend(), two))
    assert a.tokens == b.tokens and abs(a.nll - b.nll) < 1e-5, (a, b)
    a, b = (evaluate.kv_agreement(ck.params, ck.config, tokens, backend=be, **kw) for be in (M.Backend(), two))
    assert abs(a.top1_agreement - b.top1_agreement) <= 1 / a.tokens
    assert abs(a.mean_kl - b.mean_kl) < 1e-3 * a.mean_kl + 1e-7, (a, b)
