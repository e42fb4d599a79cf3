"""Tensor parallelism on GPUs with the kernels on (`pytest -m gpu`), on captures/tiny-mlx-4bit: over a mesh of one
GPU, the plain engine's bits; over two (a machine of two or more GPUs), concurrent = solo under the batched policy,
copy drafts = serial decoding, token for token and logprob for logprob, nothing compiled while serving; greedy
replies against one GPU's are reported, not asserted (the output projections' sums are split, so near ties may fall
the other way)."""

import jax
import pytest

from qwen_jax.checkpoint import load_tokenizer
from qwen_jax.engine.engine import Engine
from tests.test_engine import _requests, concurrent_equals_solo
from tests.test_engine_gpu import MODEL, _params, copy_drafts_equal_serial

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (-m gpu)")]
two_gpus = pytest.mark.skipif(jax.device_count() < 2, reason="needs two GPUs")


def test_one_device_mesh_equals_plain_on_gpu():
    """The tensor-parallel path over a mesh of one GPU (every program's model under shard_map, the kernels lowered
    there, the output projections through `parallel.reduce`) gives the plain engine's replies bit for bit: token
    ids and logprobs, greedy and seeded, concurrent as solo."""
    from qwen_jax.model import Backend, parallel
    ck = _params("bfloat16")
    reqs = _requests(0)[:8]
    replies = []
    for backend in (Backend.default(), Backend(kernels=True, parallel=parallel.TensorParallel.over(1))):
        e = Engine(ck.params, ck.config, load_tokenizer(MODEL), dtype="bfloat16", max_model_len=512, parallel=16,
                   prefill_step=64, max_logprobs=3, progress=False, backend=backend)
        e.start()
        try:
            replies.append(concurrent_equals_solo(e, reqs))
        finally:
            e.shutdown()
    for a, b in zip(*replies):
        assert (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs)


@two_gpus
def test_concurrent_equals_solo_on_two_gpus():
    ck = _params("bfloat16")
    e = Engine(ck.params, ck.config, load_tokenizer(MODEL), dtype="bfloat16", max_model_len=512, parallel=16,
               prefill_step=64, max_logprobs=3, progress=False, tensor_parallel=2)
    assert e.shape_policy == "batched" and e.backend.kernels
    e.start()
    try:
        assert e.programs.state.kv[0].k.addressable_shards[0].data.shape[0] == ck.config.text.num_kv_heads // 2
        reqs = _requests(0)
        solo = concurrent_equals_solo(e, reqs)
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


@two_gpus
def test_drafted_equals_serial_on_two_gpus(monkeypatch):
    ck = _params("bfloat16")
    e = Engine(ck.params, ck.config, None, dtype="bfloat16", max_model_len=512, parallel=4, max_logprobs=2,
               progress=False, copy_drafts=True, tensor_parallel=2)
    copy_drafts_equal_serial(e, monkeypatch)
