"""The compiled programs on captures/tiny (reference path, CPU): a prompt cut at different chunk buckets gives the
same bits at grid points, a decode row's bits do not depend on its lane or its neighbours, verify + commit agree
with serial steps, nothing recompiles in steady state, and the persistent cache is used."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen_jax import model as M
from qwen_jax import programs as P
from qwen_jax import sampling
from qwen_jax.checkpoint import load_checkpoint
from tests.conftest import CAPTURES
from tests.tiny_model import tiny

BE = M.Backend()
PAGE, TABLE = 64, 8  # 512-token context
GREEDY = sampling.RequestSampling(seed=0, temperature=0.0)
SAMPLED = sampling.RequestSampling(seed=7, temperature=0.9, top_k=40)
TOL = 2e-5  # fp32 across different program shapes: rounding only (as tests/test_model_consistency.py)


@pytest.fixture(scope="module")
def progs():
    ck = load_checkpoint(CAPTURES / "tiny", dtype=jnp.float32, progress=False)
    layout = P.Layout(PAGE, TABLE, 6 * TABLE + 1, 6, "float32")
    buckets = P.Buckets(prompt_rows=(64, 128), prompt_lanes=(4,), decode_streams=(4,), window_rows=(3,),
                        packing=P.Packing.MAPPED, logprobs=4, chain_rows=(3,), slot_copy=True)
    pr = P.Programs(ck.params, ck.config, layout, buckets, BE)
    pr.compile()
    return pr


def _table(slot):
    return np.arange(1 + TABLE * (slot - 1), 1 + TABLE * slot, dtype=np.int32)


def _slot_state(pr, slot, length):
    """The slot's GDN state and conv window, and the K/V rows of its first `length` positions."""
    st = pr.state

    def rows(x):
        x = np.asarray(x[:, _table(slot)])
        return x.reshape(x.shape[0], -1, x.shape[-1])[:, :length]

    return ([np.asarray(r[slot]) for r in st.rec], [np.asarray(c[slot]) for c in st.conv],
            [rows(kv.k) for kv in st.kv] + [rows(kv.v) for kv in st.kv])


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _prefill(pr, prompt, cuts, slot, lane, neighbours, rng, rule=GREEDY):
    """Run `prompt` in chunks of `cuts` rows, in `lane` of each call among `neighbours` other prompts' chunks."""
    pos, out = 0, None
    for cut in cuts:
        n = min(cut, len(prompt) - pos)
        chunks = [P.PromptChunk(rng.integers(0, 490, size=int(rng.integers(1, 64))), 0, 5 - i, _table(5 - i))
                  for i in range(neighbours)]
        chunks.insert(lane, P.PromptChunk(prompt[pos:pos + n], pos, slot, _table(slot)))
        rules = [GREEDY] * len(chunks)
        rules[lane] = rule
        positions = [c.start + len(c.tokens) for c in chunks]
        rows = 64 if n <= 64 else 128
        out = pr.prompt(P.prompt_batch(pr.layout, 4, rows, chunks), P.sample_params(rules, positions, 4))
        pos += n
    assert pos == len(prompt)
    return (out.tokens[lane], out.logprob[lane], out.top_ids[lane], out.top_logprobs[lane]), _slot_state(
        pr, slot, len(prompt))


def test_prompt_chunk_cuts_give_identical_bits(progs):
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 490, size=300)
    ref_out, ref_state = _prefill(progs, prompt, [128, 128, 128], 1, 0, 0, rng, SAMPLED)
    for cuts, lane, neighbours in (([64] * 5, 2, 2), ([128, 64, 64, 64], 3, 3), ([64, 128, 128], 0, 1)):
        out, state = _prefill(progs, prompt, cuts, 2, lane, neighbours, rng, SAMPLED)
        assert _same(out, ref_out), (cuts, lane)
        assert _same(state, ref_state), (cuts, lane)
    # and at an intermediate grid point
    _, a = _prefill(progs, prompt[:128], [128], 1, 1, 1, rng)
    _, b = _prefill(progs, prompt[:128], [64, 64], 2, 0, 3, rng)
    assert _same(a, b)


def test_decode_row_ignores_lane_and_neighbours(progs):
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 490, size=90)
    results = []
    for slot, lane, others in ((1, 0, ()), (3, 2, (1, 4, 5)), (2, 1, (5,))):
        _prefill(progs, prompt, [128], slot, 0, 0, rng)
        streams = []
        for other in others:  # neighbours with prefixes of their own
            n = int(rng.integers(20, 60))
            _prefill(progs, rng.integers(0, 490, size=n), [64], other, 0, 0, rng)
            streams.append((int(rng.integers(0, 490)), n, other))
        streams.insert(lane, (17, 90, slot))
        window = P.decode_window(progs.layout, 4, [t for t, _, _ in streams], [c for _, c, _ in streams],
                                 [s for _, _, s in streams], [_table(s) for _, _, s in streams])
        rules = [GREEDY] * len(streams)
        rules[lane] = SAMPLED
        out = progs.decode(window, P.sample_params(rules, [c + 1 for _, c, _ in streams], 4))
        results.append(((out.tokens[lane], out.logprob[lane], out.top_logprobs[lane]),
                        _slot_state(progs, slot, 91)))
    for out, state in results[1:]:
        assert _same(out, results[0][0])
        assert _same(state, results[0][1])


