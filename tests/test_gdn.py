"""Gated DeltaNet kernels (pallas_kernels/gdn.py): the chunked prompt pass, the tree/chain verify window, the
commit and the serial decode step, against the plain-jnp references and a float64 numpy recurrence, plus the
exactness properties the engine relies on (bitwise): window node == commit of its ancestors + one-row window;
commit == serial one-row commits; step == one-row window + its commit, so serial steps == a drafted chain window +
its commit; a stream alone == the same stream among others; a prompt resumed at a grid point == one fresh pass.

CPU tests run the kernels in interpret mode at small shapes (Hk=2, Hv=4, dk=16, dv=32). The `gpu` tests run the
same checks on the device at the 27B's head shape (Hk=16, Hv=48, dk=dv=128)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gdn, qmm_mgpu

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
SMALL = dict(hk=2, hv=4, dk=16, dv=32)
BIG = dict(hk=16, hv=48, dk=128, dv=128)

# Relative error (‖x - ref‖ / ‖ref‖) bounds. Interpret mode computes every product in fp32; on the GPU the
# prompt pass runs its fp32 products as tf32x3 (about fp32) and the window/commit are fp32 FMAs throughout.
F32_TOL = 2e-5
BF16_OUT_TOL = 4e-3  # outputs rounded to bf16 (2^-9 relative per element)
TF32_TOL = 2e-3  # the prompt pass with PromptTiles(precision="tf32"): one tf32 pass (10-bit operands) per product
# PromptTiles(precision="bf16"): both operands of a product rounded to bf16 (u = 2^-9 each, so up to ~2u per
# product) and the output once more: about 4u. Measured 3.1e-3 (state) / 3.7e-3 (o) on the small shape.
BF16_PRODUCTS_TOL = 8e-3


def _prompt_tol(tiles: gdn.PromptTiles) -> float:
    """The prompt pass's bound for its precision setting (interpret mode computes fp32 whatever the setting)."""
    return TF32_TOL if ON_GPU and tiles.precision == "tf32" else F32_TOL


def _jit(fn, **kw):
    return jax.jit(functools.partial(fn, interpret=INTERPRET, **kw))


prompt_k = _jit(gdn.prompt)
window_k = _jit(gdn.window)
leaves_k = _jit(gdn.window, leaves=True)
commit_k = _jit(gdn.commit)
step_k = _jit(gdn.step)
prompt_ref = jax.jit(gdn.prompt_reference)
window_ref = jax.jit(gdn.window_reference)
commit_ref = jax.jit(gdn.commit_reference)
step_ref = jax.jit(gdn.step_reference)


def _rel(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    assert not np.isnan(x).any(), "NaN in kernel output"
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def _rows(rng, s, t, hk, hv, dk, dv, dtype=jnp.float32):
    """Random q, k (l2-normed, q scaled), v, g <= 0, beta in (0, 1), as the model produces them."""
    def l2n(x):
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
    q = l2n(rng.normal(size=(s, t, hk, dk))) * dk ** -0.5
    k = l2n(rng.normal(size=(s, t, hk, dk)))
    v = rng.normal(size=(s, t, hv, dv))
    g = -rng.uniform(0.005, 0.3, size=(s, t, hv))
    beta = rng.uniform(0.05, 0.95, size=(s, t, hv))
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(g, jnp.float32),
            jnp.asarray(beta, jnp.float32))


def _pool(rng, n, hv, dk, dv):
    return jnp.asarray(rng.normal(size=(n, hv, dk, dv)) * 0.5, jnp.float32)


