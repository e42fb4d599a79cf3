"""The Mosaic GPU pass 1 of the verify/decode window (`attention_window_mgpu`, `WindowTiles(impl="mgpu")`) against
`attention.window_reference` and the float64 numpy attention of test_attention, plus the exactness properties: a
row's bits never depend on the other rows of its window (a serial step and a row of a drafted window agree, in one
compute warpgroup or two), on the other streams, on the table width, or on the K/V stages in flight.

CPU runs the kernel in Mosaic GPU's interpreter (unwritten outputs are NaN there) at head dim 64 on 16-key pages
(four copies a 64-key block) with 128-key chunks, and lowers it for sm_90 at the 27B shape; `-m gpu` runs it
compiled at the 27B shape (24 query heads, 4 KV heads, head dim 256, 64-key pages)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import attention as at
from pallas_kernels import attention_window_mgpu as awm
from pallas_kernels import kv_quant as kq
from tests.test_attention import (BIG, CHAIN, TREE, bits, np_window, rel_err, rows_case, rows_share_chunks,
                                  scattered_tables, window_case, window_rows_and_one_row_windows)
from tests.test_attention_mgpu import row_invariant_interpreter_wgmma  # noqa: F401 (autouse fixture)

GPU = pytest.mark.gpu
pytestmark = pytest.mark.timeout(600)

SMALL = dict(hq=4, hkv=2, d=64, page_size=16)
# No context yet, inside the first block, exactly one chunk, three chunks ending mid-page; trees and chains.
CASE = dict(s=4, pmax=20, num_pages=90, cache_lens=[0, 37, 128, 300], parents=[TREE, CHAIN, TREE, CHAIN], **SMALL)
# 128-key chunks of two 64-key blocks; fold 2: the 3-chunk stream goes through the fold pass; the shipped partials.
TILES = at.WindowTiles(chunk=128, fold=2, impl="mgpu", partials=awm.PARTIALS)
SCALE = SMALL["d"] ** -0.5


def window_call(q, kw, vw, par, pool, table, cache_len, *, tiles=TILES, interpret=True):
    return at.window(q, kw, vw, par, pool, table, cache_len, scale=SCALE, interpret=interpret, tiles=tiles)


def partials_call(q, pool, table, cache_len, *, tiles=TILES, interpret=True):
    return at.window_partials(q, pool, table, cache_len, scale=SCALE, tiles=tiles, interpret=interpret)


_run = jax.jit(window_call, static_argnames=("tiles", "interpret"))
_partials = jax.jit(partials_call, static_argnames=("tiles", "interpret"))


# `run` and `partials` pass tiles and interpret on by keyword always: jax.jit keys its programs by the arguments as
# passed, so a call leaving tiles at the default and one naming the same tiles would trace and compile twice.
def run(q, kw, vw, par, pool, table, cache_len, *, tiles=TILES, interpret=True):
    return _run(q, kw, vw, par, pool, table, cache_len, tiles=tiles, interpret=interpret)


def partials(q, pool, table, cache_len, *, tiles=TILES, interpret=True):
    return _partials(q, pool, table, cache_len, tiles=tiles, interpret=interpret)


class Shared:
    """A case's operands and the calls made over them so far (`run` and `partials` at given tiles), so tests making
    the same call over the same case read its result rather than interpret the kernel again (module fixtures)."""

    def __init__(self, case):
        self.case = case
        self._out = {}

    def run(self, tiles=TILES):
        if ("run", tiles) not in self._out:
            self._out["run", tiles] = run(*self.case, tiles=tiles)
        return self._out["run", tiles]

    def partials(self, tiles=TILES):
        if ("partials", tiles) not in self._out:
            q, _, _, _, pool, table, cache_len = self.case
            self._out["partials", tiles] = partials(q, pool, table, cache_len, tiles=tiles)
        return self._out["partials", tiles]


# The 9-row windows of 16 query heads (72 packed rows: two compute warpgroups) over 300 and 70 keys, a tree and a
# chain.
TWO = dict(hq=16, s=2, cache_lens=[300, 70], parents=[TREE + [6, 7], list(range(-1, 8))])


@pytest.fixture(scope="module")
def bf16_case():
    """CASE's 7-row bf16 window (28 packed rows, one compute warpgroup), its calls shared by the tests below."""
    return Shared(window_case(np.random.default_rng(60), r=7, dtype=jnp.bfloat16, **CASE))


@pytest.fixture(scope="module")
def bf16_two():
    """TWO's bf16 window (two compute warpgroups), its calls shared by the tests below."""
    return Shared(window_case(np.random.default_rng(62), r=9, dtype=jnp.bfloat16, **dict(CASE, **TWO)))


PAGES64 = dict(page_size=64, pmax=6, num_pages=40)  # 384-key tables, as CASE's 320 three 128-key chunks


@pytest.fixture(scope="module")
def fp8_two64():
    """TWO's window over an fp8 pool of 64-key pages, V by rows (the pass 1 that dequantizes): the fp8 tests below
    share its window call."""
    return Shared(window_case(np.random.default_rng(68), r=9, dtype=kq.FP8, **dict(CASE, **PAGES64, **TWO)))