def test_verify_and_commit_agree_with_serial_steps(progs):
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, 490, size=70)
    first, _ = _prefill(progs, prompt, [128], 1, 0, 0, rng)
    pending, pos, serial = int(first[0]), 70, []
    for _ in range(3):
        w = P.decode_window(progs.layout, 4, [pending], [pos], [1], [_table(1)])
        out = progs.decode(w, P.sample_params([GREEDY], [pos + 1], 4))
        serial.append((pending, int(out.tokens[0]), float(out.logprob[0])))
        pending, pos = int(out.tokens[0]), pos + 1
    serial_state = _slot_state(progs, 1, 73)
    _prefill(progs, prompt, [128], 2, 0, 0, rng)
    chain = [t for t, _, _ in serial]
    window = P.tree_window(progs.layout, 4, 3, [chain], [[-1, 0, 1]], [70], [2], [_table(2)])
    sampled, kept = progs.verify(window, P.sample_params([GREEDY] * 3, [71, 72, 73], 12))
    assert sampled.tokens[0].tolist() == [nxt for _, nxt, _ in serial]
    np.testing.assert_allclose(sampled.logprob[:3], [lp for _, _, lp in serial], atol=TOL, rtol=0)
    progs.commit(kept, window, np.array([[0, 1, 2]] + [[0, 0, 0]] * 3), np.array([3, 0, 0, 0]))
    for a, b in zip(jax.tree.leaves(_slot_state(progs, 2, 73)), jax.tree.leaves(serial_state)):
        np.testing.assert_allclose(a, b, atol=TOL, rtol=0)


def test_draft_windows_from_the_device_equal_the_host_ones(progs):
    """Chain windows whose first token and lengths come from the device (`FROM_LAST`, cache_len -1: windows
    enqueued before the previous one is fetched) give the tokens, logprobs, accepted rows and slot state of the same
    windows built on the host from each fetched result. The drafts follow a serial run of the same prompt, one of
    them wrong, so windows keep all, some or one of their rows; seeded sampling, whose draws depend on the
    positions."""
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, 490, size=70)
    (first, *_), _ = _prefill(progs, prompt, [128], 3, 0, 0, rng, SAMPLED)
    serial, pending, pos = [int(first)], int(first), 70
    for _ in range(12):  # the serial continuation: the drafts' source
        out = progs.decode(P.decode_window(progs.layout, 4, [pending], [pos], [3], [_table(3)]),
                           P.sample_params([SAMPLED], [pos + 1], 4))
        pending, pos = int(out.tokens[0]), pos + 1
        serial.append(pending)
    results = {}
    for slot, from_device in ((1, False), (2, True)):
        (tok0, *_), _ = _prefill(progs, prompt, [128], slot, 0, 0, rng, SAMPLED)
        assert int(tok0) == serial[0]
        pending, cache_len, done, got = int(tok0), 70, 0, []
        for k in range(4):
            drafts = serial[done + 1:done + 3]
            if k == 1:
                drafts = [drafts[0], (drafts[1] + 1) % 490]  # the second draft wrong: rows 0-1 stand
            row0 = P.FROM_LAST if from_device and k else pending
            cl = -1 if from_device and k else cache_len
            window = P.tree_window(progs.layout, 4, 3, [[row0] + drafts], [[-1, 0, 1]], [cl], [slot], [_table(slot)])
            sp = P.sample_params([SAMPLED] * 3, [cache_len + r + 1 for r in range(3)], 12)
            out, took, _ = progs.draft(window, sp)
            took = int(took[0])
            got.append((out.tokens[0].tolist(), out.logprob[:3].tolist(), out.top_logprobs[:3].tolist(), took))
            pending, cache_len, done = int(out.tokens[0, took - 1]), cache_len + took, done + took
        results[slot] = got, _slot_state(progs, slot, cache_len), cache_len
    assert [g[3] for g in results[1][0]] == [3, 2, 3, 3]
    assert results[1][0] == results[2][0] and results[1][2] == results[2][2] == 70 + 11
    assert _same(results[1][1], results[2][1])


def test_steady_state_never_compiles(progs):
    rng = np.random.default_rng(3)
    with P.CompileWatch() as watch:
        _prefill(progs, rng.integers(0, 490, size=150), [128, 64], 1, 1, 2, rng, SAMPLED)
        w = P.decode_window(progs.layout, 4, [5, 6], [150, 20], [1, 2], [_table(1), _table(2)])
        progs.decode(w, P.sample_params([SAMPLED, GREEDY], [151, 21], 4))
    assert (watch.traces, watch.compiles) == (0, 0)
    # A shape outside the compiled set is refused, never compiled on the fly.
    with pytest.raises(ValueError, match="not compiled"):
        progs.decode(P.decode_window(progs.layout, 2, [5], [10], [1], [_table(1)]),
                     P.sample_params([GREEDY], [11], 2))