def _f64_steps(state, q, k, v, g, beta, order):
    """The recurrence one row at a time in float64. state [Hv, dk, dv]; rows [R, ...] of one stream; order: row
    indices to apply. -> (outputs [len(order), Hv, dv], final state)."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    hv = v.shape[1]
    rep = hv // k.shape[1]
    q, k = np.repeat(q, rep, axis=1), np.repeat(k, rep, axis=1)
    st = np.array(state, np.float64)
    outs = []
    for i in order:
        st = st * np.exp(g[i])[:, None, None]
        delta = beta[i][:, None] * (v[i] - np.einsum("hkv,hk->hv", st, k[i]))
        st = st + k[i][:, :, None] * delta[:, None, :]
        outs.append(np.einsum("hkv,hk->hv", st, q[i]))
    return np.stack(outs) if outs else np.zeros((0,) + v.shape[1:]), st


# ------------------------------------------------------------------------------------------------------------
# Prompt pass
# ------------------------------------------------------------------------------------------------------------

def _prompt_case(rng, t, shape, dtype=jnp.float32, starts=(0, 128, 37), lengths=None):
    """Streams in one call, by default three: a fresh prompt whose slot holds NaN (start 0 must ignore it), one
    resumed on the grid with a non-zero state, one resumed off the grid and shorter than T."""
    hk, hv, dk, dv = shape["hk"], shape["hv"], shape["dk"], shape["dv"]
    n = len(starts)
    lengths = lengths or (t, t, max(t - 5, 1))
    q, k, v, g, beta = _rows(rng, n, t, hk, hv, dk, dv, dtype)
    pool = _pool(rng, n + 3, hv, dk, dv)
    slot = jnp.asarray(rng.permutation(n + 3)[:n], jnp.int32)
    pool = pool.at[slot[0]].set(jnp.nan)
    return (q, k, v, g, beta, pool, slot, jnp.asarray(starts, jnp.int32), jnp.asarray(lengths, jnp.int32))


def _check_prompt_vs_f64(args, o, pool_out, tol, state_tol=F32_TOL):
    q, k, v, g, beta, pool, slot, start, lengths = args
    for s in range(q.shape[0]):
        n = int(lengths[s])
        init = np.zeros(pool.shape[1:]) if int(start[s]) == 0 else np.asarray(pool[int(slot[s])])
        ref_o, ref_state = _f64_steps(init, q[s], k[s], v[s], g[s], beta[s], range(n))
        assert _rel(o[s, :n], ref_o) < tol, f"stream {s}: outputs off"
        assert _rel(pool_out[int(slot[s])], ref_state) < state_tol, f"stream {s}: final state off"
        assert np.all(np.asarray(o[s, n:], np.float32) == 0), f"stream {s}: rows past length must read as zeros"
    untouched = sorted(set(range(pool.shape[0])) - {int(x) for x in slot})
    assert np.array_equal(np.asarray(pool_out)[untouched], np.asarray(pool)[untouched]), "other slots changed"


@pytest.mark.parametrize("t", [1, 63, 64, 65, 300])
def test_prompt_matches_float64_recurrence_and_reference(t):
    rng = np.random.default_rng(t)
    args = _prompt_case(rng, t, SMALL)
    o, pool_out = prompt_k(*args)
    _check_prompt_vs_f64(args, o, pool_out, F32_TOL)
    ro, rpool = prompt_ref(*args)
    assert _rel(o, ro) < F32_TOL
    assert _rel(pool_out[args[6]], rpool[args[6]]) < F32_TOL


def test_prompt_bf16_inputs_and_bf16_chunk_store():
    """bf16 q/k/v (as the model sends them), once with the default fp32 chunk states and once with them stored
    in bf16: the output takes that rounding, the recurrence (final state) does not."""
    rng = np.random.default_rng(7)
    args = _prompt_case(rng, 130, SMALL, jnp.bfloat16)
    for tiles in (gdn.PromptTiles(), gdn.PromptTiles(store_dtype="bfloat16")):
        o, pool_out = jax.jit(functools.partial(gdn.prompt, interpret=INTERPRET, tiles=tiles))(*args)
        assert o.dtype == jnp.bfloat16
        _check_prompt_vs_f64(args, o, pool_out, BF16_OUT_TOL)


def test_prompt_bf16_products():
    """precision='bf16' (flash-linear-attention's precision: products on bf16 operands, W and U stored in bf16):
    outputs and final state within the bound of its roundings; the float32 chunk store changes nothing, since the
    products round what the store would have kept."""
    rng = np.random.default_rng(7)
    args = _prompt_case(rng, 130, SMALL, jnp.bfloat16)
    outs = []
    for tiles in (gdn.PromptTiles(precision="bf16", store_dtype="bfloat16"), gdn.PromptTiles(precision="bf16"),
                  gdn.PromptTiles(precision="bf16", store_dtype="bfloat16", transposed=True),
                  gdn.PromptTiles(precision="bf16", store_dtype="bfloat16", transposed=True, fused_output=True),
                  gdn.prompt_tiles(jnp.bfloat16)):
        o, pool_out = jax.jit(functools.partial(gdn.prompt, interpret=INTERPRET, tiles=tiles))(*args)
        _check_prompt_vs_f64(args, o, pool_out, BF16_PRODUCTS_TOL, BF16_PRODUCTS_TOL)
        outs.append((np.asarray(o), np.asarray(pool_out)))
    assert all(np.array_equal(a, b) for a, b in zip(outs[0], outs[1]))


@pytest.mark.parametrize("fused", [False, True], ids=["transposed", "fused-output"])
def test_prompt_transposed_state_pass(fused):
    """PromptTiles(transposed=True) (the state pass on S^T, U / chunk states / V' stored transposed), and with
    fused_output (the state pass writes the outputs, rows past a stream's last chunk as zeros): fp32 products in
    interpret mode, so the float64 bound of the default tiles; and the exactness properties."""
    tiles = gdn.PromptTiles(transposed=True, fused_output=fused)
    rng = np.random.default_rng(65)
    for t in (65, 130):  # 130: the shorter, off-grid stream ends chunks before the call's last row
        args = _prompt_case(rng, t, SMALL)
        o, pool_out = _jit(gdn.prompt, tiles=tiles)(*args)
        _check_prompt_vs_f64(args, o, pool_out, F32_TOL)
    _resume_check(SMALL, 200, [64, 128], tiles)
    _alone_vs_batched(SMALL, tiles)


def _split_prep_same_bits(shape, dtype, tiles_list, t=130, seed=66):
    """Each tiles with split_prep on gives the bits it gives off (prompt outputs and final state)."""
    rng = np.random.default_rng(seed)
    args = _prompt_case(rng, t, shape, dtype)
    for tiles in tiles_list:
        outs = [jax.jit(functools.partial(gdn.prompt, interpret=INTERPRET,
                                          tiles=dataclasses.replace(tiles, split_prep=split)))(*args)
                for split in (False, True)]
        for a, b in zip(*outs):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8),
                                          err_msg=f"{tiles}: split_prep changed the bits")


def test_prompt_split_prep_same_bits():
    """PromptTiles.split_prep (the prep pass as an inverse launch and a W / U [/ P] launch) computes the same values
    with the same products as the one-launch prep: outputs and final states bit for bit, fp32 and bf16 products,
    with and without the fused output pass, streams resumed on and off the grid."""
    _split_prep_same_bits(SMALL, jnp.float32, (gdn.PromptTiles(), gdn.PromptTiles(transposed=True, fused_output=True)))
    _split_prep_same_bits(SMALL, jnp.bfloat16, (gdn.PromptTiles(precision="bf16", store_dtype="bfloat16"),
                                                gdn.prompt_tiles(jnp.bfloat16)))


def test_prompt_fused_output_needs_transposed():
    rng = np.random.default_rng(3)
    args = _prompt_case(rng, 8, SMALL)
    with pytest.raises(ValueError, match="fused_output"):
        gdn.prompt(*args, interpret=True, tiles=gdn.PromptTiles(fused_output=True))


def _resume_check(shape, t, cuts, tiles=gdn.PromptTiles()):
    rng = np.random.default_rng(11)
    q, k, v, g, beta = _rows(rng, 1, t, shape["hk"], shape["hv"], shape["dk"], shape["dv"])
    pool = _pool(rng, 2, shape["hv"], shape["dk"], shape["dv"])
    slot = jnp.array([1], jnp.int32)
    run = _jit(gdn.prompt, tiles=tiles)
    fresh_o, fresh_pool = run(q, k, v, g, beta, pool, slot, jnp.array([0]), jnp.array([t]))
    pieces, cur = [], pool
    for a, b in zip([0, *cuts], [*cuts, t]):
        sl = slice(a, b)
        o, cur = run(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], cur, slot, jnp.array([a]),
                          jnp.array([b - a]))
        pieces.append(np.asarray(o))
    assert np.array_equal(np.concatenate(pieces, axis=1), np.asarray(fresh_o)), "resumed outputs differ"
    assert np.array_equal(np.asarray(cur), np.asarray(fresh_pool)), "resumed state differs"


def test_prompt_resumed_at_grid_points_is_bitwise_fresh():
    _resume_check(SMALL, 200, [64, 128])


def _alone_vs_batched(shape, tiles=gdn.PromptTiles()):
    """Stream 1 of a 3-stream call padded to T=160 vs the same stream alone with T = its length."""
    rng = np.random.default_rng(5)
    hk, hv, dk, dv = shape["hk"], shape["hv"], shape["dk"], shape["dv"]
    q, k, v, g, beta = _rows(rng, 3, 160, hk, hv, dk, dv)
    pool = _pool(rng, 4, hv, dk, dv)
    slot = jnp.array([0, 2, 3], jnp.int32)
    start = jnp.array([0, 37, 64], jnp.int32)
    lengths = jnp.array([160, 90, 17], jnp.int32)
    run = _jit(gdn.prompt, tiles=tiles)
    o, pool_all = run(q, k, v, g, beta, pool, slot, start, lengths)
    one = lambda x: x[1:2, :90]
    o1, pool_one = run(one(q), one(k), one(v), one(g), one(beta), pool, slot[1:2], start[1:2], lengths[1:2])
    assert np.array_equal(np.asarray(o[1:2, :90]), np.asarray(o1))
    assert np.array_equal(np.asarray(pool_all[2]), np.asarray(pool_one[2]))
    return o, pool_all


def test_prompt_stream_alone_equals_stream_among_others_bitwise():
    _alone_vs_batched(SMALL)


# ------------------------------------------------------------------------------------------------------------
# Verify window and commit
# ------------------------------------------------------------------------------------------------------------

TREES = {  # parents of 8 window rows; -1 = the committed state
    "chain": [-1, 0, 1, 2, 3, 4, 5, 6],
    "fan": [-1, -1, -1, -1, -1, -1, -1, -1],
    "fork": [-1, 0, 1, 1, 2, 3, 0, 6],
    "deep": [-1, 0, 1, 2, 0, 4, 5, 3],
}


def _path_to(parents, r):
    path = []
    while r >= 0:
        path.append(r)
        r = parents[r]
    return path[::-1]


def _window_case(rng, shape, dtype=jnp.float32, trees=TREES):
    names = list(trees)
    s, r = len(names), len(trees[names[0]])
    rows = _rows(rng, s, r, shape["hk"], shape["hv"], shape["dk"], shape["dv"], dtype)
    pool = _pool(rng, s + 2, shape["hv"], shape["dk"], shape["dv"])
    slot = jnp.asarray(rng.permutation(s + 2)[:s], jnp.int32)
    parents = jnp.asarray([trees[n] for n in names], jnp.int32)
    return names, rows, parents, pool, slot


def _check_window(shape):
    rng = np.random.default_rng(3)
    names, (q, k, v, g, beta), parents, pool, slot = _window_case(rng, shape)
    o = np.asarray(window_k(q, k, v, g, beta, parents, pool, slot))
    assert _rel(o, window_ref(q, k, v, g, beta, parents, pool, slot)) < F32_TOL
    for s, name in enumerate(names):
        par = [int(p) for p in parents[s]]
        for r in range(par.__len__()):
            path = _path_to(par, r)
            ref_o, _ = _f64_steps(pool[int(slot[s])], q[s], k[s], v[s], g[s], beta[s], path)
            assert _rel(o[s, r], ref_o[-1]) < F32_TOL, f"{name} node {r}"
    # Every node == commit of its ancestors, then a one-row window on the committed state, bit for bit.
    r_max = parents.shape[1]
    for r in range(r_max):
        paths = [_path_to([int(p) for p in parents[s]], r) for s in range(len(names))]
        anc = jnp.asarray([p[:-1] + [0] * (r_max - len(p) + 1) for p in paths], jnp.int32)
        anc_len = jnp.asarray([len(p) - 1 for p in paths], jnp.int32)
        committed = commit_k(k, v, g, beta, anc, anc_len, pool, slot)
        one = lambda x: x[:, r:r + 1]
        o1 = window_k(one(q), one(k), one(v), one(g), one(beta), jnp.full((len(names), 1), -1, jnp.int32),
                      committed, slot)
        assert np.array_equal(np.asarray(o1)[:, 0], o[:, r]), f"node {r}: window != commit + one-row window"
    return o


def test_window_trees_match_serial_recurrence():
    _check_window(SMALL)


# best-first trees as the tree builder makes them (a node's children after it, siblings interleaved with other
# nodes' children), and one padded with rows off the committed state
LEAF_TREES = {
    "best_first": [-1, 0, 0, 1, 2, 3, 1, 4],
    "spine": [-1, 0, 1, 2, 1, 3, 4, 2],
    "padded": [-1, 0, 0, 1, -1, -1, -1, -1],
    "chain": [-1, 0, 1, 2, 3, 4, 5, 6],
}


def _check_leaves(shape, dtype, trees):
    """`window(leaves=True)` (each leaf's path its own step list, side by side) gives `window`'s bits (each node in
    turn, replaying paths), for every stream, alone and among the others."""
    rng = np.random.default_rng(5)
    names, rows, parents, pool, slot = _window_case(rng, shape, dtype, trees)
    o = np.asarray(window_k(*rows, parents, pool, slot))
    assert np.array_equal(np.asarray(leaves_k(*rows, parents, pool, slot)), o)
    for s in range(len(names)):
        one = lambda x: x[s:s + 1]  # noqa: E731
        assert np.array_equal(np.asarray(leaves_k(*map(one, rows), one(parents), pool, one(slot)))[0], o[s]), names[s]


def test_window_leaf_lists_equal_node_order_bitwise():
    _check_leaves(SMALL, jnp.bfloat16, {**TREES, **LEAF_TREES})


def test_leaf_steps_schedule():
    """Each leaf's list replays its path from the committed state and emits the rows whose first leaf it is; other
    lists are empty; every row is emitted once."""
    parents = jnp.asarray([LEAF_TREES["best_first"], TREES["chain"], TREES["fan"]], jnp.int32)
    steps, n = gdn._leaf_steps(parents)
    steps, n = np.asarray(steps).reshape(3, 8, 10), np.asarray(n).reshape(3, 8)
    row, emit, restart = steps % gdn._EMIT, (steps // gdn._EMIT) % 2, (steps // gdn._RESTART) % 2
    # best_first: leaves 5 (path 0 1 3 5), 6 (0 1 6), 7 (0 2 4 7)
    assert n[0].tolist() == [0, 0, 0, 0, 0, 4, 3, 4]
    assert row[0, 5, :4].tolist() == [0, 1, 3, 5] and emit[0, 5, :4].tolist() == [1, 1, 1, 1]
    assert row[0, 6, :3].tolist() == [0, 1, 6] and emit[0, 6, :3].tolist() == [0, 0, 1]
    assert row[0, 7, :4].tolist() == [0, 2, 4, 7] and emit[0, 7, :4].tolist() == [0, 1, 1, 1]
    assert n[1].tolist() == [0] * 7 + [8] and row[1, 7, :8].tolist() == list(range(8)) and emit[1, 7, :8].all()
    assert n[2].tolist() == [1] * 8 and row[2, :, 0].tolist() == list(range(8)) and emit[2, :, 0].all()
    for t in range(3):
        assert restart[t, :, 0][n[t] > 0].all() and not restart[t, :, 1:].any()
        emitted = sorted(int(row[t, i, j]) for i in range(8) for j in range(n[t, i]) if emit[t, i, j])
        assert emitted == list(range(8))


def _check_commit(shape):
    rng = np.random.default_rng(9)
    names, (q, k, v, g, beta), parents, pool, slot = _window_case(rng, shape)
    s_count, r_max = parents.shape
    # accepted paths: root-to-leaf paths of each tree, one stream accepting nothing
    paths = [_path_to([int(p) for p in parents[s]], r_max - 1) for s in range(s_count)]
    paths[1] = []
    path = jnp.asarray([p + [0] * (r_max - len(p)) for p in paths], jnp.int32)
    path_len = jnp.asarray([len(p) for p in paths], jnp.int32)
    out = np.asarray(commit_k(k, v, g, beta, path, path_len, pool, slot))
    assert _rel(out[slot], commit_ref(k, v, g, beta, path, path_len, pool, slot)[slot]) < F32_TOL
    for s in range(s_count):
        _, ref_state = _f64_steps(pool[int(slot[s])], q[s], k[s], v[s], g[s], beta[s], paths[s])
        if paths[s]:
            assert _rel(out[int(slot[s])], ref_state) < F32_TOL
        else:
            assert np.array_equal(out[int(slot[s])], np.asarray(pool[int(slot[s])]))
    untouched = sorted(set(range(pool.shape[0])) - {int(x) for x in slot})
    assert np.array_equal(out[untouched], np.asarray(pool)[untouched])
    # == one-row commits in sequence, bit for bit
    cur = pool
    for i in range(max(len(p) for p in paths)):
        node = jnp.asarray([p[i] if i < len(p) else 0 for p in paths], jnp.int32)
        pick = lambda x: jnp.take_along_axis(x, node.reshape((-1, 1) + (1,) * (x.ndim - 2)), axis=1)
        cur = commit_k(pick(k), pick(v), pick(g), pick(beta), jnp.zeros((s_count, 1), jnp.int32),
                       jnp.asarray([int(i < len(p)) for p in paths], jnp.int32), cur, slot)
    assert np.array_equal(np.asarray(cur), out)


def test_commit_equals_serial_steps_over_accepted_path():
    _check_commit(SMALL)


def _check_window_alone_vs_among_others(case) -> None:
    """Each stream's window rows are bit-identical whether it runs alone or among the case's other streams."""
    names, (q, k, v, g, beta), parents, pool, slot = case
    o = window_k(q, k, v, g, beta, parents, pool, slot)
    for s in range(len(names)):
        one = lambda x: x[s:s + 1]
        o1 = window_k(one(q), one(k), one(v), one(g), one(beta), one(parents), pool, one(slot))
        assert np.array_equal(np.asarray(o1[0]), np.asarray(o[s]))
    assert _rel(o, window_ref(q, k, v, g, beta, parents, pool, slot)) < BF16_OUT_TOL


def test_window_stream_alone_equals_stream_among_others_bitwise():
    _check_window_alone_vs_among_others(_window_case(np.random.default_rng(4), SMALL, jnp.bfloat16))


# ------------------------------------------------------------------------------------------------------------
# Serial decode step
# ------------------------------------------------------------------------------------------------------------

def _step_case(rng, shape, streams, rows, dtype):
    """`rows` serial rows for each of `streams` streams, pool with two spare slots, slots shuffled."""
    q, k, v, g, beta = _rows(rng, streams, rows, shape["hk"], shape["hv"], shape["dk"], shape["dv"], dtype)
    pool = _pool(rng, streams + 2, shape["hv"], shape["dk"], shape["dv"])
    slot = jnp.asarray(rng.permutation(streams + 2)[:streams], jnp.int32)
    return (q, k, v, g, beta), pool, slot


def _check_step(shape, streams, dtype, seed=21, serial_rows=3):
    """step == one-row window + commit of that row (bitwise, output and whole pool); `serial_rows` steps in a row
    == a chain window over those rows + commit of the whole chain (bitwise); each stream alone == among the others
    (bitwise); vs the float64 recurrence and the reference; slots of no stream untouched."""
    rng = np.random.default_rng(seed + streams)
    (q, k, v, g, beta), pool, slot = _step_case(rng, shape, streams, serial_rows, dtype)
    tol = BF16_OUT_TOL if dtype == jnp.bfloat16 else F32_TOL
    root = jnp.full((streams, 1), -1, jnp.int32)
    one_path, one_len = jnp.zeros((streams, 1), jnp.int32), jnp.ones((streams,), jnp.int32)
    cur, outs = pool, []
    for t in range(serial_rows):
        row = tuple(x[:, t:t + 1] for x in (q, k, v, g, beta))
        _poison_allocator(row[2].shape, row[2].dtype)
        o, nxt = step_k(*row, cur, slot)
        o_window = window_k(*row, root, cur, slot)
        pool_commit = commit_k(*row[1:], one_path, one_len, cur, slot)
        assert np.array_equal(np.asarray(o), np.asarray(o_window)), f"row {t}: step output != one-row window"
        assert np.array_equal(np.asarray(nxt), np.asarray(pool_commit)), f"row {t}: step state != one-row commit"
        ref_o, ref_pool = step_ref(*row, cur, slot)
        assert _rel(o, ref_o) < tol
        assert _rel(nxt[slot], ref_pool[slot]) < F32_TOL
        for s in range(streams):
            alone = tuple(x[s:s + 1] for x in row)
            o1, pool1 = step_k(*alone, cur, slot[s:s + 1])
            assert np.array_equal(np.asarray(o1[0]), np.asarray(o[s])), f"row {t} stream {s}: alone != among"
            assert np.array_equal(np.asarray(pool1[int(slot[s])]), np.asarray(nxt[int(slot[s])]))
        outs.append(np.asarray(o))
        cur = nxt
    untouched = sorted(set(range(pool.shape[0])) - {int(x) for x in slot})
    assert np.array_equal(np.asarray(cur)[untouched], np.asarray(pool)[untouched]), "other slots changed"
    chain = jnp.broadcast_to(jnp.arange(serial_rows, dtype=jnp.int32) - 1, (streams, serial_rows))
    o_chain = window_k(q, k, v, g, beta, chain, pool, slot)
    assert np.array_equal(np.concatenate(outs, axis=1), np.asarray(o_chain)), "serial steps != chain window"
    pool_chain = commit_k(k, v, g, beta, chain + 1, jnp.full((streams,), serial_rows, jnp.int32), pool, slot)
    assert np.array_equal(np.asarray(cur), np.asarray(pool_chain)), "serial steps != commit of the chain"
    for s in range(streams):
        ref_o, ref_state = _f64_steps(pool[int(slot[s])], q[s], k[s], v[s], g[s], beta[s], range(serial_rows))
        assert _rel(np.concatenate(outs, axis=1)[s], ref_o) < tol, f"stream {s}: outputs off"
        assert _rel(np.asarray(cur)[int(slot[s])], ref_state) < F32_TOL, f"stream {s}: state off"


@pytest.mark.parametrize("streams", [1, 3, 16])
def test_step_equals_window_then_commit_bitwise(streams):
    _check_step(SMALL, streams, jnp.float32)


def test_step_bf16_rows_and_other_tiles():
    _check_step(SMALL, 3, jnp.bfloat16)
    _step_equals_window_commit(np.random.default_rng(30), SMALL, 2, gdn.WindowTiles(block_v=32, num_warps=2))


def _step_equals_window_commit(rng, shape, streams: int, tiles):
    """With explicit tiles, step == one-row window + commit of the row, bit for bit. -> the inputs and outputs."""
    (q, k, v, g, beta), pool, slot = _step_case(rng, shape, streams, 1, jnp.bfloat16)
    run = lambda fn: _jit(fn, tiles=tiles)
    o, new = run(gdn.step)(q, k, v, g, beta, pool, slot)
    o_w = run(gdn.window)(q, k, v, g, beta, jnp.full((streams, 1), -1, jnp.int32), pool, slot)
    new_c = run(gdn.commit)(k, v, g, beta, jnp.zeros((streams, 1), jnp.int32), jnp.ones((streams,), jnp.int32),
                            pool, slot)
    assert np.array_equal(np.asarray(o), np.asarray(o_w))
    assert np.array_equal(np.asarray(new), np.asarray(new_c))
    return (q, k, v, g, beta), pool, slot, o, new


def _check_step_norm(shape, streams: int, out_rows: int, dtype, tiles=gdn.WindowTiles()):
    """`gdn.step_norm` == `gdn.step` then `rownorm.gated_rms_norm(o, z, w, eps, out_rows=out_rows Hv)`, bit for bit
    (the padding rows too), the pool `step`'s, the counters zero again, and the same from a second call chained
    through them."""
    from pallas_kernels import rownorm
    rng = np.random.default_rng(40 + streams)
    (q, k, v, g, beta), pool, slot = _step_case(rng, shape, streams, 1, dtype)
    z = jnp.asarray(rng.normal(size=v.shape), dtype)
    w = jnp.asarray(rng.normal(size=shape["dv"]), jnp.float32)
    count = jnp.zeros((streams * shape["hv"] + 3,), jnp.int32)
    fused = jax.jit(functools.partial(gdn.step_norm, eps=1e-6, out_rows=out_rows, interpret=INTERPRET, tiles=tiles))
    o, new = _jit(gdn.step, tiles=tiles)(q, k, v, g, beta, pool, slot)
    norm = jax.jit(functools.partial(rownorm.gated_rms_norm, eps=1e-6, interpret=INTERPRET,
                                     out_rows=out_rows * shape["hv"]))
    for _ in range(2):
        y, new_f, count = fused(q, k, v, g, beta, pool, slot, z, w, count)
        assert np.array_equal(np.asarray(new_f), np.asarray(new))
        assert np.array_equal(np.asarray(y).view(np.uint16 if dtype == jnp.bfloat16 else np.uint32),
                              np.asarray(norm(o, z, w)).view(np.uint16 if dtype == jnp.bfloat16 else np.uint32))
        assert not np.any(np.asarray(count))


@pytest.mark.parametrize("streams,out_rows,dtype", [(1, 8, jnp.bfloat16), (3, 8, jnp.bfloat16), (2, 2, jnp.float32)])
def test_step_norm_is_step_then_gated_norm_bitwise(streams, out_rows, dtype):
    _check_step_norm(dict(hk=2, hv=4, dk=32, dv=128), streams, out_rows, dtype)


def test_step_norm_rejects_bad_inputs():
    rng = np.random.default_rng(50)
    (q, k, v, g, beta), pool, slot = _step_case(rng, SMALL, 2, 1, jnp.bfloat16)
    w, count = jnp.ones(SMALL["dv"]), jnp.zeros((8,), jnp.int32)
    with pytest.raises(ValueError, match="count"):
        gdn.step_norm(q, k, v, g, beta, pool, slot, v, w, count[:7], eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="z like v"):
        gdn.step_norm(q, k, v, g, beta, pool, slot, v[..., :16], w, count, eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="out_rows"):
        gdn.step_norm(q, k, v, g, beta, pool, slot, v, w, count, eps=1e-6, out_rows=1, interpret=True)
    assert not gdn.step_norm_supports(128, gdn.WindowTiles(num_warps=2))


def test_step_norm_lowers_for_h200(h200_lowering):
    sds = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    text = jax.jit(functools.partial(gdn.step_norm, eps=1e-6, out_rows=8)).trace(
        sds((1, 1, 16, 128), bf), sds((1, 1, 16, 128), bf), sds((1, 1, 48, 128), bf), sds((1, 1, 48), jnp.float32),
        sds((1, 1, 48), jnp.float32), sds((4, 48, 128, 128), jnp.float32), sds((1,), jnp.int32),
        sds((1, 1, 48, 128), bf), sds((128,), jnp.float32), sds((48,), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1


def test_step_reference_equals_window_and_commit_references_bitwise():
    """The references are what the engine runs without kernels (CPU): the same property must hold there."""
    rng = np.random.default_rng(31)
    (q, k, v, g, beta), pool, slot = _step_case(rng, SMALL, 3, 1, jnp.bfloat16)
    o, new = step_ref(q, k, v, g, beta, pool, slot)
    o_w = window_ref(q, k, v, g, beta, jnp.full((3, 1), -1, jnp.int32), pool, slot)
    new_c = commit_ref(k, v, g, beta, jnp.zeros((3, 1), jnp.int32), jnp.ones((3,), jnp.int32), pool, slot)
    assert np.array_equal(np.asarray(o), np.asarray(o_w))
    assert np.array_equal(np.asarray(new), np.asarray(new_c))


# ------------------------------------------------------------------------------------------------------------
# Conv (plain jnp entry points)
# ------------------------------------------------------------------------------------------------------------

def test_conv_window_node_equals_commit_then_one_row_and_float64():
    rng = np.random.default_rng(2)
    s_count, r_max, c, kw = 4, 8, 24, 4
    parents = jnp.asarray([TREES[n] for n in TREES], jnp.int32)
    m = jnp.asarray(rng.normal(size=(s_count, r_max, c)), jnp.float32)
    pool = jnp.asarray(rng.normal(size=(s_count + 1, kw - 1, c)), jnp.float32)
    weight = jnp.asarray(rng.normal(size=(c, kw)), jnp.float32)
    slot = jnp.asarray([3, 0, 4, 1], jnp.int32)
    u = np.asarray(gdn.conv_window(m, parents, pool, slot, weight))
    for r in range(r_max):
        paths = [_path_to([int(p) for p in parents[s]], r) for s in range(s_count)]
        for s in range(s_count):  # float64: silu(sum of taps over history + path)
            seq = np.concatenate([np.asarray(pool[int(slot[s])], np.float64), np.asarray(m[s])[paths[s]]])
            acc = (seq[-kw:] * np.asarray(weight, np.float64).T).sum(0)
            np.testing.assert_allclose(u[s, r], acc / (1 + np.exp(-acc)), rtol=1e-5, atol=1e-6)
        anc = jnp.asarray([p[:-1] + [0] * (r_max - len(p) + 1) for p in paths], jnp.int32)
        committed = gdn.conv_commit(m, anc, jnp.asarray([len(p) - 1 for p in paths]), pool, slot)
        u1 = gdn.conv_window(m[:, r:r + 1], jnp.full((s_count, 1), -1, jnp.int32), committed, slot, weight)
        assert np.array_equal(np.asarray(u1)[:, 0], u[:, r])


def test_conv_prompt_float64_and_cut_anywhere_bitwise():
    """The prompt conv against float64, and a prompt cut into pieces (history carried in the pool; pieces of 1 and 2
    rows, shorter than the history) gives the bits of the whole, for streams of different lengths in one call."""
    _conv_prompt_check(19, 300, ((0, 7), (7, 8), (8, 10), (10, 19)))


@pytest.mark.gpu
def test_gpu_conv_prompt_27b_width():
    _conv_prompt_check(300, 10240, ((0, 64), (64, 65), (65, 300)))


def _conv_prompt_check(t, c, cuts):
    rng = np.random.default_rng(21)
    s_count, kw = 2, 4
    m = jnp.asarray(rng.normal(size=(s_count, t, c)), jnp.bfloat16)
    pool = jnp.asarray(rng.normal(size=(s_count + 1, kw - 1, c)), jnp.bfloat16)
    weight = jnp.asarray(rng.normal(size=(c, kw)), jnp.bfloat16)
    slot = jnp.asarray([2, 0], jnp.int32)
    start, lengths = jnp.asarray([0, 5], jnp.int32), jnp.asarray([t, t - 4], jnp.int32)
    run = _jit(gdn.conv_prompt)
    u, whole_pool = run(m, pool, slot, weight, start, lengths)
    for s in range(s_count):
        n = int(lengths[s])
        hist = np.zeros((kw - 1, c)) if int(start[s]) == 0 else np.asarray(pool[int(slot[s])], np.float64)
        seq = np.concatenate([hist, np.asarray(m[s, :n], np.float64)])
        w64 = np.asarray(weight, np.float64)
        acc = np.stack([(seq[i:i + kw] * w64.T).sum(0) for i in range(n)])
        want = acc / (1 + np.exp(-acc))
        np.testing.assert_allclose(np.asarray(u[s, :n], np.float64), want, rtol=1e-2, atol=1e-2)
        np.testing.assert_array_equal(np.asarray(whole_pool[int(slot[s])], np.float64), seq[-(kw - 1):])
    cur, pieces = pool, []
    for a, b in cuts:
        lens = jnp.clip(lengths - a, 0, b - a)
        piece, cur = run(m[:, a:b], cur, slot, weight, start + a, lens)
        pieces.append(np.asarray(piece))
    got = np.concatenate(pieces, axis=1)
    for s in range(s_count):
        n = int(lengths[s])
        np.testing.assert_array_equal(got[s, :n], np.asarray(u[s, :n]))
    np.testing.assert_array_equal(np.asarray(cur), np.asarray(whole_pool))


def test_conv_commit_equals_serial_one_row_commits():
    rng = np.random.default_rng(6)
    s_count, r_max, c = 3, 6, 16
    m = jnp.asarray(rng.normal(size=(s_count, r_max, c)), jnp.float32)
    pool = jnp.asarray(rng.normal(size=(s_count, 3, c)), jnp.float32)
    slot = jnp.asarray([2, 0, 1], jnp.int32)
    paths = [[0, 1, 2, 3, 4, 5], [0, 2], []]
    path = jnp.asarray([p + [0] * (r_max - len(p)) for p in paths], jnp.int32)
    out = gdn.conv_commit(m, path, jnp.asarray([len(p) for p in paths]), pool, slot)
    cur = pool
    for i in range(6):
        node = jnp.asarray([p[i] if i < len(p) else 0 for p in paths])
        rows = jnp.take_along_axis(m, node[:, None, None], axis=1)
        cur = gdn.conv_commit(rows, jnp.zeros((s_count, 1), jnp.int32),
                              jnp.asarray([int(i < len(p)) for p in paths]), cur, slot)
    assert np.array_equal(np.asarray(cur), np.asarray(out))
    out = np.asarray(out)
    assert np.array_equal(out[2], np.asarray(m)[0, 3:6])  # stream 0 took 6 rows: its last 3
    assert np.array_equal(out[0], np.stack([np.asarray(pool)[0, 2], np.asarray(m)[1, 0], np.asarray(m)[1, 2]]))
    assert np.array_equal(out[1], np.asarray(pool)[1])  # stream 2 took none


@pytest.mark.parametrize("pool_dtype", [jnp.bfloat16, jnp.float32])
def test_conv_step_equals_conv_window_then_commit_bitwise(pool_dtype):
    rng = np.random.default_rng(13)
    s_count, c, kw, rows = 3, 24, 4, 5
    m = jnp.asarray(rng.normal(size=(s_count, rows, c)), jnp.bfloat16)
    pool = jnp.asarray(rng.normal(size=(s_count + 2, kw - 1, c)), pool_dtype)
    weight = jnp.asarray(rng.normal(size=(c, kw)), jnp.bfloat16)
    slot = jnp.asarray([4, 0, 2], jnp.int32)
    step = jax.jit(gdn.conv_step)
    cur, outs = pool, []
    for t in range(rows):
        row = m[:, t:t + 1]
        u, nxt = step(row, cur, slot, weight)
        u_w = gdn.conv_window(row, jnp.full((s_count, 1), -1, jnp.int32), cur, slot, weight)
        pool_c = gdn.conv_commit(row, jnp.zeros((s_count, 1), jnp.int32), jnp.ones((s_count,), jnp.int32), cur,
                                 slot)
        assert np.array_equal(np.asarray(u), np.asarray(u_w)), f"row {t}: conv_step output != conv_window"
        assert np.array_equal(np.asarray(nxt), np.asarray(pool_c)), f"row {t}: conv_step pool != conv_commit"
        u1, _ = step(row[1:2], cur, slot[1:2], weight)
        assert np.array_equal(np.asarray(u1[0]), np.asarray(u[1])), "alone != among others"
        for s in range(s_count):  # float64 silu(sum of the last K inputs), history as the window reads it (m.dtype)
            seq = np.concatenate([np.asarray(pool[int(slot[s])].astype(m.dtype), np.float64),
                                  np.asarray(m[s, :t + 1], np.float64)])
            acc = (seq[-kw:] * np.asarray(weight, np.float64).T).sum(0)
            # u is bf16: rounding to nearest is within 2^-9 relative; 2^-8 leaves room for the fp32 sum
            np.testing.assert_allclose(np.asarray(u[s, 0], np.float64), acc / (1 + np.exp(-acc)), rtol=2 ** -8,
                                       atol=1e-6)
        outs.append(np.asarray(u))
        cur = nxt
    chain = jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32) - 1, (s_count, rows))
    assert np.array_equal(np.concatenate(outs, axis=1), np.asarray(gdn.conv_window(m, chain, pool, slot, weight)))
    assert np.array_equal(np.asarray(cur), np.asarray(
        gdn.conv_commit(m, chain + 1, jnp.full((s_count,), rows, jnp.int32), pool, slot)))
    assert np.array_equal(np.asarray(cur)[[1, 3]], np.asarray(pool)[[1, 3]]), "other slots changed"


@pytest.mark.parametrize("pool_dtype", [jnp.bfloat16, jnp.float32])
def test_conv_prompt_rows_equal_serial_steps_bitwise(pool_dtype):
    """The prompt conv and the decode step compute one expression (`_conv_taps`): a prompt resumed from a history
    gives, row for row, the bits of serial steps over the same rows, and the same pool."""
    rng = np.random.default_rng(29)
    s_count, c, kw, t = 2, 40, 4, 6
    m = jnp.asarray(rng.normal(size=(s_count, t, c)), jnp.bfloat16)
    pool = jnp.asarray(rng.normal(size=(s_count + 1, kw - 1, c)), pool_dtype)
    weight = jnp.asarray(rng.normal(size=(c, kw)), jnp.bfloat16)
    slot = jnp.asarray([2, 1], jnp.int32)
    u, pool_p = _jit(gdn.conv_prompt)(m, pool, slot, weight, jnp.asarray([5, 9], jnp.int32),
                                      jnp.asarray([t, t], jnp.int32))
    step = jax.jit(gdn.conv_step)
    cur = pool
    for r in range(t):
        u_s, cur = step(m[:, r:r + 1], cur, slot, weight)
        assert np.array_equal(np.asarray(u_s[:, 0]), np.asarray(u[:, r])), f"row {r}: step != prompt"
    assert np.array_equal(np.asarray(cur), np.asarray(pool_p))


# ------------------------------------------------------------------------------------------------------------
# Validation and lowering
# ------------------------------------------------------------------------------------------------------------

def test_entry_points_reject_bad_inputs():
    rng = np.random.default_rng(0)
    q, k, v, g, beta = _rows(rng, 1, 8, 2, 4, 16, 32)
    pool = _pool(rng, 2, 4, 16, 32)
    slot, start, lengths = jnp.array([0]), jnp.array([0]), jnp.array([8])
    with pytest.raises(ValueError, match="multiple of key heads"):
        gdn.prompt(q, k, v[:, :, :3], g[..., :3], beta[..., :3], pool[:, :3], slot, start, lengths)
    with pytest.raises(ValueError, match="g must be float32"):
        gdn.prompt(q, k, v, g.astype(jnp.bfloat16), beta, pool, slot, start, lengths)
    with pytest.raises(ValueError, match="rec_pool must be float32"):
        gdn.prompt(q, k, v, g, beta, pool.astype(jnp.bfloat16), slot, start, lengths)
    with pytest.raises(ValueError, match="powers of two"):
        gdn.window(q[..., :12], k[..., :12], v, g, beta, jnp.array([[-1] * 8]), pool[:, :, :12], slot)
    with pytest.raises(ValueError, match="parents must be"):
        gdn.window(q, k, v, g, beta, jnp.array([-1] * 8), pool, slot)
    with pytest.raises(ValueError, match="path_len must be"):
        gdn.commit(k, v, g, beta, jnp.zeros((1, 8), jnp.int32), jnp.array(3), pool, slot)
    with pytest.raises(ValueError, match="precision"):
        gdn.prompt(q, k, v, g, beta, pool, slot, start, lengths, tiles=gdn.PromptTiles(precision="fp8"))
    with pytest.raises(ValueError, match="one row per stream"):
        gdn.step(q, k, v, g, beta, pool, slot)
    with pytest.raises(ValueError, match="one row per stream"):
        gdn.conv_step(jnp.zeros((1, 2, 8)), jnp.zeros((1, 3, 8)), slot, jnp.zeros((8, 4)))


# ------------------------------------------------------------------------------------------------------------
# Decode rows' preparation (conv, q/k norm, gates in one launch)
# ------------------------------------------------------------------------------------------------------------

prep_k = jax.jit(functools.partial(gdn.decode_prep, interpret=INTERPRET), static_argnames=("hk", "dk", "hv", "dv"))
prep_ref = jax.jit(gdn.decode_prep_reference, static_argnames=("hk", "dk", "hv", "dv"))
PREP_NAMES = ("q", "k", "v", "z", "g", "beta", "conv_pool")


def _prep_case(rng, shape, streams: int, rows: int, dtype, pool_dtype=None, slots=None):
    """The in-projection's output y [S, R, N], a conv pool with 2 spare slots, distinct slots (none of them 0, the
    engine's dummy slot), conv weight and gate parameters at the model's scales; -> (y, pool, slot, weight, a_log,
    dt_bias)."""
    hk, hv, dk, dv = shape["hk"], shape["hv"], shape["dk"], shape["dv"]
    c = 2 * hk * dk + hv * dv
    y = jnp.asarray(rng.normal(size=(streams, rows, c + hv * dv + 2 * hv)), dtype)
    pool = jnp.asarray(rng.normal(size=(streams + 2, 3, c)), pool_dtype or dtype)
    slot = jnp.asarray(1 + rng.permutation(streams + 1)[:streams] if slots is None else slots, jnp.int32)
    weight = jnp.asarray(rng.normal(size=(c, 4)) * 0.5, jnp.float32)
    a_log = jnp.asarray(rng.uniform(-1, 1, size=hv), jnp.float32)
    dt_bias = jnp.asarray(rng.normal(size=hv), jnp.float32)
    return y, pool, slot, weight, a_log, dt_bias


def _dims(shape):
    return dict(hk=shape["hk"], dk=shape["dk"], hv=shape["hv"], dv=shape["dv"])


def _check_prep_against_reference(shape, dtype, pool_dtype):
    rng = np.random.default_rng(40)
    parents = jnp.asarray([TREES[n] for n in TREES], jnp.int32)
    y, pool, slot, w, a_log, dt_bias = _prep_case(rng, shape, 4, 8, dtype, pool_dtype)
    window = prep_k(y, parents, pool, slot, w, a_log, dt_bias, **_dims(shape))
    step_y = y[:, :1]
    step_slot = slot.at[1].set(0)  # a dead stream: its g and beta must be 0
    step = prep_k(step_y, None, pool, step_slot, w, a_log, dt_bias, **_dims(shape))
    for out, ref in ((window, prep_ref(y, parents, pool, slot, w, a_log, dt_bias, **_dims(shape))),
                     (step, prep_ref(step_y, None, pool, step_slot, w, a_log, dt_bias, **_dims(shape)))):
        assert len(out) == len(ref)
        for name, a, b in zip(PREP_NAMES, out, ref):
            assert a.shape == b.shape and a.dtype == b.dtype, name
            if name == "conv_pool":  # copies; slot 0 is the dead stream's scratch
                assert np.array_equal(np.asarray(a)[1:], np.asarray(b)[1:]), name
            elif name == "z":
                assert np.array_equal(np.asarray(a), np.asarray(b)), name
            else:  # fp32 arithmetic in another order, then (q, k, v) one rounding to y.dtype
                tol = F32_TOL if dtype == jnp.float32 or name in ("g", "beta") else BF16_OUT_TOL
                assert _rel(a, b) < tol, name
    assert np.all(np.asarray(step[4])[1] == 0) and np.all(np.asarray(step[5])[1] == 0), "dead stream's g, beta"
    assert np.all(np.asarray(step[5])[[0, 2, 3]] > 0), "live streams' beta"


@pytest.mark.parametrize("dtype,pool_dtype", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16),
                                              (jnp.bfloat16, jnp.float32)])
def test_decode_prep_matches_reference(dtype, pool_dtype):
    _check_prep_against_reference(SMALL, dtype, pool_dtype)


def _check_prep_serial_equals_windows(shape, dtype, streams: int = 3, rows: int = 5):
    """Serial steps (each updating the pool) give, bit for bit, the rows of one chain window over the first
    step's pool, the rows of tree windows whose paths are those chains, and each stream alone."""
    rng = np.random.default_rng(41)
    y, pool, slot, w, a_log, dt_bias = _prep_case(rng, shape, streams, rows, dtype)
    dims = _dims(shape)
    cur, serial = pool, []
    for t in range(rows):
        alone = prep_k(y[1:2, t:t + 1], None, cur, slot[1:2], w, a_log, dt_bias, **dims)
        *out, cur = prep_k(y[:, t:t + 1], None, cur, slot, w, a_log, dt_bias, **dims)
        serial.append(out)
        for name, a, b in zip(PREP_NAMES, alone[:6], out):
            assert np.array_equal(np.asarray(a)[0], np.asarray(b)[1]), f"row {t}: {name} alone != among others"
    serial = [np.concatenate([np.asarray(o[i]) for o in serial], axis=1) for i in range(6)]
    chain = jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32) - 1, (streams, rows))
    # the same chain inside a tree: the chain's rows at even indices, a fork of dead ends between them
    tree_rows = 2 * rows
    tree = np.full((streams, tree_rows), -1, np.int32)
    for t in range(rows):
        tree[:, 2 * t] = 2 * (t - 1) if t else -1
        tree[:, 2 * t + 1] = 2 * t
    y_tree = jnp.repeat(y, 2, axis=1)
    for parents, yy, pick in ((chain, y, slice(None)), (jnp.asarray(tree), y_tree, slice(0, None, 2))):
        window = prep_k(yy, parents, pool, slot, w, a_log, dt_bias, **dims)
        for name, a, b in zip(PREP_NAMES, window, serial):
            assert np.array_equal(np.asarray(a)[:, pick], b), f"{name}: window rows != serial steps"
    committed = gdn.conv_commit(y[..., :pool.shape[2]], chain + 1, jnp.full((streams,), rows, jnp.int32), pool, slot)
    assert np.array_equal(np.asarray(cur), np.asarray(committed)), "serial pool != commit of the chain"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_prep_serial_steps_equal_windows_bitwise(dtype):
    _check_prep_serial_equals_windows(SMALL, dtype)


def _check_prep_reads_pieces(shape, r: int):
    """`qmm_mgpu.Pieces` (the in-projection's decode qmm pieces, summed and rounded in the kernel): the bits of the same
    call on their materialized y, for the serial step (3 streams in an r-row piece, the pool updated alike) and a
    tree window (2 streams x 4 rows); unwritten pieces hold NaN and must be selected away."""
    from tests.test_swiglu import random_pieces
    rng = np.random.default_rng(43)
    dims = _dims(shape)
    _, pool, slot, w, a_log, dt_bias = _prep_case(rng, shape, 3, 1, jnp.bfloat16)
    n = 2 * shape["hk"] * shape["dk"] + 2 * shape["hv"] * shape["dv"] + 2 * shape["hv"]
    parts, valid = random_pieces(rng, 3, n, r)
    cases = ((qmm_mgpu.Pieces(parts, valid, (3, 1)), None, slot),
             (qmm_mgpu.Pieces(parts, valid, (2, 4)), jnp.asarray([TREES["fork"][:4]] * 2, jnp.int32), slot[:2]))
    for pieces, parents, sl in cases:
        y = pieces.materialize()
        assert y.shape == (*pieces.lead, n) and y.dtype == jnp.bfloat16
        assert np.all(np.isfinite(np.asarray(y, np.float32)))
        got = prep_k(pieces, parents, pool, sl, w, a_log, dt_bias, **dims)
        want = prep_k(y, parents, pool, sl, w, a_log, dt_bias, **dims)
        assert len(got) == len(want) == (7 if parents is None else 6)
        for name, a, b in zip(PREP_NAMES, got, want):
            assert a.shape == b.shape and np.array_equal(np.asarray(a), np.asarray(b)), name
        for name, a, b in zip(PREP_NAMES, prep_ref(pieces, parents, pool, sl, w, a_log, dt_bias, **dims),
                              prep_ref(y, parents, pool, sl, w, a_log, dt_bias, **dims)):
            assert np.array_equal(np.asarray(a), np.asarray(b)), name
    with pytest.raises(ValueError, match="live rows"):
        gdn.decode_prep(qmm_mgpu.Pieces(parts, valid, (3, r)), None, pool, slot, w, a_log, dt_bias, **dims)


def test_decode_prep_reads_pieces_bitwise():
    _check_prep_reads_pieces(SMALL, 8)


def test_decode_prep_rejects_bad_inputs():
    rng = np.random.default_rng(42)
    y, pool, slot, w, a_log, dt_bias = _prep_case(rng, SMALL, 2, 3, jnp.float32)
    dims = _dims(SMALL)
    with pytest.raises(ValueError, match="columns"):
        gdn.decode_prep(y[..., 1:], jnp.zeros((2, 3), jnp.int32), pool, slot, w, a_log, dt_bias, **dims)
    with pytest.raises(ValueError, match="one row per stream"):
        gdn.decode_prep(y, None, pool, slot, w, a_log, dt_bias, **dims)
    with pytest.raises(ValueError, match="parents must be"):
        gdn.decode_prep(y, jnp.zeros((2,), jnp.int32), pool, slot, w, a_log, dt_bias, **dims)
    with pytest.raises(ValueError, match="weight must be"):
        gdn.decode_prep(y, jnp.zeros((2, 3), jnp.int32), pool, slot, w[:, :3], a_log, dt_bias, **dims)
    with pytest.raises(ValueError, match="a_log must be"):
        gdn.decode_prep(y, jnp.zeros((2, 3), jnp.int32), pool, slot, w, a_log[:2], dt_bias, **dims)
    odd = dict(SMALL, dk=12)
    with pytest.raises(ValueError, match="powers of two"):
        gdn.decode_prep(*_prep_case(rng, odd, 2, 3, jnp.float32)[:1], jnp.zeros((2, 3), jnp.int32),
                        *_prep_case(rng, odd, 2, 3, jnp.float32)[1:], **_dims(odd))


def test_kernels_lower_to_triton_at_27b_heads(monkeypatch):
    """Cross-lowers the three kernels for an H200 on this CPU machine: catches primitives the Triton lowering
    rejects without a GPU (it stops before Triton's own compile, which only the `gpu` tests reach)."""
    registration = pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
    gpu_info = pytest.importorskip("jax._src.pallas.triton.gpu_info")
    monkeypatch.setattr(registration.gpu_info_lib, "get_gpu_info",
                        lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200))
    sds = jax.ShapeDtypeStruct
    s, t, r, n = 2, 130, 16, 3
    hk, hv, dk, dv = BIG["hk"], BIG["hv"], BIG["dk"], BIG["dv"]
    bf, f, i = jnp.bfloat16, jnp.float32, jnp.int32
    qk = lambda rows: sds((s, rows, hk, dk), bf)
    vv = lambda rows: sds((s, rows, hv, dv), bf)
    gb = lambda rows: sds((s, rows, hv), f)
    pool, per_stream = sds((n, hv, dk, dv), f), sds((s,), i)

    def lower(fn, *args):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    for tiles in (gdn.PromptTiles(), gdn.PromptTiles(precision="tf32x3"), gdn.PromptTiles(store_dtype="bfloat16"),
                  gdn.PromptTiles(precision="bf16", store_dtype="bfloat16"), gdn.prompt_tiles(jnp.bfloat16),
                  dataclasses.replace(gdn.prompt_tiles(jnp.bfloat16), split_prep=True)):
        text = lower(functools.partial(gdn.prompt, tiles=tiles), qk(t), qk(t), vv(t), gb(t), gb(t), pool,
                     per_stream, per_stream, per_stream)
        # fused: no output pass; split_prep: the prep pass in two launches
        assert text.count("__gpu$xla.gpu.triton") == (2 if tiles.fused_output else 3) + tiles.split_prep
    text = lower(gdn.window, qk(r), qk(r), vv(r), gb(r), gb(r), sds((s, r), i), pool, per_stream)
    assert "__gpu$xla.gpu.triton" in text
    text = lower(gdn.commit, qk(r), vv(r), gb(r), gb(r), sds((s, r), i), per_stream, pool, per_stream)
    assert "__gpu$xla.gpu.triton" in text
    for tiles in (gdn.WindowTiles(), gdn.WindowTiles(block_v=16, num_warps=1)):
        text = lower(functools.partial(gdn.step, tiles=tiles), qk(1), qk(1), vv(1), gb(1), gb(1), pool, per_stream)
        assert "__gpu$xla.gpu.triton" in text
    c = 2 * hk * dk + hv * dv
    ys = lambda rows: sds((s, rows, c + hv * dv + 2 * hv), bf)
    prep_tail = (sds((n, 3, c), bf), per_stream, sds((c, 4), f), sds((hv,), f), sds((hv,), f))
    prep = functools.partial(gdn.decode_prep, hk=hk, dk=dk, hv=hv, dv=dv)
    for text in (lower(prep, ys(r), sds((s, r), i), *prep_tail),  # a window
                 lower(lambda y, *a: prep(y, None, *a), ys(1), *prep_tail)):  # the step
        assert text.count("__gpu$xla.gpu.triton") == 1


# ------------------------------------------------------------------------------------------------------------
# GPU: the same properties at the 27B's head shape
# ------------------------------------------------------------------------------------------------------------

def _poison_allocator(shape, dtype):
    """Best effort on the GPU: leave a freed NaN block of the output's size for the allocator to hand out next,
    so an element the kernel never writes is likely to read NaN."""
    jax.block_until_ready(jnp.full(shape, jnp.nan, dtype)).delete()


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["tf32x3", "tf32"])
def test_gpu_prompt_27b_heads(precision):
    """Prompt lengths 1, 63, 64, 65, 300 (and 250 off the grid) as streams of one T=300 call, then calls whose
    array T is 1 and 65 (loads running past the array's end)."""
    tiles = gdn.PromptTiles(precision=precision)
    tol = _prompt_tol(tiles)
    run = jax.jit(functools.partial(gdn.prompt, tiles=tiles))
    rng = np.random.default_rng(100)
    cases = [_prompt_case(rng, 300, BIG, starts=(0, 0, 128, 37, 192, 5), lengths=(1, 63, 64, 65, 300, 250))]
    if precision == "tf32x3":
        cases += [_prompt_case(rng, t, BIG) for t in (1, 65)]
    for args in cases:
        _poison_allocator(args[2].shape, args[2].dtype)
        o, pool_out = run(*args)
        _check_prompt_vs_f64(args, o, pool_out, tol, tol)
        ro, _ = prompt_ref(*args)
        assert _rel(o, ro) < tol