def fresh_jit(fn, static=("scale", "interpret", "tiles")):
    """jax.jit of a new wrapper of fn, so module flags read at tracing (PING_PONG, DEQUANT) take
    effect: jax keeps a function's traced program by the function, so a second jax.jit(fn) with the same arguments
    reuses the trace the first one made, under whatever flags held then."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return jax.jit(wrapper, static_argnames=static)


def _live_rows(part, cache_len, chunk, rows):
    """The written entries of m / l / acc [S, Hkv, NC, M, ...]: live chunks of each stream, packed rows < rows."""
    out = []
    for s, n in enumerate(np.asarray(cache_len)):
        out.append(np.asarray(part[s, :, : -(-int(n) // chunk), :rows]))
    return out


def test_matches_reference_and_float64(bf16_case):
    case = bf16_case.case
    got = bf16_case.run()
    want = np_window(*case, SCALE)
    assert got.shape == case[0].shape and got.dtype == case[0].dtype
    assert rel_err(got, want) < 1e-2
    ref = jax.jit(at.window_reference, static_argnames="scale")(*case, scale=SCALE)
    assert rel_err(got, np.asarray(ref.astype(jnp.float32), np.float64)) < 1e-2
    triton = run(*case, tiles=dataclasses.replace(TILES, impl="triton", block_k=16, partials="float32"))
    assert rel_err(triton, want) < 1e-2


def test_bf16_partials_are_the_fp32_partials_rounded_once(bf16_case, bf16_two):
    """WindowTiles.partials "bfloat16": each stored O partial is the fp32 one rounded to bf16 (the same sums, one
    rounding), m and l are the fp32 run's bits, and the window stays right against float64 (one and two compute
    warpgroups, the fold pass included)."""
    t16 = dataclasses.replace(TILES, partials="bfloat16")
    t32 = dataclasses.replace(TILES, partials="float32")
    for r, shared in ((7, bf16_case), (9, bf16_two)):  # 28 packed rows; 72 (two compute warpgroups)
        case = shared.case
        q, kw, vw, par, pool, table, cache_len = case
        rows = r * (q.shape[2] // SMALL["hkv"])
        (m32, l32, a32), (m16, l16, a16) = shared.partials(t32), shared.partials(t16)
        assert a32.dtype == jnp.float32 and a16.dtype == jnp.bfloat16
        for got, want in ((m16, m32), (l16, l32), (a16, a32.astype(jnp.bfloat16))):
            for a, b in zip(_live_rows(got, cache_len, 128, rows), _live_rows(want, cache_len, 128, rows)):
                assert np.array_equal(bits(a), bits(b)), r
        assert rel_err(shared.run(t16), np_window(*case, SCALE)) < 1e-2
    with pytest.raises(ValueError, match="partials"):
        run(*case, tiles=dataclasses.replace(t16, impl="triton"))
    with pytest.raises(ValueError, match="partials"):
        run(*case, tiles=dataclasses.replace(t16, partials="float16"))


def dequantized_pool(pool: kq.KVPool) -> kq.KVPool:
    """An fp8 pool's keys and values as the Mosaic GPU pass 1 dequantizes them: bf16(code x its key's scale)."""
    deq = lambda codes, scale: (codes.astype(jnp.float32) * scale[..., None]).astype(jnp.bfloat16)
    return kq.KVPool(deq(pool.k, pool.k_scale), deq(pool.v, pool.v_scale))


def test_fp8_pool_partials_are_the_bf16_pass_over_its_dequantized_keys(fp8_two64):
    """An fp8 pool on the Mosaic GPU pass 1 (one compute warpgroup a CTA; a 72-row window in two CTAs): each key
    block's codes dequantized to bf16(code x scale) in shared memory, so the partials are bit for bit those of the
    bf16 pass 1 over a pool holding those values (rows split the same way, a launch choice there); the window is
    right against float64, a stream alone has its bits among others, and the 1-row step has row 0's bits. The
    7-row window on 16-key pages (four copies a block, the scales' too), the 72-row one on 64-key pages (one)."""
    for r, shared in ((7, Shared(window_case(np.random.default_rng(68), r=7, dtype=kq.FP8, **CASE))),
                      (9, fp8_two64)):
        case = shared.case
        q, kw, vw, par, pool, table, cache_len = case
        rows = r * (q.shape[2] // SMALL["hkv"])
        got = shared.partials()
        # (28 rows are one warpgroup's, in one CTA either way: the shipped tiles, the program the bf16 tests run)
        split = dataclasses.replace(TILES, row_block=64) if rows > 64 else TILES
        want = partials(q, dequantized_pool(pool), table, cache_len, tiles=split)
        for a_all, b_all in zip(got, want):
            for a, b in zip(_live_rows(a_all, cache_len, 128, rows), _live_rows(b_all, cache_len, 128, rows)):
                assert np.array_equal(bits(a), bits(b)), r
        batch = shared.run()
        assert rel_err(batch, np_window(*case, SCALE)) < 1e-2
        alone = run(q[1:2], kw[1:2], vw[1:2], par[1:2], pool, table[1:2], cache_len[1:2])
        assert np.array_equal(bits(alone[0]), bits(batch[1]))
        step = run(q[:, :1], kw[:, :1], vw[:, :1], par[:, :1], pool, table, cache_len)
        assert np.array_equal(bits(step[:, 0]), bits(batch[:, 0]))


def test_fp8_dequant_layouts_give_the_same_bits(monkeypatch):
    """The codes dequantized in the MMA's layout (64 columns a step; a launch choice) give the partials of the
    shipped 8-bit MMA operand layout (128 columns a step), bit for bit (head dim 128, so the 8-bit layout's steps
    are taken). (Until session 26 this set the shipped value and compared the shipped layout with itself.)"""
    rng = np.random.default_rng(69)
    case = window_case(rng, r=3, dtype=kq.FP8, **dict(CASE, d=128, s=2, cache_lens=[300, 37], parents=[TREE, CHAIN]))
    q, kw, vw, par, pool, table, cache_len = case
    assert awm.DEQUANT == "wgmma_8bit"
    shipped = partials(q, pool, table, cache_len)
    monkeypatch.setattr(awm, "DEQUANT", "wgmma")  # read at tracing: `fresh_jit`
    mma_layout = fresh_jit(at.window_partials)(
        q, pool, table, cache_len, scale=SCALE, tiles=TILES, interpret=True)
    for a_all, b_all in zip(mma_layout, shipped):
        for a, b in zip(_live_rows(a_all, cache_len, 128, 6), _live_rows(b_all, cache_len, 128, 6)):
            assert np.array_equal(bits(a), bits(b))


def test_split_queries_are_exact_scalings_of_each_row():
    """The e4m3 pass 1's queries: each row scaled by a power of two to a largest |value| in (224, 448] (a zero row
    by 1), its high part the e4m3 rounding of that, the low part the e4m3 rounding of the rest; hi + lo carries
    the row to about bf16's precision, and a row's parts follow from it alone."""
    rng = np.random.default_rng(90)
    q = rng.standard_normal((3, 2, 64, 64)) * np.exp(rng.uniform(-30, 30, (3, 2, 64, 1)))
    q[0, 0, 5] = 0
    q[1, 1, 7] = 448 / 2 ** 3  # a row whose largest value lands exactly on 448
    q = jnp.asarray(q, jnp.bfloat16)
    hi, lo, inv = awm.split_queries(q)
    x = np.asarray(q.astype(jnp.float32), np.float64)
    scale = 1 / np.asarray(inv, np.float64)
    assert np.all(np.log2(scale) == np.round(np.log2(scale)))  # powers of two
    amax = np.abs(x).max(-1) * scale
    live = np.abs(x).max(-1) > 0
    assert np.all(amax[live] <= 448) and np.all(amax[live] > 224) and np.all(scale[~live] == 1)
    h, lw = (np.asarray(a.astype(jnp.float32), np.float64) for a in (hi, lo))
    y = x * scale[..., None]
    assert np.array_equal(h, np.asarray(jnp.asarray(y, jnp.float32).astype(kq.FP8).astype(jnp.float32)))
    assert np.all(np.abs(h + lw - y) <= 2.0 ** -8 * np.abs(y).max(-1, keepdims=True))
    alone = awm.split_queries(q[2:3, 1:2])
    assert all(np.array_equal(bits(a[0, 0]), bits(b[2, 1])) for a, b in zip(alone, (hi, lo, inv)))


def test_fp8_keys_major_pool_runs_both_mmas_on_the_codes(fp8_two64):
    """An fp8 pool with v key-major (`KVPool.v_layout` "keys", 64-key pages) on the Mosaic GPU pass 1: no
    dequantization, q and P' each in two e4m3 parts (its own order). Right against float64 (as close as the pass 1
    over V by rows, which dequantizes), a stream alone has its bits among others and with its table widened, the
    1-row step row 0's bits, and K/V stages change nothing; a 72-row window's two warpgroups in one CTA or two
    (split_rows) give the same bits. The stream alone runs with its table widened and at 1 K/V stage, against the
    batch at the default 3: a row's bits moved by either (the other streams and the table's width, or the stages)
    fail it, in one call rather than two (alone at the default stages, then alone at 1)."""
    rng = np.random.default_rng(91)
    for r, shared in ((7, Shared(window_case(rng, r=7, dtype=kq.FP8, **dict(CASE, **PAGES64)))), (9, fp8_two64)):
        case = shared.case
        q, kw, vw, par, pool, table, cache_len = case
        keys = kq.with_v_layout(pool, "keys")
        assert awm.unsupported(jnp.bfloat16, keys, q.shape[2] // 2, chunk=128) is None
        batch = run(q, kw, vw, par, keys, table, cache_len)
        want = np_window(*case, SCALE)
        assert rel_err(batch, want) < 1e-2
        assert rel_err(batch, want) < 2 * rel_err(shared.run(), want)  # the dequantizing pass 1 over V by rows
        s = len(cache_len) - 1
        wide = jnp.concatenate([table[s:s + 1], scattered_tables(rng, 1, 4, 40)], axis=1)
        assert awm.stages_for(awm.WindowMgpuTiles(), 1) == 3  # the batch's stages (one warpgroup a CTA here)
        alone = run(q[s:], kw[s:], vw[s:], par[s:], keys, wide, cache_len[s:],
                    tiles=dataclasses.replace(TILES, num_stages=1))
        assert np.array_equal(bits(alone[0]), bits(batch[s])), r
        step = run(q[:, :1], kw[:, :1], vw[:, :1], par[:, :1], keys, table, cache_len)
        assert np.array_equal(bits(step[:, 0]), bits(batch[:, 0])), r
        if r == 9:  # 72 rows: both warpgroups in one CTA or each in its own (split_rows, as this small grid runs)
            whole = run(q, kw, vw, par, keys, table, cache_len, tiles=dataclasses.replace(TILES, row_block=128))
            assert np.array_equal(bits(whole), bits(batch))
    small = kq.with_v_layout(window_case(rng, r=1, dtype=kq.FP8, **CASE)[4], "keys")  # 16-key pages
    assert "multiple of 64" in awm.unsupported(jnp.bfloat16, small, 2, chunk=128)


def test_row_bits_ignore_window_streams_table_width_and_stages(bf16_case):
    rng = np.random.default_rng(61)
    q, kw, vw, par, pool, table, cache_len = bf16_case.case
    batch = bf16_case.run()
    # Stream 3 alone, its table widened by 12 pages it never reaches (more chunk CTAs), 3 K/V stages (the default
    # with one compute warpgroup, the batch's) or 1.
    assert awm.stages_for(awm.WindowMgpuTiles(), 1) == 3
    wide = jnp.concatenate([table[3:4], scattered_tables(rng, 1, 12, 90)], axis=1)
    for stages in (None, 1):
        alone = run(q[3:4], kw[3:4], vw[3:4], par[3:4], pool, wide, cache_len[3:4],
                    tiles=dataclasses.replace(TILES, num_stages=stages))
        assert np.array_equal(bits(alone[0]), bits(batch[3])), stages
    # Other streams' queries, windows and contexts never leak into a row.
    moved = run(q.at[0].set(q[3]), kw.at[1].set(kw[0]), vw, par, pool, table, cache_len.at[0].set(9))
    assert np.array_equal(bits(moved[2]), bits(batch[2])) and np.array_equal(bits(moved[3]), bits(batch[3]))
    # The serial step: row 0 alone (a 1-row window, its own key the only window key it sees) has the bits row 0
    # of the drafted window has.
    step = run(q[:, :1], kw[:, :1], vw[:, :1], par[:, :1], pool, table, cache_len)
    assert np.array_equal(bits(step[:, 0]), bits(batch[:, 0]))


def test_short_chunks_are_the_fixed_chunks_they_pick(monkeypatch):
    """WindowTiles.short_chunk on the Mosaic GPU pass 1: with at most 2 chunks a stream (SHORT_CHUNKS patched), 37
    and 128 keys cut in 64-key chunks and 300 in 256-key ones; each row has the bits of its stream alone at that
    chunk fixed (through the fold pass or not)."""
    monkeypatch.setattr(at, "SHORT_CHUNKS", 2)
    rng = np.random.default_rng(67)
    q, kw, vw, par, pool, table, cache_len = window_case(rng, r=7, dtype=jnp.bfloat16, **CASE)
    tiles = dataclasses.replace(TILES, chunk=256, short_chunk=64)
    go = fresh_jit(window_call, static=("tiles", "interpret"))
    batch = go(q, kw, vw, par, pool, table, cache_len, tiles=tiles)
    assert rel_err(batch, np_window(q, kw, vw, par, pool, table, cache_len, SCALE)) < 1e-2
    for i, size in ((1, 64), (2, 64), (3, 256)):
        alone = go(q[i:i + 1], kw[i:i + 1], vw[i:i + 1], par[i:i + 1], pool, table[i:i + 1], cache_len[i:i + 1],
                   tiles=dataclasses.replace(tiles, chunk=size, short_chunk=None))
        assert np.array_equal(bits(alone[0]), bits(batch[i])), size


def test_two_compute_warpgroups_give_a_row_the_bits_of_one(bf16_two, monkeypatch):
    """72 packed rows (9 window rows x 8 query heads a KV head) run two compute warpgroups; each row's chunk
    partials have the bits the same query gets alone in a 1-row window (one warpgroup), and the window is right."""
    case = bf16_two.case
    q, kw, vw, par, pool, table, cache_len = case
    assert q.shape[1:3] == (9, 16) and awm.compute_warpgroups(9 * 8) == 2 and awm.compute_warpgroups(8) == 1
    assert rel_err(bf16_two.run(), np_window(*case, SCALE)) < 1e-2
    m9, l9, acc9 = bf16_two.partials()
    for r in (0, 8):  # rows 0-7 (warpgroup 0) and 64-71 (warpgroup 1)
        m1, l1, acc1 = partials(q[:, r:r + 1], pool, table, cache_len)
        for nine, one in ((m9, m1), (l9, l1), (acc9, acc1)):
            for a, b in zip(_live_rows(nine[:, :, :, 8 * r:], cache_len, 128, 8), _live_rows(one, cache_len, 128, 8)):
                assert np.array_equal(bits(a), bits(b)), r
    # Each warpgroup's rows in a CTA of its own (row_block 64, a launch choice): every written row the same bits.
    split = partials(q, pool, table, cache_len, tiles=dataclasses.replace(TILES, row_block=64))
    for got, want in zip(split, (m9, l9, acc9)):
        for a, b in zip(_live_rows(got, cache_len, 128, 72), _live_rows(want, cache_len, 128, 72)):
            assert np.array_equal(bits(a), bits(b))
    # The two warpgroups taking turns (ping-pong, a launch choice): the same bits.
    monkeypatch.setattr(awm, "PING_PONG", True)
    turns = fresh_jit(at.window_partials)(
        q, pool, table, cache_len, scale=SCALE, tiles=TILES, interpret=True)
    for got, want in zip(turns, (m9, l9, acc9)):
        for a, b in zip(_live_rows(got, cache_len, 128, 72), _live_rows(want, cache_len, 128, 72)):
            assert np.array_equal(bits(a), bits(b))


def test_pipeline_has_no_races(monkeypatch):
    """One compute warpgroup (2 stages); then two taking turns (ping-pong) and storing the CTA's rows from one."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    rng = np.random.default_rng(63)
    two = window_case(rng, r=9, dtype=jnp.bfloat16, **dict(CASE, hq=16, s=1, cache_lens=[300], parents=[TREE + [6, 7]]))
    monkeypatch.setattr(awm, "PING_PONG", True)
    at.window_partials(two[0], two[4], two[5], two[6], scale=SCALE, tiles=TILES,
                       interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not gpu_callbacks.get_races().races_found
    monkeypatch.setattr(awm, "PING_PONG", False)
    case = window_case(rng, r=3, dtype=jnp.bfloat16, **dict(CASE, s=2, cache_lens=[300, 37], parents=[TREE, CHAIN]))
    q, kw, vw, par, pool, table, cache_len = case
    m, l, acc = at.window_partials(q, pool, table, cache_len, scale=SCALE, tiles=dataclasses.replace(TILES, num_stages=2),
                                   interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not gpu_callbacks.get_races().races_found
    m_want, l_want, acc_want = partials(q, pool, table, cache_len)
    for got, want in ((m, m_want), (l, l_want), (acc, acc_want)):
        for a, b in zip(_live_rows(got, cache_len, 128, 6), _live_rows(want, cache_len, 128, 6)):
            assert np.array_equal(bits(a), bits(b))


def test_poison_outside_the_tables_never_leaks(bf16_case):
    """NaN keys and values in every page no table holds, the dummy page 0 included (blocks past a stream's
    context are never fetched), change no output bit."""
    q, kw, vw, par, pool, table, cache_len = bf16_case.case
    clean = bf16_case.run()
    live = np.concatenate([np.asarray(table[s, : -(-int(n) // 16)]) for s, n in enumerate(np.asarray(cache_len))])
    unused = np.setdiff1d(np.arange(pool.num_pages), live)
    poison = lambda x: x.at[:, unused].set(jnp.nan)
    dirty = run(q, kw, vw, par, kq.KVPool(poison(pool.k), poison(pool.v)), table, cache_len)
    assert np.array_equal(bits(dirty), bits(clean))


def test_routing_and_validation():
    rng = np.random.default_rng(65)
    f32 = window_case(rng, r=3, dtype=jnp.float32, **dict(CASE, s=2, cache_lens=[300, 37], parents=[TREE, CHAIN]))
    # fp32 pools keep the Triton pass 1 under impl="mgpu" (fp32 partials).
    triton = dataclasses.replace(TILES, impl="triton", partials="float32")
    assert np.array_equal(bits(run(*f32, tiles=dataclasses.replace(TILES, partials="float32"))),
                          bits(run(*f32, tiles=triton)))
    bf16 = window_case(rng, r=3, dtype=jnp.bfloat16, **dict(CASE, s=2, cache_lens=[300, 37], parents=[TREE, CHAIN]))
    with pytest.raises(ValueError, match="impl"):
        run(*bf16, tiles=dataclasses.replace(TILES, impl="cuda"))
    with pytest.raises(ValueError, match="tail"):
        at.window(*bf16, scale=SCALE, interpret=True, tiles=dataclasses.replace(TILES, tail="tickets"))
    with pytest.raises(ValueError, match="chunk"):
        at.window(*bf16, scale=SCALE, interpret=True, tiles=dataclasses.replace(TILES, chunk=96))
    packed = awm.pack_queries(bf16[0], bf16[4].k.shape[0])
    for bad in (packed[:, :, :16], packed.astype(jnp.float32)):  # q_packed as pack_queries lays it out, or an error
        with pytest.raises(ValueError, match="q_packed"):
            at.window(*bf16, scale=SCALE, interpret=True, tiles=TILES, q_packed=bad)
    small_d = window_case(rng, r=3, dtype=jnp.bfloat16, **dict(CASE, d=32, s=2, cache_lens=[30, 7],
                                                               parents=[TREE, CHAIN]))
    with pytest.raises(ValueError, match="head dim"):
        at.window(*small_d, scale=SCALE, interpret=True, tiles=dataclasses.replace(TILES, chunk=32))


def test_window_impl_follows_the_model_not_the_call(monkeypatch):
    """WINDOW_IMPL "auto": the Mosaic GPU pass 1 for a bf16 27B-shaped model compiled for a GPU (and, with FP8, for
    an fp8 pool with V key-major); the Triton one in interpret mode, for fp8 pools with V by rows, and for a model
    whose 16-row windows would not fit two compute warpgroups (the choice never looks at a call's rows)."""
    sds = jax.ShapeDtypeStruct
    bf16 = kq.KVPool(sds((4, 600, 64, 256), jnp.bfloat16), sds((4, 600, 64, 256), jnp.bfloat16))
    fp8 = kq.KVPool(sds((4, 600, 64, 256), kq.FP8), sds((4, 600, 64, 256), kq.FP8))
    shipped = at.window_tiles(page_size=64, max_keys=600 * 64, head_dim=256, fp8=False)
    assert at.window_impl(jnp.bfloat16, bf16, 24, shipped, interpret=False) == "mgpu"
    assert at.window_impl(jnp.bfloat16, bf16, 24, shipped, interpret=True) == "triton"
    fp8_keys = kq.KVPool(fp8.k, sds((4, 600, 256, 64), kq.FP8), v_layout="keys")  # (KVPool.v_layout "keys")
    assert awm.unsupported(jnp.bfloat16, fp8_keys, 6, chunk=awm.CHUNK) is None
    assert at.window_impl(jnp.bfloat16, fp8, 24, shipped, interpret=False) == "triton"
    assert at.window_impl(jnp.bfloat16, fp8_keys, 24, shipped, interpret=False) == ("mgpu" if awm.FP8 else "triton")
    assert at.window_impl(jnp.bfloat16, bf16, 64, shipped, interpret=False) == "triton"  # 16 heads a KV head
    monkeypatch.setattr(awm, "FP8", True)  # fp8 pools with V key-major on the e4m3 pass 1 under "auto" ...
    assert at.window_impl(jnp.bfloat16, fp8_keys, 24, shipped, interpret=False) == "mgpu"
    assert at.window_impl(jnp.bfloat16, fp8_keys, 24, shipped, interpret=True) == "triton"
    assert at.window_impl(jnp.bfloat16, fp8, 24, shipped, interpret=False) == "triton"  # ... never the dequantizing
    monkeypatch.setattr(awm, "FP8", False)
    # A model's tiles: the Mosaic GPU pass 1 at its own chunk and partials; the Triton one at window_tiles' chunk
    # (fp32 partials).
    monkeypatch.setattr(awm, "CHUNK", 2048)
    assert at.model_window_tiles(jnp.bfloat16, bf16, 24, max_keys=600 * 64, interpret=False) == dataclasses.replace(
        shipped, impl="mgpu", chunk=2048, partials=awm.PARTIALS)
    assert at.model_window_tiles(jnp.bfloat16, fp8, 24, max_keys=600 * 64, interpret=False) == dataclasses.replace(
        at.window_tiles(page_size=64, max_keys=600 * 64, head_dim=256, fp8=True), impl="triton")
    monkeypatch.setattr(awm, "FP8", True)
    assert at.model_window_tiles(jnp.bfloat16, fp8_keys, 24, max_keys=600 * 64, interpret=False) == (
        dataclasses.replace(at.window_tiles(page_size=64, max_keys=600 * 64, head_dim=256, fp8=True), impl="mgpu",
                            chunk=2048, partials=awm.PARTIALS))
    monkeypatch.setattr(awm, "FP8", False)
    monkeypatch.setattr(at, "WINDOW_IMPL", "triton")
    assert at.window_impl(jnp.bfloat16, bf16, 24, shipped, interpret=False) == "triton"
    monkeypatch.setattr(at, "WINDOW_IMPL", "fast")
    with pytest.raises(ValueError, match="WINDOW_IMPL"):
        at.window_impl(jnp.bfloat16, bf16, 24, shipped, interpret=False)


def test_rows_split_on_small_grids_only():
    """split_rows (a launch choice): row_block as set; None splits a two-warpgroup window whose grid (streams x KV
    heads x table chunks) is at most SPLIT_MAX_CTAS CTAs, never a one-warpgroup window."""
    sds = jax.ShapeDtypeStruct
    pool = kq.KVPool(sds((4, 600, 64, 256), jnp.bfloat16), sds((4, 600, 64, 256), jnp.bfloat16))
    tiles = dataclasses.replace(at.window_tiles(page_size=64, max_keys=600 * 64, head_dim=256, fp8=False),
                                impl="mgpu", chunk=1024)

    def split(streams, rows, table_pages, **change):
        q = sds((streams, rows, 24, 256), jnp.bfloat16)
        one = at._pass_one(q, pool, jnp.zeros((streams, table_pages), jnp.int32), tiles)
        return at._split_rows(dataclasses.replace(tiles, **change), one, streams, 4)

    cap = awm.SPLIT_MAX_CTAS
    assert split(1, 16, 64)  # 4 chunks x 4 heads
    assert split(1, 16, cap // 4 * 16)  # cap CTAs
    assert not split(1, 16, cap // 4 * 16 + 1)  # one chunk more a head
    assert not split(16, 16, 64)  # 16 streams x 16 CTAs
    assert not split(1, 8, 64)  # 48 packed rows: one warpgroup
    assert split(16, 16, 64, row_block=64) and not split(1, 16, 64, row_block=128)


# ---------------------------------------------------------------------------------------------------------------
# 27B shape: lowered for sm_90 on the CPU; compiled on the H200 (-m gpu)
# ---------------------------------------------------------------------------------------------------------------

def _mosaic_calls_at_27b(rows: int, *, fp8: bool = False, page: int = 64, v_keys: bool = False, **change) -> int:
    """`custom_call @mosaic_gpu`s in a window call of `rows` rows lowered for sm_90 on this CPU at the 27B shape
    (2 streams, tables of 36864 keys), its tiles the Mosaic GPU pass 1's with `change`; a bf16 or fp8 pool of
    `page`-key pages (v_keys: fp8, V key-major)."""
    sds = jax.ShapeDtypeStruct
    pages = 600 * 64 // page
    if fp8:
        pool = kq.KVPool(sds((4, pages, page, 256), kq.FP8),
                         sds((4, pages, 256, page) if v_keys else (4, pages, page, 256), kq.FP8),
                         sds((4, pages, page), jnp.float32), sds((4, pages, page), jnp.float32),
                         "keys" if v_keys else "rows")
    else:
        pool = kq.KVPool(sds((4, pages, page, 256), jnp.bfloat16), sds((4, pages, page, 256), jnp.bfloat16))
    tiles = dataclasses.replace(at.window_tiles(page_size=page, max_keys=576 * 64, head_dim=256, fp8=fp8),
                                impl="mgpu", **change)
    args = (sds((2, rows, 24, 256), jnp.bfloat16), sds((2, rows, 4, 256), jnp.bfloat16),
            sds((2, rows, 4, 256), jnp.bfloat16), sds((2, rows), jnp.int32), pool,
            sds((2, 576 * 64 // page), jnp.int32), sds((2,), jnp.int32))
    fn = functools.partial(at.window, scale=1 / 16, tiles=tiles)
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text().count("custom_call @mosaic_gpu")


@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("stages", [None, 1])
def test_lowers_for_sm90_at_27b_shape(rows, stages, h200_lowering):
    """jax's lowering for CUDA on this CPU (Mosaic GPU's layout inference and dialect lowering for sm_90, shared
    memory included; the fold and merge through Triton): one and two compute warpgroups, 1 or the default stages."""
    assert _mosaic_calls_at_27b(rows, num_stages=stages) == 1


def test_window_rows_lower_for_sm90_at_27b_shape(h200_lowering, monkeypatch):
    """`attention.window_rows` (16 rows, the model's tiles) lowers for sm_90 on this CPU: the shared R-row pass 1 and
    the rows' pass 1 from F on (both with the chunk size passed apart, `sized`), and the one-row calls of the
    straddle branch: three Mosaic GPU calls."""
    monkeypatch.setattr(at, "SHARED_ROWS", True)
    sds = jax.ShapeDtypeStruct
    pages, rows = 577, 16
    pool = kq.KVPool(sds((4, pages, 64, 256), jnp.bfloat16), sds((4, pages, 64, 256), jnp.bfloat16))
    tiles = dataclasses.replace(at.window_tiles(page_size=64, max_keys=576 * 64, head_dim=256, fp8=False),
                                impl="mgpu", chunk=awm.CHUNK, partials=awm.PARTIALS)
    args = (sds((1, rows, 24, 256), jnp.bfloat16), sds((1, rows, 4, 256), jnp.bfloat16),
            sds((1, rows, 4, 256), jnp.bfloat16), pool, sds((1, 576), jnp.int32), sds((rows, 576), jnp.int32),
            sds((1, rows), jnp.int32), sds((1,), jnp.int32))
    fn = functools.partial(at.window_rows, scale=1 / 16, tiles=tiles)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 3


@pytest.mark.parametrize("variant", ["split", "ping_pong", "chunk 2048", "fp32 partials", "bf16 partials",
                                     "bf16 partials split", "bf16 partials 1 row", "fp8", "fp8 1 row",
                                     "fp8 16-key pages", "fp8 fp32 partials", "fp8 8-bit dequant", "fp8 e4m3",
                                     "fp8 e4m3 1 row", "fp8 e4m3 fp32 partials", "fp8 e4m3 split"])
def test_variants_lower_for_sm90_at_27b_shape(variant, h200_lowering, monkeypatch):
    """The 16-row window's launch variants (a CTA a warpgroup, two warpgroups taking turns), a 2048-key chunk and
    either partials dtype, and fp8 pools (64- and 16-key pages, V by rows and key-major) lower for sm_90 at the 27B
    shape."""
    monkeypatch.setattr(awm, "PING_PONG", variant == "ping_pong")
    monkeypatch.setattr(awm, "DEQUANT", "wgmma_8bit" if "8-bit" in variant else "wgmma")
    monkeypatch.setattr(awm._PARTIALS, "lowered", {})
    partials = {"fp32 partials": "float32"}.get(variant, "bfloat16" if "bf16" in variant else awm.PARTIALS)
    if variant in ("fp8 fp32 partials", "fp8 e4m3 fp32 partials"):
        partials = "float32"
    assert _mosaic_calls_at_27b(1 if "1 row" in variant else 16, fp8="fp8" in variant,
                                page=16 if "16-key" in variant else 64, v_keys="e4m3" in variant,
                                row_block=64 if "split" in variant else None,
                                chunk=2048 if variant == "chunk 2048" else awm.CHUNK, partials=partials) == 1


def _gpu_case(rng, rows, cache_lens, pmax, dtype=jnp.bfloat16):
    tree16 = TREE + list(range(6, 15))
    return window_case(rng, r=rows, dtype=dtype,
                       **dict(BIG, s=len(cache_lens), pmax=pmax, num_pages=len(cache_lens) * pmax + 1,
                              cache_lens=cache_lens,
                              parents=([tree16, list(range(-1, 15))] * len(cache_lens))[:len(cache_lens)]))


def _rows_bits_equal(case, tiles, interpret) -> None:
    got, want = window_rows_and_one_row_windows(case, scale=case[0].shape[-1] ** -0.5, tiles=tiles,
                                                interpret=interpret)
    live = np.asarray(case[6]).reshape(-1) > 0
    n = got.shape[0] * got.shape[1]
    assert np.array_equal(bits(got.reshape(n, -1)[live]), bits(want.reshape(n, -1)[live]))


def test_window_rows_are_one_row_windows_mgpu(monkeypatch):
    """`attention.window_rows` on the Mosaic GPU pass 1 (interpreted): the 4-row windows of a tree over 300 keys
    (two shared 128-key chunks, the fold pass after them) and of a chain inside its first chunk, each row the bits
    of its own one-row window; a row's partials do not depend on the rows packed beside it."""
    monkeypatch.setattr(at, "SHARED_ROWS", True)
    rng = np.random.default_rng(32)
    case = rows_case(rng, lens=[300, 70], r=4, **SMALL, pmax=24, dtype=jnp.bfloat16, trees=True)
    assert rows_share_chunks(TILES, case[6], case[7], 24 * SMALL["page_size"]) == [True, False]
    _rows_bits_equal(case, TILES, True)


@GPU
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("trees", [False, True], ids=["chains", "trees"])
def test_gpu_27b_window_rows(kv, trees, monkeypatch):
    """`attention.window_rows` at the 27B's shape with the model's tiles (Mosaic GPU pass 1 for bf16, Triton for
    fp8 key-major): 16-row windows over 5000, 1111 and 300 keys (shared chunks of 1024, 256 and 128 keys), every row
    the bits of its own one-row window; then a window straddling the 1024-key threshold."""
    monkeypatch.setattr(at, "SHARED_ROWS", True)
    rng = np.random.default_rng(33)
    dtype = jnp.bfloat16 if kv == "bf16" else kq.FP8
    for lens, paths in (([5000, 1111, 300], [True, True, True]), ([1020], [None])):
        case = rows_case(rng, lens=lens, r=16, **BIG, pmax=96, dtype=dtype, trees=trees)
        tiles = at.model_window_tiles(jnp.bfloat16, case[3], BIG["hq"], max_keys=96 * 64, interpret=False)
        assert rows_share_chunks(tiles, case[6], case[7], 96 * 64) == paths
        _rows_bits_equal(case, tiles, False)


@GPU
def test_gpu_27b_windows(monkeypatch):
    """16-row trees and chains at 5000 / 1111 / 64 keys: right against float64; the 1-row step of each row-0 query
    has row 0's bits; a stream alone (and its table widened) the same bits; 1 and 3 stages, a CTA a warpgroup, both
    warpgroups in one CTA and the warpgroups taking turns the default's bits."""
    rng = np.random.default_rng(70)
    case = _gpu_case(rng, 16, [5000, 1111, 64], 80)
    q, kw, vw, par, pool, table, cache_len = case
    shipped = at.model_window_tiles(jnp.bfloat16, pool, 24, max_keys=80 * 64, interpret=False)
    assert shipped.impl == "mgpu"
    got = run(*case, tiles=shipped, interpret=False)
    assert rel_err(got, np_window(*case, SCALE)) < 1e-2
    step = run(q[:, :1], kw[:, :1], vw[:, :1], par[:, :1], pool, table, cache_len, tiles=shipped, interpret=False)
    assert np.array_equal(bits(step[:, 0]), bits(got[:, 0]))
    wide = jnp.concatenate([table[1:2], jnp.zeros((1, 40), jnp.int32)], axis=1)
    for stages in (None, 1):
        alone = run(q[1:2], kw[1:2], vw[1:2], par[1:2], pool, wide, cache_len[1:2],
                    tiles=dataclasses.replace(shipped, num_stages=stages), interpret=False)
        assert np.array_equal(bits(alone[0]), bits(got[1])), stages
    for rb in (64, 128):  # a CTA a warpgroup, both warpgroups in one CTA (the shipped rule splits this grid)
        other = run(*case, tiles=dataclasses.replace(shipped, row_block=rb), interpret=False)
        assert np.array_equal(bits(other), bits(got)), rb
    monkeypatch.setattr(awm, "PING_PONG", True)  # read at tracing: `fresh_jit`
    turns = fresh_jit(at.window)(
        *case, scale=SCALE, interpret=False, tiles=shipped)
    assert np.array_equal(bits(turns), bits(got))


@GPU
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_gpu_27b_short_chunks(kv):
    """The model's tiles at the 27B shape over a 32K-key table (chunk 1024 for Mosaic GPU bf16 pools, 512 for the
    Triton fp8 pass 1; short contexts in chunks of 128 and up): 1- and 16-row windows of 1000, 2500, 4000, 7000
    and 30000 keys, each stream right against float64 and with the bits of itself alone at the chunk its context
    picks, fixed for the call."""
    rng = np.random.default_rng(72)
    lens = [1000, 2500, 4000, 7000, 30000]
    for r in (1, 16):
        case = _gpu_case(rng, r, lens, 512, kq.FP8 if kv == "fp8" else jnp.bfloat16)
        q, kw, vw, par, pool, table, cache_len = case
        shipped = at.model_window_tiles(jnp.bfloat16, pool, 24, max_keys=512 * 64, interpret=False)
        assert shipped.short_chunk == at.SHORT_CHUNK and shipped.impl == ("mgpu" if kv == "bf16" else "triton")
        got = run(*case, tiles=shipped, interpret=False)
        assert rel_err(got, np_window(*case, SCALE)) < 1e-2
        for i, n in enumerate(lens):
            size = 128
            while size < shipped.chunk and n > at.SHORT_CHUNKS * size:
                size *= 2
            alone = run(q[i:i + 1], kw[i:i + 1], vw[i:i + 1], par[i:i + 1], pool, table[i:i + 1],
                        cache_len[i:i + 1], tiles=dataclasses.replace(shipped, chunk=size, short_chunk=None),
                        interpret=False)
            assert np.array_equal(bits(alone[0]), bits(got[i])), (kv, r, n, size)


@GPU
def test_gpu_27b_bf16_partials_are_the_fp32_ones_rounded():
    """On the H200 at the 27B shape: bf16 O partials are the fp32 partials rounded once (1-row and 16-row windows,
    both warpgroups in one CTA and a CTA a warpgroup), m and l the same bits, the window right against float64."""
    rng = np.random.default_rng(72)
    case = _gpu_case(rng, 16, [5000, 1111, 64], 80)
    q, kw, vw, par, pool, table, cache_len = case
    base = dataclasses.replace(at.model_window_tiles(jnp.bfloat16, pool, 24, max_keys=80 * 64, interpret=False),
                               impl="mgpu")
    for rows, rb in ((1, None), (16, 64), (16, 128)):
        t32, t16 = (dataclasses.replace(base, partials=p, row_block=rb) for p in ("float32", "bfloat16"))
        (m32, l32, a32), (m16, l16, a16) = (partials(q[:, :rows], pool, table, cache_len, tiles=t, interpret=False)
                                            for t in (t32, t16))
        for got, want in ((m16, m32), (l16, l32), (a16, a32.astype(jnp.bfloat16))):
            for a, b in zip(_live_rows(got, cache_len, base.chunk, rows * 6),
                            _live_rows(want, cache_len, base.chunk, rows * 6)):
                assert np.array_equal(bits(a), bits(b)), (rows, rb)
    got = run(*case, tiles=dataclasses.replace(base, partials="bfloat16"), interpret=False)
    assert rel_err(got, np_window(*case, SCALE)) < 1e-2


@GPU
def test_gpu_27b_fp8_keys_major_e4m3():
    """On the H200 at the 27B shape: an fp8 pool with v key-major on the Mosaic GPU pass 1 (both MMAs on the e4m3
    codes; 1- and 16-row windows): right against float64 and within the Triton fp8 window's distance of it; the
    1-row step has row 0's bits, a stream alone its bits among others, and 1 K/V stage the default's."""
    rng = np.random.default_rng(74)
    case = _gpu_case(rng, 16, [5000, 1111, 64], 80, dtype=kq.FP8)
    q, kw, vw, par, pool, table, cache_len = case
    keys = kq.with_v_layout(pool, "keys")
    base = dataclasses.replace(at.model_window_tiles(jnp.bfloat16, keys, 24, max_keys=80 * 64, interpret=False),
                               impl="mgpu", partials="bfloat16")
    got = run(q, kw, vw, par, keys, table, cache_len, tiles=base, interpret=False)
    want = np_window(*case, SCALE)
    triton = run(*case, tiles=at.window_tiles(page_size=64, max_keys=80 * 64, head_dim=256, fp8=True),
                 interpret=False)
    assert rel_err(got, want) < 1e-2
    assert rel_err(got, want) < 2 * max(rel_err(triton, want), 1e-3)
    step = run(q[:, :1], kw[:, :1], vw[:, :1], par[:, :1], keys, table, cache_len, tiles=base, interpret=False)
    assert np.array_equal(bits(step[:, 0]), bits(got[:, 0]))
    alone = run(q[1:2], kw[1:2], vw[1:2], par[1:2], keys, table[1:2], cache_len[1:2], tiles=base, interpret=False)
    assert np.array_equal(bits(alone[0]), bits(got[1]))
    one_stage = run(q, kw, vw, par, keys, table, cache_len, tiles=dataclasses.replace(base, num_stages=1),
                    interpret=False)
    assert np.array_equal(bits(one_stage), bits(got))


@GPU
def test_gpu_27b_fp8_pool(monkeypatch):
    """On the H200 at the 27B shape: an fp8 pool on the Mosaic GPU pass 1 gives, bit for bit, the bf16 pass 1's
    partials over its dequantized keys (1- and 16-row windows), a window right against float64 and the Triton fp8
    window, and the 1-row step row 0's bits; the codes dequantized in the MMA's layout the same bits."""
    rng = np.random.default_rng(73)
    case = _gpu_case(rng, 16, [5000, 1111, 64], 80, dtype=kq.FP8)
    q, kw, vw, par, pool, table, cache_len = case
    assert pool.fp8
    base = dataclasses.replace(at.model_window_tiles(jnp.bfloat16, pool, 24, max_keys=80 * 64, interpret=False),
                               impl="mgpu")
    for rows in (1, 16):
        got = partials(q[:, :rows], pool, table, cache_len, tiles=base, interpret=False)
        want = partials(q[:, :rows], dequantized_pool(pool), table, cache_len,
                        tiles=dataclasses.replace(base, row_block=64), interpret=False)
        for a_all, b_all in zip(got, want):
            for a, b in zip(_live_rows(a_all, cache_len, base.chunk, rows * 6),
                            _live_rows(b_all, cache_len, base.chunk, rows * 6)):
                assert np.array_equal(bits(a), bits(b)), rows
    got = run(*case, tiles=base, interpret=False)
    want = np_window(*case, SCALE)
    assert rel_err(got, want) < 1e-2
    triton = run(*case, tiles=at.window_tiles(page_size=64, max_keys=80 * 64, head_dim=256, fp8=True),
                 interpret=False)
    assert rel_err(got, np.asarray(triton.astype(jnp.float32), np.float64)) < 1e-2
    # The 1-row step has row 0's bits, with the model's fp8 dots (f16 again since session 21, once `_pv` took each
    # row's V-scale max over the keys it sees; the per-block max had made them differ, run.sh eightieth).
    step = run(q[:, :1], kw[:, :1], vw[:, :1], par[:, :1], pool, table, cache_len, tiles=base, interpret=False)
    assert np.array_equal(bits(step[:, 0]), bits(got[:, 0]))
    # The codes dequantized in the MMA's layout instead of the 8-bit operand layout (DEQUANT, a launch choice, the
    # 8-bit one shipped since session 21): the same bits. (Until session 26 this set the shipped value.)
    assert awm.DEQUANT == "wgmma_8bit"
    monkeypatch.setattr(awm, "DEQUANT", "wgmma")  # read at tracing: `fresh_jit`
    mma_layout = fresh_jit(at.window)(*case, scale=SCALE, interpret=False, tiles=base)
    assert np.array_equal(bits(mma_layout), bits(got))


@GPU
@pytest.mark.parametrize("chunk", [512, 1024, 2048])
def test_gpu_27b_long_context_through_the_fold_pass(chunk):
    """32K keys (the fold pass) beside a 700-key stream, 1- and 4-row windows, at each chunk: right against the
    Triton pass 1 (fp32 sums either way) and float64."""
    rng = np.random.default_rng(71)
    case = _gpu_case(rng, 4, [32768, 700], 520)
    shipped = at.window_tiles(page_size=64, max_keys=520 * 64, head_dim=256, fp8=False)
    got = run(*case, tiles=dataclasses.replace(shipped, impl="mgpu", chunk=chunk), interpret=False)
    triton = run(*case, tiles=shipped, interpret=False)
    want = np_window(*case, SCALE)
    assert rel_err(got, want) < 1e-2 and rel_err(triton, want) < 1e-2
    assert rel_err(got, np.asarray(triton.astype(jnp.float32), np.float64)) < 1e-2


def test_lowering_cache_shares_the_kernel_across_programs(h200_lowering, monkeypatch):
    """Two programs holding the same window call (one alone, one after other work) carry the same Mosaic GPU kernel
    hash (`mgpu_lowering`: lowered once a process, so compiled once), and the cache holds one entry a shape."""
    import re
    monkeypatch.setattr(awm._PARTIALS, "lowered", {})
    sds = jax.ShapeDtypeStruct
    pool = kq.KVPool(sds((4, 600, 64, 256), jnp.bfloat16), sds((4, 600, 64, 256), jnp.bfloat16))
    tiles = at.WindowTiles(impl="mgpu")
    args = (sds((2, 4, 24, 256), jnp.bfloat16), sds((2, 4, 4, 256), jnp.bfloat16), sds((2, 4, 4, 256), jnp.bfloat16),
            sds((2, 4), jnp.int32), pool, sds((2, 576), jnp.int32), sds((2,), jnp.int32))
    alone = lambda q, kw, vw, *rest: at.window(q, kw, vw, *rest, scale=1 / 16, tiles=tiles)
    after = lambda q, kw, vw, *rest: at.window(jnp.sin(q), kw * 2, vw, *rest, scale=1 / 16, tiles=tiles)
    hashes = [set(re.findall(r'kernel_hash = "([^"]*)"',
                             jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()))
              for f in (alone, after)]
    assert len(hashes[0]) == 1 and hashes[0] == hashes[1]
    assert len(awm._PARTIALS.lowered) == 1