def test_host_batches_validate():
    lay = P.Layout(PAGE, TABLE, 9, 2)
    with pytest.raises(ValueError, match="bucket holds"):
        P.prompt_batch(lay, 1, 64, [P.PromptChunk(np.zeros(65, np.int32), 0, 1, _table(1))])
    with pytest.raises(ValueError, match="do not fit"):
        P.decode_window(lay, 1, [1, 2], [3, 4], [1, 1], [_table(1)] * 2)
    with pytest.raises(ValueError, match="multiples of 64"):
        P.Buckets(prompt_rows=(100,), prompt_lanes=(1,), decode_streams=(1,))
    with pytest.raises(ValueError, match="dtype"):
        P.Layout(PAGE, TABLE, 9, 2, dtype="float16")
    parents = np.array([[-1, 0, 0, 2, -1], [-1, 0, 1, 2, 3]], np.int32)
    np.testing.assert_array_equal(P.window_depth_host(parents), np.asarray(M.window_depth(jnp.asarray(parents))))
    assert P.Buckets((64, 256), (1, 4), (1, 16)).prompt_bucket(3, 65) == (4, 256)
    limited = P.Buckets((64, 128, 256), (1, 4), (1,), multi_lane_rows=128)
    assert limited.prompt_shapes == ((1, 64), (1, 128), (4, 64), (1, 256), (4, 128))
    with pytest.raises(ValueError, match="no prompt bucket"):
        limited.prompt_bucket(2, 200)


def test_persistent_compilation_cache(tmp_path):
    cfg, params = tiny()
    lay = P.Layout(PAGE, 2, 3, 2, "float32")
    buckets = P.Buckets((64,), (1,), (1,))
    try:
        P.enable_compilation_cache(str(tmp_path))
        first, second = P.Programs(params, cfg, lay, buckets, BE), P.Programs(params, cfg, lay, buckets, BE)
        with P.CompileWatch() as cold:
            first.compile([("decode", (1, 1))])
        assert (cold.compiles, cold.cache_hits) == (1, 0)
        assert any(tmp_path.iterdir())
        with P.CompileWatch() as warm:
            second.compile([("decode", (1, 1))])
        assert (warm.compiles, warm.cache_hits) == (1, 1)
    finally:
        P.enable_compilation_cache(None)


def pool_copies(pr) -> dict:
    """Copies of a whole state pool inside each compiled program (0 = the donated pools are updated in place)."""
    return {key: len(lines) for key, lines in pr.pool_copies().items()}


def test_slot_copy(progs):
    """`slot_copy` sets one slot's GDN states and conv windows to another's, leaving every other slot and the K/V
    pools as they were."""
    import dataclasses

    import jax

    def by_slot(x):  # a different value in every slot
        return x + jnp.arange(x.shape[0], dtype=x.dtype).reshape((-1,) + (1,) * (x.ndim - 1))

    saved = progs.state
    progs.state = dataclasses.replace(jax.tree.map(jnp.copy, saved), rec=tuple(map(by_slot, saved.rec)),
                                      conv=tuple(map(by_slot, saved.conv)))
    bumped = jax.tree.map(np.asarray, progs.state)
    progs.slot_copy(2, 5)
    after = jax.tree.map(np.asarray, progs.state)
    for b, a in zip(bumped.rec + bumped.conv, after.rec + after.conv):
        assert not np.array_equal(b[5], b[2])
        assert np.array_equal(a[5], b[2]) and np.array_equal(np.delete(a, 5, 0), np.delete(b, 5, 0))
    for b, a in zip(jax.tree.leaves(bumped.kv), jax.tree.leaves(after.kv)):
        assert np.array_equal(a, b)
    progs.state = saved


def test_decode_programs_have_no_device_branch(progs):
    """The decode variants fix their sampling path when tracing ("decode" plain, "decode_sorted" sorted), so
    neither holds a conditional, whose predicate the GPU host would have to read back mid-program (that would
    stall the engine, which dispatches the next call before fetching this one)."""
    assert set(P.DECODE_KINDS) == {"decode", "decode_sorted"} and set(P.DECODE_KINDS) <= {k[0] for k in progs._exe}
    for key, exe in progs._exe.items():
        if key[0] in P.DECODE_KINDS:
            assert " conditional(" not in exe.as_text(), key


def test_pools_are_updated_in_place(progs):
    copies = pool_copies(progs)
    assert set(copies) >= {("prompt", (4, 64)), ("decode", (4, 1)), ("draft", (4, 3)), ("commit", (4, 3)),
                           ("slot_copy", (1, 1))}
    assert all(n == 0 for n in copies.values()), copies