@pytest.mark.gpu
def test_gpu_prompt_bf16_27b_heads():
    rng = np.random.default_rng(8)
    args = _prompt_case(rng, 300, BIG, jnp.bfloat16)
    for tiles in (gdn.PromptTiles(), gdn.PromptTiles(store_dtype="bfloat16")):
        _poison_allocator(args[2].shape, args[2].dtype)
        o, pool_out = jax.jit(functools.partial(gdn.prompt, tiles=tiles))(*args)
        _check_prompt_vs_f64(args, o, pool_out, BF16_OUT_TOL, _prompt_tol(tiles))


BF16_FUSED = gdn.PromptTiles(block_v=16, num_warps=2, precision="bf16", store_dtype="bfloat16", transposed=True,
                             fused_output=True)


@pytest.mark.gpu
def test_gpu_prompt_bf16_products_27b_heads():
    rng = np.random.default_rng(9)
    args = _prompt_case(rng, 300, BIG, jnp.bfloat16)
    for tiles in (gdn.prompt_tiles(jnp.bfloat16),
                  gdn.PromptTiles(precision="bf16", store_dtype="bfloat16", block_v=32, num_warps=4), BF16_FUSED):
        _poison_allocator(args[2].shape, args[2].dtype)
        o, pool_out = jax.jit(functools.partial(gdn.prompt, tiles=tiles))(*args)
        _check_prompt_vs_f64(args, o, pool_out, BF16_PRODUCTS_TOL, BF16_PRODUCTS_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [gdn.PromptTiles(), gdn.prompt_tiles(jnp.bfloat16),
                                   gdn.PromptTiles(precision="bf16", store_dtype="bfloat16", block_v=32, num_warps=4),
                                   BF16_FUSED],
                         ids=["default", "shipped-bf16", "bf16-untransposed", "bf16-fused-output"])
