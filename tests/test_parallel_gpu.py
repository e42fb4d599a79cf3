"""Tensor parallelism over two GPUs with the kernels on (`pytest -m gpu` on a machine of two or more GPUs), on
captures/tiny-mlx-4bit: concurrent = solo under the batched policy, copy drafts = serial decoding, token for token
and logprob for logprob, nothing compiled while serving; greedy replies against one GPU's are reported, not
asserted (the output projections' sums are split, so near ties may fall the other way)."""

import dataclasses

import jax
import pytest

from qwen_jax import programs as P
from qwen_jax.checkpoint import load_tokenizer
from qwen_jax.engine.engine import Engine
from tests.test_engine import _baseline, _check_same, _concurrent, _requests, _solo
from tests.test_engine_gpu import MODEL, _params

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu" or jax.device_count() < 2,
                                 reason="needs two GPUs (run with -m gpu)")]


def test_concurrent_equals_solo_on_two_gpus():
    ck = _params("bfloat16")
    e = Engine(ck.params, ck.config, load_tokenizer(MODEL), dtype="bfloat16", max_model_len=512, parallel=16,
               prefill_step=64, max_logprobs=3, progress=False, tensor_parallel=2)
    assert e.shape_policy == "batched" and e.backend.kernels
    e.start()
    try:
        reqs = _requests(0)
        solo = _solo(e, reqs)
        with P.CompileWatch() as watch:
            together = _concurrent(e, reqs)
        _check_same(solo, together)
        _baseline(e)
        assert (watch.traces, watch.compiles) == (0, 0)
        assert e.programs.state.kv[0].k.addressable_shards[0].data.shape[0] == ck.config.text.num_kv_heads // 2
    finally:
        e.shutdown()
    one = Engine(ck.params, ck.config, load_tokenizer(MODEL), dtype="bfloat16", max_model_len=512, parallel=16,
                 prefill_step=64, max_logprobs=3, progress=False)
    one.start()
    try:
        greedy = [(r, s) for r, s in zip(reqs, solo) if r.sampling.temperature == 0]
        same = sum(one.submit(r).result(120).token_ids == s.token_ids for r, s in greedy)
        print(f"greedy replies equal to one GPU's: {same} of {len(greedy)}")
    finally:
        one.shutdown()


def test_drafted_equals_serial_on_two_gpus(monkeypatch):
    from qwen_jax.engine import stream as stream_mod
    from tests.test_drafts import OracleCopies, _prompts, _request
    ck = _params("bfloat16")
    e = Engine(ck.params, ck.config, None, dtype="bfloat16", max_model_len=512, parallel=4, max_logprobs=2,
               progress=False, copy_drafts=True, tensor_parallel=2)
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
        for a, b in zip(serial, drafted):
            assert (a.token_ids, a.logprobs, a.finish_reason) == (b.token_ids, b.logprobs, b.finish_reason)
        assert 0 < e.stats().draft_accepted_total - before.draft_accepted_total
        assert (watch.traces, watch.compiles) == (0, 0)
        _baseline(e)
    finally:
        e.shutdown()