def test_gpu_prompt_exactness_27b_heads(tiles):
    _resume_check(BIG, 300, [64, 256], tiles)  # pieces of 64, 192 and 44 rows
    _alone_vs_batched(BIG, tiles)


@pytest.mark.gpu
def test_gpu_prompt_split_prep_same_bits_27b_heads():
    """The split prep pass on the device gives the one-launch prep's bits at the 27B's heads (shipped bf16 tiles and
    the tf32 defaults)."""
    _split_prep_same_bits(BIG, jnp.bfloat16, (gdn.prompt_tiles(jnp.bfloat16), gdn.PromptTiles()), t=300)


@pytest.mark.gpu
def test_gpu_window_and_commit_27b_heads():
    _check_window(BIG)
    _check_commit(BIG)


@pytest.mark.gpu
@pytest.mark.parametrize("streams", [1, 3, 16])
def test_gpu_step_27b_heads(streams):
    _check_step(BIG, streams, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("streams", [1, 3, 8])
def test_gpu_step_norm_27b_heads(streams):
    _check_step_norm(BIG, streams, 8, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("block_v,num_warps", [(32, 1), (32, 2), (16, 1)])
def test_gpu_step_other_tiles_27b_heads(block_v, num_warps):
    """The bench's step tile variants: each is exact against the window and commit run with the same tiles."""
    rng = np.random.default_rng(block_v + num_warps)
    (q, k, v, g, beta), pool, slot, o, new = _step_equals_window_commit(
        rng, BIG, 4, gdn.WindowTiles(block_v=block_v, num_warps=num_warps))
    ref_o, ref_pool = step_ref(q, k, v, g, beta, pool, slot)
    assert _rel(o, ref_o) < BF16_OUT_TOL
    assert _rel(new[slot], ref_pool[slot]) < F32_TOL


@pytest.mark.gpu
def test_gpu_window_leaf_lists_27b_heads():
    trees = {"best_first": [-1, 0, 0, 1, 2, 1, 3, 4, 5, 6, 2, 7, 8, 9, 11, 3], "chain": list(range(-1, 15)),
             "fan": [-1] * 16, "padded": [-1, 0, 1, 0, 2, 3] + [-1] * 10}
    _check_leaves(BIG, jnp.bfloat16, trees)


@pytest.mark.gpu
def test_gpu_window_16_rows_alone_vs_among_others():
    rng = np.random.default_rng(12)
    trees = {"chain": list(range(-1, 15)), "fan": [-1] * 16, "fork": [-1, 0, 1, 1, 2, 3, 0, 6] * 2}
    trees["fork"] = [p if i < 8 else (p + 8 if p >= 0 else 7) for i, p in enumerate(trees["fork"])]
    case = _window_case(rng, BIG, jnp.bfloat16, trees)
    v = case[1][2]
    _poison_allocator(v.shape, v.dtype)
    _check_window_alone_vs_among_others(case)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,pool_dtype", [(jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.float32)])
def test_gpu_decode_prep_27b_heads(dtype, pool_dtype):
    _check_prep_against_reference(BIG, dtype, pool_dtype)
    _check_prep_serial_equals_windows(BIG, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("r", [8, 16])
def test_gpu_decode_prep_reads_pieces_27b_heads(r):
    _check_prep_reads_pieces(BIG, r)
