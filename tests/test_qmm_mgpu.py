"""The experimental Mosaic GPU decode qmm (`pallas_kernels/qmm_mgpu.py`): it lowers for an H200 on the CPU at the
27B's decode shapes and runs in Mosaic GPU's interpreter at small ones; the compiled kernel's numbers and row
invariance are checked on the device (`-m gpu`)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import qmm_mgpu
from pallas_kernels.qweight import (QuantizedWeight, dequantize_numpy, from_lane_words, natural_words,
                                    to_lane_words)
from tests.test_qmm import HALF_TOL

SHAPES_27B = ((5120, 34816), (17408, 5120), (5120, 6144), (6144, 5120), (5120, 16480), (5120, 248320))


def _abstract_weight(n: int, k: int, bits: int = 4, group: int = 64, scale_dtype=jnp.bfloat16):
    sds = jax.ShapeDtypeStruct
    return QuantizedWeight(sds((n, k * bits // 32), jnp.uint32), sds((n, k // group), scale_dtype),
                           sds((n, k // group), scale_dtype), bits, group)


def test_lowers_for_the_h200_at_27b_shapes():
    """Mosaic GPU's layout inference and dialect lowering run in Python at lowering time, so a layout the
    uint4 -> bf16 register conversion, the register-A wgmma or the epilogue's broadcasts cannot take fails here."""
    sds = jax.ShapeDtypeStruct
    for k, n in SHAPES_27B:
        for m in (1, 16):
            text = jax.jit(qmm_mgpu.qmm_decode).trace(sds((m, k), jnp.bfloat16), _abstract_weight(n, k)).lower(
                lowering_platforms=("cuda",)).as_text()
            assert "mosaic_gpu" in text, (k, n, m)


def test_schedule_from_the_shape():
    """The chunks cover every step of every tile once, need at most SMS CTAs, are as short as that allows, and
    each tile's pieces are the chunks that touch it; block_groups_for halves to a divisor of K's groups."""
    for k, n in SHAPES_27B + ((512, 200), (1024, 392)):
        for sms in (qmm_mgpu.SMS, 3):
            bg = qmm_mgpu.block_groups_for(k)
            length, per_cta, ctas, counts = qmm_mgpu.flat_schedule(n, k, bg, sms)
            tiles = -(-n // qmm_mgpu.CTA_N)
            total = tiles * length
            assert length == k // 64 // bg and ctas <= sms and per_cta * ctas >= total > per_cta * (ctas - 1)
            assert per_cta == -(-total // sms)
            touching = [len({f // per_cta for f in range(t * length, (t + 1) * length)}) for t in range(tiles)]
            np.testing.assert_array_equal(counts, touching)
    assert qmm_mgpu.block_groups_for(5120) == 4 and qmm_mgpu.block_groups_for(64 * 6) == 2
    assert qmm_mgpu.block_groups_for(64 * 5) == 1


def test_bad_inputs_are_value_errors():
    sds = jax.ShapeDtypeStruct
    cases = [(sds((1, 512), jnp.bfloat16), _abstract_weight(256, 512, bits=8), "4-bit"),
             (sds((1, 512), jnp.bfloat16), _abstract_weight(256, 512, group=32), "group 64"),
             (sds((1, 512), jnp.bfloat16), _abstract_weight(256, 512, scale_dtype=jnp.float16), "bf16 scales"),
             (sds((17, 512), jnp.bfloat16), _abstract_weight(256, 512), "M <= 16"),
             (sds((1, 512), jnp.float32), _abstract_weight(256, 512), "bf16"),
             (sds((1, 512), jnp.bfloat16), _abstract_weight(196, 512), "multiple of 8")]
    for x, w, match in cases:
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(qmm_mgpu.qmm_decode, x, w)
    with pytest.raises(ValueError, match="block_groups"):
        jax.eval_shape(lambda x, w: qmm_mgpu.qmm_decode(x, w, block_groups=3), sds((1, 512), jnp.bfloat16),
                       _abstract_weight(256, 512))


def _check_oracle_and_rows(n: int, k: int, *, interpret: bool, rows=(0, 5, 15), **kw):
    """Against the float64 oracle (relative error of bf16 output size), and row i alone == row i among 16, bit
    for bit, and == with the other rows changed."""
    rng = np.random.default_rng(3100 + n + k)
    words = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
    scales = jnp.asarray(rng.uniform(0.002, 0.02, size=(n, k // 64)), jnp.bfloat16)
    biases = (-8.0 * scales.astype(jnp.float32)
              + jnp.asarray(rng.normal(size=(n, k // 64)) * 1e-3)).astype(jnp.bfloat16)
    w = QuantizedWeight(jnp.asarray(words), scales, biases, 4, 64)
    oracle = dequantize_numpy(words, np.asarray(scales.astype(jnp.float32), np.float64),
                              np.asarray(biases.astype(jnp.float32), np.float64), 4, 64)
    run = jax.jit(lambda x, w: qmm_mgpu.qmm_decode(x, w, interpret=interpret, **kw))
    x = jnp.asarray(rng.normal(size=(16, k)), jnp.bfloat16)
    y = run(x, w)
    want = np.asarray(x.astype(jnp.float32), np.float64) @ oracle.T
    got = np.asarray(y.astype(jnp.float32), np.float64)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < HALF_TOL, err
    bits = np.asarray(y).view(np.uint16)
    for i in rows:
        np.testing.assert_array_equal(np.asarray(run(x[i:i + 1], w)).view(np.uint16)[0], bits[i],
                                      err_msg=f"row {i} alone")
    other = x.at[1:].set(jnp.asarray(rng.normal(size=(15, k)), jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(run(other, w)).view(np.uint16)[0], bits[0], err_msg="other rows")


@pytest.mark.parametrize("n,k,sms,conversion", [(256, 512, None, "words"), (200, 512, None, "words"),
                                               (200, 1024, 3, "words"), (200, 1024, 3, "unsigned"),
                                               (384, 512, 2, "nibbles"), (384, 512, 4, "words"),
                                               (256, 384, None, "words")])
def test_interpreter_matches_oracle_and_rows_are_invariant(n, k, sms, conversion, monkeypatch):
    """Mosaic GPU's interpreter on the CPU runs the whole kernel -- pipeline, scale and bias rows, the stores, a
    last tile past N (200 = 1.56 tiles), chunks of steps crossing tile edges (a tile's K summed in pieces by two or
    three CTAs, pieces a tile lacks selected away), a last chunk shorter than the others, steps of 2 groups (K =
    384), the three conversions (the lane words through their jnp twin) -- with the dequantized tiles in shared
    memory (its wgmma reads A only from there)."""
    if sms is not None:
        monkeypatch.setattr(qmm_mgpu, "SMS", sms)
    _check_oracle_and_rows(n, k, interpret=True, rows=(0, 15), conversion=conversion)


@pytest.mark.gpu
@pytest.mark.parametrize("conversion", qmm_mgpu.CONVERSIONS)
@pytest.mark.parametrize("k,n", [(5120, 6144), (17408, 5120), (5120, 16480), (128, 512), (128, 392), (256, 128)])
def test_gpu_matches_oracle_and_rows_are_invariant(k, n, conversion):
    # the last three: the tiny captures checkpoint's projections (one step a tile, a ragged last tile)
    _check_oracle_and_rows(n, k, interpret=False, conversion=conversion)


def test_lane_words_hold_each_lanes_pairs():
    """`to_lane_words` is a byte permutation inside each group of 8 words with `from_lane_words` its inverse, and
    lane q's words 2q, 2q + 1 of a group hold, field by field, the columns 2q + 8t and 2q + 8t + 1 (t = 0..7) that
    the MMA's register layout gives that lane, in order."""
    rng = np.random.default_rng(3700)
    words = rng.integers(0, 2**32, size=(5, 24), dtype=np.uint32)
    lanes = np.asarray(to_lane_words(jnp.asarray(words)))
    np.testing.assert_array_equal(np.asarray(from_lane_words(jnp.asarray(lanes))), words)
    np.testing.assert_array_equal(np.sort(lanes.view(np.uint8).reshape(5, 3, 32)),
                                  np.sort(words.view(np.uint8).reshape(5, 3, 32)))
    field = lambda w, i: (w >> np.uint32(4 * i)) & np.uint32(15)
    for g in range(3):
        for q in range(4):
            for t in range(8):
                for e in range(2):
                    col = 64 * g + 8 * t + 2 * q + e
                    np.testing.assert_array_equal(field(lanes[:, 8 * g + 2 * q + t // 4], (2 * t + e) % 8),
                                                  field(words[:, col // 8], col % 8), err_msg=(g, q, t, e))


def _rounded_once(n: int, k: int, *, interpret: bool):
    """The "words" conversion's A tiles are s q + b rounded once to bf16 (the dequant pass's weights): the kernel's
    output against x @ those weights in float64 is within one bf16 ulp everywhere and equal at nearly every
    element (only the fp32 accumulation's order separates them)."""
    from pallas_kernels import qmm
    rng = np.random.default_rng(3800 + k)
    w = _small_weight(rng, n, k)
    x = jnp.asarray(rng.normal(size=(16, k)), jnp.bfloat16)
    weights = np.asarray(qmm.dequantize_for_matmul(w, jnp.bfloat16).astype(jnp.float32), np.float64)
    want = (np.asarray(x.astype(jnp.float32), np.float64) @ weights.T).astype(np.float32)
    want_bf16 = np.asarray(jnp.asarray(want).astype(jnp.bfloat16).astype(jnp.float32))
    got = np.asarray(qmm_mgpu.qmm_decode(x, w, interpret=interpret, conversion="words").astype(jnp.float32))
    ulp = np.abs(want_bf16) * 2.0**-7 + 1e-6 * np.abs(want).max()
    assert np.all(np.abs(got - want_bf16) <= ulp), np.max(np.abs(got - want_bf16) / ulp)
    same = np.mean(got == want_bf16)
    assert same > 0.97, same


def test_interpreter_words_conversion_rounds_once():
    _rounded_once(256, 512, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(5120, 6144), (17408, 5120)])
def test_gpu_words_conversion_rounds_once(k, n):
    _rounded_once(n, k, interpret=False)


def _wide_pieces_same_bits(n: int, k: int, rows: int, *, interpret: bool):
    """Every row of a `rows`-row piece (8, 32 or 64) has the bits it has in a 16-row piece (alone or among 16): the
    pieces differ only in the MMA's N."""
    rng = np.random.default_rng(3600 + rows)
    w = _small_weight(rng, n, k)
    x = jnp.asarray(rng.normal(size=(rows, k)), jnp.bfloat16)
    wide = np.asarray(jax.jit(lambda x, w: qmm_mgpu.qmm_decode(x, w, interpret=interpret, rows=rows))(x, w))
    narrow = jax.jit(lambda x, w: qmm_mgpu.qmm_decode(x, w, interpret=interpret))
    for i in range(0, rows, 16):
        np.testing.assert_array_equal(np.asarray(narrow(x[i:i + 16], w)).view(np.uint16),
                                      wide[i:i + 16].view(np.uint16), err_msg=f"rows {i}..{i + 15}")
    np.testing.assert_array_equal(np.asarray(narrow(x[rows - 1:], w)).view(np.uint16)[0],
                                  wide[rows - 1].view(np.uint16), err_msg="last row alone")
    return w, x, wide


@pytest.mark.parametrize("rows", [32, 64])
def test_interpreter_wide_pieces_same_bits(rows):
    """Also that qmm_rows, cutting 16 + rows rows into pieces (one of 64, or 64 and 16 at the default WIDE_ROWS), gives
    every row the bits of its 16-row piece."""
    w, x, wide = _wide_pieces_same_bits(256, 512, rows, interpret=True)
    xs = jnp.concatenate([x, x[:16]])
    assert qmm_mgpu.pieces(xs.shape[0]) == {32: (64,), 64: (64, 16)}[rows]
    got = np.asarray(qmm_mgpu.qmm_rows(xs, w, interpret=True))
    np.testing.assert_array_equal(got.view(np.uint16), np.concatenate([wide, wide[:16]]).view(np.uint16))


def test_piece_policy(monkeypatch):
    """Pieces of WIDE_ROWS (64) while more is left, then the least height, NARROW_ROWS (8) or more, that holds the
    rest; 16-row pieces only where WIDE_ROWS is None; a WIDE_ROWS the kernel does not take and a piece height out of
    PIECE_ROWS are ValueErrors; 64-row pieces run 3 stages (shared memory), the others as asked."""
    assert qmm_mgpu.WIDE_ROWS == 64 and qmm_mgpu.NARROW_ROWS == 8
    cases = {1: (8,), 8: (8,), 9: (16,), 16: (16,), 17: (32,), 32: (32,), 33: (64,), 64: (64,), 65: (64, 8),
             73: (64, 16), 100: (64, 64), 256: (64,) * 4, 257: (64,) * 4 + (8,), 0: ()}
    assert {m: qmm_mgpu.pieces(m) for m in cases} == cases
    monkeypatch.setattr(qmm_mgpu, "NARROW_ROWS", 16)
    assert [qmm_mgpu.pieces(m) for m in (1, 16, 65)] == [(16,), (16,), (64, 16)]
    monkeypatch.setattr(qmm_mgpu, "WIDE_ROWS", 32)
    assert qmm_mgpu.pieces(80) == (32, 32, 16)
    monkeypatch.setattr(qmm_mgpu, "WIDE_ROWS", None)
    assert qmm_mgpu.pieces(40) == (16, 16, 16)
    monkeypatch.setattr(qmm_mgpu, "WIDE_ROWS", 48)
    with pytest.raises(ValueError, match="WIDE_ROWS"):
        qmm_mgpu.pieces(17)
    with pytest.raises(ValueError, match="rows=24"):
        jax.eval_shape(lambda x, w: qmm_mgpu.qmm_decode(x, w, rows=24), jax.ShapeDtypeStruct((1, 512), jnp.bfloat16),
                       _abstract_weight(256, 512))
    assert [qmm_mgpu.stages_for(r, 4) for r in qmm_mgpu.PIECE_ROWS] == [4, 4, 4, 3]
    assert [qmm_mgpu.stages_for(r, 12) for r in qmm_mgpu.PIECE_ROWS] == [7, 6, 4, 3]  # 3 compute warpgroups
    monkeypatch.setattr(qmm_mgpu, "WIDE_ROWS", 64)
    monkeypatch.setattr(qmm_mgpu, "NARROW_ROWS", 8)
    assert [qmm_mgpu.pieces(m) for m in (1, 8, 9, 65)] == [(8,), (8,), (16,), (64, 8)]
    monkeypatch.setattr(qmm_mgpu, "NARROW_ROWS", 32)
    assert qmm_mgpu.pieces(1) == (32,)
    monkeypatch.setattr(qmm_mgpu, "NARROW_ROWS", 12)
    with pytest.raises(ValueError, match="NARROW_ROWS"):
        qmm_mgpu.pieces(1)
    assert qmm_mgpu.stages_for(16, 20, block_groups=2) == 12


def test_wide_pieces_lower_for_the_h200():
    sds = jax.ShapeDtypeStruct
    for rows in (8, 32, 64):
        for k, n in ((5120, 34816), (17408, 5120)):
            text = jax.jit(lambda x, w: qmm_mgpu.qmm_decode(x, w, rows=rows)).trace(
                sds((rows, k), jnp.bfloat16), _abstract_weight(n, k)).lower(lowering_platforms=("cuda",)).as_text()
            assert "mosaic_gpu" in text, (rows, k, n)


# 8-row pieces on the device only: the interpreter's MMA is XLA's CPU dot, whose summation order follows N (2 of 2048
# elements of a 256 x 512 call differed between N = 8 and 16 there), so it cannot stand in for the wgmma.
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [8, 32, 64])
@pytest.mark.parametrize("k,n", [(5120, 6144), (17408, 5120), (128, 512)])
def test_gpu_wide_pieces_same_bits(k, n, rows):
    _wide_pieces_same_bits(n, k, rows, interpret=False)


@pytest.mark.gpu
def test_gpu_stage_counts_same_bits():
    """The pipeline's depth changes no bits, at every piece height, up to the most stages that fit (`stages_for`;
    at 3 compute warpgroups 7 at 8 rows, 6 at 16, 4 at 32, 3 at 64), and those depths launch on the H200."""
    rng = np.random.default_rng(3700)
    w = _small_weight(rng, 6144, 5120)
    x = jnp.asarray(rng.normal(size=(64, 5120)), jnp.bfloat16)
    run = jax.jit(lambda x, w, rows, stages: qmm_mgpu.qmm_decode(x, w, rows=rows, stages=stages),
                  static_argnums=(2, 3))
    want = np.asarray(run(x[:16], w, 16, 4)).view(np.uint16)
    for rows in (8, 16, 32, 64):
        most = qmm_mgpu.stages_for(rows, 99)
        assert qmm_mgpu.stages_for(rows, most + 1) == most
        for stages in sorted({2, 4, most} & set(range(2, most + 1))):
            assert qmm_mgpu.stages_for(rows, stages) == stages
            got = np.asarray(run(x[:rows], w, rows, stages)).view(np.uint16)
            np.testing.assert_array_equal(got[:16], want[:rows], err_msg=f"rows={rows} stages={stages}")


def _tiles_layout_same_bits(n: int, k: int, *, interpret: bool, rows_cases=(1, 16)):
    rng = np.random.default_rng(3800 + n + k)
    w = _small_weight(rng, n, k)
    x = jnp.asarray(rng.normal(size=(max(rows_cases), k)), jnp.bfloat16)
    run = jax.jit(lambda x, w, layout: qmm_mgpu.qmm_decode(x, w, interpret=interpret, layout=layout),
                  static_argnums=2)
    for m in rows_cases:
        want = np.asarray(run(x[:m], w, "rows")).view(np.uint16)
        np.testing.assert_array_equal(np.asarray(run(x[:m], w, "tiles")).view(np.uint16), want, err_msg=f"M={m}")


def test_tile_layout_blocks():
    """Block f of the "tiles" layout is step f of the flat schedule: tile f // L's rows, step f % L's groups, and
    the step's scale rows then bias rows; rows past N are zeros."""
    rng = np.random.default_rng(3810)
    n, k, bg = 200, 1024, 2
    w = _small_weight(rng, n, k)
    q, sb = qmm_mgpu.tile_layout(w.words, w.scales.T, w.biases.T, bg)
    q, sb = np.asarray(q), np.asarray(sb).view(np.uint16)
    words, st, bt = (np.asarray(w.words), np.asarray(w.scales).view(np.uint16).T,
                     np.asarray(w.biases).view(np.uint16).T)
    cta, length = qmm_mgpu.CTA_N, k // 64 // bg
    assert q.shape == (2 * length * cta, 8 * bg) and sb.shape == (2 * length * 2 * bg, cta)
    for f in range(2 * length):
        t, s = divmod(f, length)
        live = min(cta, n - t * cta)
        block = q[f * cta:(f + 1) * cta]
        np.testing.assert_array_equal(block[:live], words[t * cta:t * cta + live, s * 8 * bg:(s + 1) * 8 * bg])
        assert not block[live:].any()
        rows = sb[f * 2 * bg:(f + 1) * 2 * bg]
        np.testing.assert_array_equal(rows[:bg, :live], st[s * bg:(s + 1) * bg, t * cta:t * cta + live])
        np.testing.assert_array_equal(rows[bg:, :live], bt[s * bg:(s + 1) * bg, t * cta:t * cta + live])
        assert not rows[:, live:].any()


@pytest.mark.parametrize("n,k,sms", [(200, 1024, 3), (384, 512, 4), (256, 384, None)])
def test_interpreter_tiles_layout_same_bits(n, k, sms, monkeypatch):
    """The "tiles" layout reads the same values as "rows" (ragged last tile, chunks crossing tile edges, 2-group
    steps): the same bits at 1 and 16 rows."""
    if sms is not None:
        monkeypatch.setattr(qmm_mgpu, "SMS", sms)
    _tiles_layout_same_bits(n, k, interpret=True)


def test_tiles_layout_lowers_for_the_h200():
    sds = jax.ShapeDtypeStruct
    for k, n in ((5120, 34816), (17408, 5120)):
        text = jax.jit(lambda x, w: qmm_mgpu.qmm_decode(x, w, layout="tiles")).trace(
            sds((1, k), jnp.bfloat16), _abstract_weight(n, k)).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(5120, 34816), (17408, 5120), (5120, 6144), (128, 392)])
def test_gpu_tiles_layout_same_bits(k, n):
    _tiles_layout_same_bits(n, k, interpret=False, rows_cases=(1, 5, 16))


def _small_weight(rng, n: int, k: int, bits: int = 4):
    words = rng.integers(0, 2**32, size=(n, k * bits // 32), dtype=np.uint32)
    scales = jnp.asarray(rng.uniform(0.002, 0.02, size=(n, k // 64)), jnp.bfloat16)
    biases = jnp.asarray(rng.normal(size=(n, k // 64)) * 0.01, jnp.bfloat16)
    return QuantizedWeight(jnp.asarray(words), scales, biases, bits, 64)


def test_qmm_decode_impl_switch(monkeypatch):
    """qmm.DECODE_IMPL = "mgpu" sends supported decode calls to the Mosaic GPU kernel (a row's bits are the same
    alone, in a 16-row piece, and in the 32-row piece a 20-row call runs in), leaves the prompt path and
    unsupported weights (8 bits) on the Triton kernels, and an unknown name is a ValueError."""
    from pallas_kernels import qmm
    rng = np.random.default_rng(3300)
    w = _small_weight(rng, 256, 512)
    x = jnp.asarray(rng.normal(size=(20, 512)), jnp.bfloat16)
    triton = qmm.qmm(x, w, interpret=True)
    monkeypatch.setattr(qmm, "DECODE_IMPL", "mgpu")
    routed = []
    rows = qmm_mgpu.qmm_rows
    monkeypatch.setattr(qmm_mgpu, "qmm_rows", lambda x, w, **kw: routed.append(x.shape) or rows(x, w, **kw))
    got = qmm.qmm(x, w, interpret=True)
    assert routed == [(20, 512)]
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16),
                                  np.asarray(rows(x, w, interpret=True)).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(qmm.qmm(x[17:18], w, interpret=True)).view(np.uint16),
                                  np.asarray(got[17:18]).view(np.uint16))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(triton, np.float32), rtol=0.05, atol=0.05)
    prompt = qmm.qmm(x, w, prompt=True, interpret=True)
    monkeypatch.setattr(qmm, "DECODE_IMPL", "triton")
    np.testing.assert_array_equal(np.asarray(prompt).view(np.uint16),
                                  np.asarray(qmm.qmm(x, w, prompt=True, interpret=True)).view(np.uint16))
    w8 = _small_weight(rng, 256, 512, bits=8)
    want8 = qmm.qmm(x, w8, interpret=True)
    monkeypatch.setattr(qmm, "DECODE_IMPL", "mgpu")
    np.testing.assert_array_equal(np.asarray(qmm.qmm(x, w8, interpret=True)).view(np.uint16),
                                  np.asarray(want8).view(np.uint16))
    monkeypatch.setattr(qmm, "DECODE_IMPL", "cutlass")
    with pytest.raises(ValueError, match="decode impl"):
        qmm.qmm(x, w, interpret=True)


def test_auto_is_mgpu_on_a_gpu_only(monkeypatch):
    """The default DECODE_IMPL, "auto", resolves to the Mosaic GPU kernel on a GPU backend outside interpret mode
    and to the Triton kernel elsewhere (CPU, interpret mode), and decode_layout follows the resolved choice."""
    from pallas_kernels import qmm
    assert qmm.DECODE_IMPL == "auto"
    rng = np.random.default_rng(3500)
    params = {"a": _small_weight(rng, 256, 512)}
    on_gpu = jax.default_backend() == "gpu"
    assert qmm.decode_impl() == ("mgpu" if on_gpu else "triton")
    assert qmm.decode_impl(interpret=True) == "triton"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert qmm.decode_impl() == "mgpu" and qmm.decode_impl(interpret=True) == "triton"
    assert qmm.decode_layout(params)["a"].scales_t is not None
    assert qmm.decode_layout(params, jnp.float32)["a"].scales_t is None  # fp32 activations stay on Triton
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert qmm.decode_impl() == "triton" and qmm.decode_layout(params) is params
    monkeypatch.setattr(qmm, "DECODE_IMPL", "mgpu")
    assert qmm.decode_impl() == "mgpu" and qmm.decode_impl(interpret=True) == "mgpu"


def test_27b_decode_program_lowers_with_it(h200_lowering, monkeypatch):
    """The 27B decode program (4 layers) with DECODE_IMPL = "mgpu" lowers for an H200 on the CPU, every quantized
    projection on the Mosaic GPU kernel (none left on the Triton one)."""
    from pallas_kernels import qmm
    from tests.test_model_kernels import _decode_program_text
    monkeypatch.setattr(qmm, "DECODE_IMPL", "mgpu")
    text = _decode_program_text(4)
    assert text.count("mosaic_gpu") >= 5
    assert "qmm_4b_g64" not in text
    # the MLP's activation reads the gate/up pieces itself (`ops.swiglu`; one Triton module, shared by the layers)
    assert 'name = "swiglu"' in text
    # the output projections' residual adds read their pieces too, each with the norm after it in the same launch
    # (`ops.add_residual_norm`): the post-attention norm, the next layer's input norm and the final norm
    assert text.count('name = "residual_add_norm"') >= 1 and 'name = "residual_add"' not in text
    assert text.count("residual_add_norm") >= 8


def _custom_calls(text: str, fact) -> list:
    """`fact(call)` for each custom call of a lowered program, parsed in a fresh MLIR context that knows Mosaic GPU
    (the calls live only while their module does, so what is kept must be read out here)."""
    from jax.experimental.mosaic import gpu as mgpu
    from jax.interpreters import mlir
    ctx = mlir.make_ir_context()
    ctx.allow_unregistered_dialects = True
    mgpu.dialect.register_dialect(ctx)
    with ctx:
        program = mlir.ir.Module.parse(text)  # held: the operations below live in it
        return [fact(call) for call in qmm_mgpu.custom_calls(program.operation)]


def _is_mosaic(call) -> bool:
    return "mosaic_gpu" in str(call.attributes["call_target_name"])


def _mosaic_modules(text: str) -> list[str]:
    """The Mosaic GPU kernels of a lowered program, each as its module's text without debug info and with the
    per-process kernel counter (`dump_basename`) blanked."""
    from jax.interpreters import mlir

    def module(call):
        if not _is_mosaic(call):
            return None
        raw = mlir.ir.DictAttr(call.attributes["mhlo.backend_config"])["module"]
        kernel = mlir.ir.Module.parse(bytes(mlir.ir.StringAttr(raw).value_bytes))
        return re.sub(r'dump_basename = "[^"]*"', "dump_basename", kernel.operation.get_asm(enable_debug_info=False))
    return [m for m in _custom_calls(text, module) if m is not None]


def test_lowering_cache_same_program(h200_lowering, monkeypatch):
    """With the lowering cache the 27B decode program is the uncached one outside the Mosaic GPU kernels' bytes,
    and each kernel's module is the same but for the per-process counter and locations; two programs share their
    kernels' hashes (compiled once a process), which the uncached lowering does not."""
    from pallas_kernels import qmm
    from tests.test_model_kernels import _decode_program_text
    monkeypatch.setattr(qmm, "DECODE_IMPL", "mgpu")
    hashes = lambda t: sorted(set(re.findall(r'kernel_hash = "([^"]*)"', t)))
    bytes_out = lambda t: re.sub(r'kernel_hash = "[^"]*", module = "[^"]*"', "KERNEL", t)
    texts = {}
    for cache in (False, True):
        monkeypatch.setattr(qmm_mgpu, "LOWERING_CACHE", cache)  # read when a program is lowered
        texts[cache] = (_decode_program_text(2), _decode_program_text(3))
    (plain2, plain3), (cached2, cached3) = texts[False], texts[True]
    assert bytes_out(plain2) == bytes_out(cached2) and bytes_out(plain3) == bytes_out(cached3)
    assert _mosaic_modules(plain2) == _mosaic_modules(cached2) and len(_mosaic_modules(cached2)) >= 5
    assert hashes(cached2) == hashes(cached3) and hashes(plain2) != hashes(plain3)


def test_lowering_cache_only_for_single_device_programs(monkeypatch):
    """Under shard_map (an SPMD axis context, whose mesh Mosaic GPU's lowering reads) the kernel is lowered in
    place and nothing is cached; a single-device program fills the cache once and reuses it."""
    import functools

    from jax.sharding import Mesh, PartitionSpec

    monkeypatch.setattr(qmm_mgpu._PARTIALS, "lowered", {})
    sds = jax.ShapeDtypeStruct
    args = (sds((16, 512), jnp.bfloat16), sds((256, 64), jnp.uint32), sds((8, 256), jnp.bfloat16),
            sds((8, 256), jnp.bfloat16))
    f = functools.partial(qmm_mgpu._partials, stages=4, block_groups=4, sms=qmm_mgpu.SMS, interpret=False)
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    spmd = jax.shard_map(f, mesh=mesh, in_specs=(PartitionSpec(),) * 4, out_specs=PartitionSpec(), check_vma=False)
    lower = lambda fn: jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    cache = lambda: qmm_mgpu._PARTIALS.lowered
    assert "mosaic_gpu" in lower(spmd) and not cache()
    first = lower(f)
    assert len(cache()) == 1 and lower(f) == first and len(cache()) == 1


def test_decode_layout_transposes_once_same_bits(monkeypatch):
    """qmm.decode_layout gives the weights the Mosaic GPU kernel takes their transposed scales and biases and, under
    the "words" conversion, their words in lane order in place of the natural ones (only when DECODE_IMPL is
    "mgpu"; 8-bit weights and dense arrays are left alone); the kernel then reads them instead of transposing and
    repacking per call, with the same bits; a wrong shape is a ValueError."""
    from pallas_kernels import qmm
    rng = np.random.default_rng(3400)
    params = {"a": _small_weight(rng, 256, 512), "b": [_small_weight(rng, 128, 512, bits=8), jnp.ones((4, 4))]}
    monkeypatch.setattr(qmm, "DECODE_IMPL", "triton")
    assert qmm.decode_layout(params) is params
    monkeypatch.setattr(qmm, "DECODE_IMPL", "mgpu")
    monkeypatch.setattr(qmm_mgpu, "CONVERSION", "words")  # (the "subnormal" rows: test_interpreter_subnormal_...)
    laid = qmm.decode_layout(params)
    w = laid["a"]
    np.testing.assert_array_equal(np.asarray(w.scales_t), np.asarray(params["a"].scales).T)
    np.testing.assert_array_equal(np.asarray(w.biases_t), np.asarray(params["a"].biases).T)
    assert w.lanes and not params["a"].lanes
    np.testing.assert_array_equal(np.asarray(w.words), np.asarray(to_lane_words(params["a"].words)))
    assert laid["b"][0].scales_t is None and not laid["b"][0].lanes and laid["b"][1] is params["b"][1]
    x = jnp.asarray(rng.normal(size=(3, 512)), jnp.bfloat16)
    for conversion in qmm_mgpu.CONVERSIONS:
        f = lambda w, c=conversion: np.asarray(qmm_mgpu.qmm_decode(x, w, interpret=True, conversion=c)).view(np.uint16)
        np.testing.assert_array_equal(f(w), f(params["a"]), err_msg=conversion)
    monkeypatch.setattr(qmm_mgpu, "CONVERSION", "nibbles")
    assert not qmm.decode_layout(params)["a"].lanes
    import dataclasses
    with pytest.raises(ValueError, match="transpose"):
        dataclasses.replace(w, scales_t=w.scales).validate()
    with pytest.raises(ValueError, match="lane-ordered"):
        dataclasses.replace(laid["b"][0], lanes=True).validate()


def _lane_readers_same_values(interpret: bool):
    """A weight whose words are in lane order gives every reader what its natural twin gives: the prompt path's
    dequantization pass (bits), XLA's dequantization, the embedding gather and the Triton decode tiles."""
    import dataclasses

    from pallas_kernels import qmm
    rng = np.random.default_rng(3900)
    w = _small_weight(rng, 24, 384)
    same = lambda a, b, what: np.testing.assert_array_equal(np.asarray(a).view(np.uint16),
                                                            np.asarray(b).view(np.uint16), err_msg=what)  # bf16 bits
    hw = dataclasses.replace(w, words=to_lane_words(w.words, halves=True), lanes=True, halves=True)
    same(qmm.dequant_pass(hw, interpret=interpret), qmm.dequant_pass(w, interpret=interpret), "pass, halves")
    assert np.array_equal(np.asarray(natural_words(hw)), np.asarray(w.words))
    lw = dataclasses.replace(w, words=to_lane_words(w.words), lanes=True)
    same(qmm.dequant_pass(lw, interpret=interpret), qmm.dequant_pass(w, interpret=interpret), "dequant pass")
    if not interpret:
        return
    same(qmm.dequantize_for_matmul(lw, jnp.bfloat16), qmm.dequantize_for_matmul(w, jnp.bfloat16), "XLA dequantize")
    ids = jnp.asarray([[3, 0, 23], [7, 7, 1]])
    same(qmm.embed(lw, ids, jnp.bfloat16), qmm.embed(w, ids, jnp.bfloat16), "embedding")
    x = jnp.asarray(rng.normal(size=(5, 384)), jnp.bfloat16)
    tiles = qmm.decode_tiles(24, 384, 4, 64)
    same(qmm.qmm(x, lw, interpret=True, tiles=tiles), qmm.qmm(x, w, interpret=True, tiles=tiles), "Triton tiles")


def test_lane_order_readers_same_values():
    _lane_readers_same_values(interpret=True)


def test_lane_dequant_pass_lowers_for_the_h200(h200_lowering):
    """The pass's lane-order interleave (a 5-D transpose of the block's pairs) is one the Triton lowering takes."""
    from pallas_kernels import qmm
    sds = jax.ShapeDtypeStruct
    for k, n in ((5120, 17408), (17408, 5120), (384, 24)):
        for halves in (False, True):
            w = QuantizedWeight(sds((n, k // 8), jnp.uint32), sds((n, k // 64), jnp.bfloat16),
                                sds((n, k // 64), jnp.bfloat16), 4, 64, lanes=True, halves=halves)
            text = jax.jit(qmm.dequant_pass).trace(w).lower(lowering_platforms=("cuda",)).as_text()
            assert "triton" in text.lower(), (k, n, halves)


@pytest.mark.gpu
def test_gpu_dequant_pass_reads_lane_order():
    _lane_readers_same_values(interpret=False)


def test_roundings_same_bits(monkeypatch):
    """Both ways of keeping the output's bf16 rounding give the same bits, alone and under a consumer that widens
    the result again (the log-softmax over lm_head rows); qmm_rows follows ROUNDING; an unknown name is refused."""
    rng = np.random.default_rng(3800)
    w = _small_weight(rng, 256, 512)
    x = jnp.asarray(rng.normal(size=(3, 512)), jnp.bfloat16)
    outs = {}
    for rounding in qmm_mgpu.ROUNDINGS:
        f = jax.jit(lambda x, w, r=rounding: qmm_mgpu.qmm_decode(x, w, interpret=True, rounding=r))
        g = jax.jit(lambda x, w, r=rounding: jax.nn.log_softmax(
            qmm_mgpu.qmm_decode(x, w, interpret=True, rounding=r).astype(jnp.float32)))
        outs[rounding] = (np.asarray(f(x, w)).view(np.uint16), np.asarray(g(x, w)).view(np.uint32))
        monkeypatch.setattr(qmm_mgpu, "ROUNDING", rounding)
        np.testing.assert_array_equal(np.asarray(qmm_mgpu.qmm_rows(x, w, interpret=True)).view(np.uint16),
                                      outs[rounding][0])
    for a, b in zip(*outs.values()):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="rounding"):
        qmm_mgpu.qmm_decode(x, w, interpret=True, rounding="none")


def test_norms_write_the_decode_qmm_padding(monkeypatch):
    """Where a norm feeds a projection whose decode qmm pads its rows (the Mosaic GPU kernel, M below its piece
    height), the norm writes the padded rows itself (`ops.Padded`) and every projection's rows keep their bits; on
    the prompt path, with PAD_AT_NORM off, without kernels, on the Triton path, for a weight the kernel does not
    take, and at a full piece there is nothing to pad."""
    from pallas_kernels import qmm
    from qwen_jax.model import ops
    monkeypatch.setattr(qmm, "DECODE_IMPL", "mgpu")
    be = ops.Backend(kernels=True, interpret=True)
    rng = np.random.default_rng(3900)
    fused = ops.fuse([_small_weight(rng, 128, 512), _small_weight(rng, 128, 512)])
    x = jnp.asarray(rng.normal(size=(3, 1, 512)), jnp.bfloat16)
    nw = jnp.asarray(1.0 + 0.1 * rng.normal(size=512), jnp.float32)
    padded = ops.rms_norm(be, x, nw, 1e-6, then=fused)
    assert isinstance(padded, ops.Padded) and padded.rows.shape == (8, 512) and padded.shape == (3, 1, 512)
    plain = ops.rms_norm(be, x, nw, 1e-6)
    for got, want in zip(ops.linear_split(padded, fused, be, prompt=False),
                         ops.linear_split(plain, fused, be, prompt=False)):
        assert got.shape == want.shape == (3, 1, 128)
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
    # GDN's output norm: per head, the heads joined for the projection
    o = jnp.asarray(rng.normal(size=(3, 1, 4, 128)), jnp.bfloat16)
    z = jnp.asarray(rng.normal(size=(3, 1, 4, 128)), jnp.bfloat16)
    out_w = _small_weight(rng, 256, 512)
    gw = jnp.asarray(1.0 + 0.1 * rng.normal(size=128), jnp.float32)
    gp = ops.gated_rms_norm(be, o, z, gw, 1e-6, then=out_w)
    assert isinstance(gp, ops.Padded) and gp.rows.shape == (8, 512) and gp.shape == (3, 1, 512)
    want = ops.linear(ops.gated_rms_norm(be, o, z, gw, 1e-6).reshape(3, 1, 512), out_w, be, prompt=False)
    np.testing.assert_array_equal(np.asarray(ops.linear(gp, out_w, be, prompt=False)).view(np.uint16),
                                  np.asarray(want).view(np.uint16))
    # where nothing is padded
    assert ops.pad_rows(be, x, fused, prompt=True) is None
    assert ops.pad_rows(ops.Backend(), x, fused, prompt=False) is None
    assert ops.pad_rows(be, jnp.zeros((8, 512), jnp.bfloat16), fused, prompt=False) is None
    assert ops.pad_rows(be, jnp.zeros((16, 512), jnp.bfloat16), fused, prompt=False) is None
    assert ops.pad_rows(be, jnp.zeros((9, 512), jnp.bfloat16), fused, prompt=False) == 16
    assert ops.pad_rows(be, jnp.zeros((17, 512), jnp.bfloat16), fused, prompt=False) == 32
    assert ops.pad_rows(be, x, _small_weight(rng, 128, 512, bits=8), prompt=False) is None
    assert not isinstance(ops.rms_norm(be, x, nw, 1e-6, then=fused, prompt=True), ops.Padded)
    monkeypatch.setattr(ops, "PAD_AT_NORM", False)
    assert ops.pad_rows(be, x, fused, prompt=False) is None
    monkeypatch.setattr(ops, "PAD_AT_NORM", True)
    monkeypatch.setattr(qmm, "DECODE_IMPL", "triton")
    assert ops.pad_rows(be, x, fused, prompt=False) is None


def _wide_scale_weight(rng, n: int, k: int):
    """A weight whose scales span 2^-12 .. 2^2 by output row (rows past the first third need the "subnormal"
    conversion's row scale: their s 2^133 would leave bf16's range), biases near -8 s."""
    spread = np.exp2(rng.uniform(-12, 2, size=(n, 1))) * rng.uniform(0.5, 1.0, size=(n, k // 64))
    spread[: n // 3] = np.minimum(spread[: n // 3], 0.03)
    scales = jnp.asarray(spread, jnp.bfloat16)
    biases = (-8.0 * scales.astype(jnp.float32)
              + jnp.asarray(rng.normal(size=(n, k // 64)) * 1e-2 * spread)).astype(jnp.bfloat16)
    words = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
    return QuantizedWeight(jnp.asarray(words), scales, biases, 4, 64)


def test_subnormal_scales_are_exact_powers_of_two():
    """`subnormal_scales`: per column the least shift d >= 0 that keeps s 2^(133 - d) in bf16's range; the shifted
    scales and biases are their sources times powers of two exactly; a bias near bf16's least normal makes the
    result inexact (the kernel must then keep the "words" conversion)."""
    rng = np.random.default_rng(4100)
    w = _wide_scale_weight(rng, 96, 512)
    s, b = w.scales.T, w.biases.T
    s_up, b_down, row_scale, exact = qmm_mgpu.subnormal_scales(s, b)
    assert bool(exact) and row_scale.shape == (1, 96)
    s64, b64 = (np.asarray(a.astype(jnp.float32), np.float64) for a in (s, b))
    d = np.log2(np.asarray(row_scale[0], np.float64))
    assert np.all(d == np.round(d)) and d.min() == 0 and d.max() > 0
    up = np.asarray(s_up.astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(up, s64 * 2.0 ** (133 - d))
    np.testing.assert_array_equal(np.asarray(b_down.astype(jnp.float32), np.float64), b64 * 2.0 ** -d)
    assert np.all(up.max(axis=0) <= float(jnp.finfo(jnp.bfloat16).max))
    assert np.all((d == 0) | (up.max(axis=0) * 2 > float(jnp.finfo(jnp.bfloat16).max)))  # least d
    tiny = b.at[3, int(np.argmax(d))].set(jnp.bfloat16(2.0 ** -125))  # shifted below the least normal
    assert not bool(qmm_mgpu.subnormal_scales(s, tiny)[3])


def _subnormal_same_bits(n: int, k: int, *, interpret: bool, rows_cases=(1, 16), conversion="subnormal"):
    """The "subnormal" (or "halves") conversion gives the "words" conversion's bits, for weights with and without
    row scales, laid out once (`decode_layout`) or shifted (and its words repacked) per call."""
    from pallas_kernels import qmm
    rng = np.random.default_rng(4200 + n + k)
    for w in (_small_weight(rng, n, k), _wide_scale_weight(rng, n, k)):
        words = jax.jit(lambda x, w: qmm_mgpu.qmm_decode(x, w, interpret=interpret, conversion="words"))
        sub = jax.jit(lambda x, w: qmm_mgpu.qmm_decode(x, w, interpret=interpret, conversion=conversion))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(qmm, "DECODE_IMPL", "mgpu")
            mp.setattr(qmm_mgpu, "CONVERSION", conversion)
            laid = qmm.decode_layout({"w": w})["w"]
            assert laid.subnormal and laid.lanes and laid.halves == (conversion == "halves")
            default = jax.jit(lambda x, w: qmm_mgpu.qmm_decode(x, w, interpret=interpret))
            for m in rows_cases:
                x = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
                want = np.asarray(words(x, w)).view(np.uint16)
                for what, got in (("per call", sub(x, w)), ("laid out", default(x, laid))):
                    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), want, err_msg=f"{what}, M={m}")
    assert laid.row_scale is not None  # the wide-scale weight needed its row scale


@pytest.mark.parametrize("conversion", qmm_mgpu.SUBNORMAL_CONVERSIONS)
def test_interpreter_subnormal_conversion_same_bits(conversion):
    _subnormal_same_bits(200, 512, interpret=True, rows_cases=(3,), conversion=conversion)


def test_halves_pairs_are_one_mask_away():
    """The "halves" conversion's arithmetic, bit by bit in numpy: in a halves-ordered lane word, pair j's two
    fields are nibbles j and j + 4; masked in place (pairs 1 and 3 after nothing, 2 and 3 after a shift of 8) each
    16-bit half read as a bf16 is exactly q 2^-133 (mask 0x000F000F) or q 2^-129 (0x00F000F0: for q >= 8 the top
    field bit is the exponent's lowest), and those are the pair-order words' fields."""
    rng = np.random.default_rng(4300)
    words = jnp.asarray(rng.integers(0, 2**32, size=(3, 16), dtype=np.uint32))
    pairs, halves = np.asarray(to_lane_words(words)), np.asarray(to_lane_words(words, halves=True))
    as_bf16 = lambda u16: np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(u16, jnp.uint16), jnp.bfloat16),
                                     np.float64)
    for j in range(4):
        w = halves >> np.uint32(8) if j >= 2 else halves
        masked = w & np.uint32(0x00F000F0 if j % 2 else 0x000F000F)
        for e in range(2):  # low half: the pair's first field; high half: its second
            value = as_bf16((masked >> np.uint32(16 * e)) & np.uint32(0xFFFF))
            q = ((pairs >> np.uint32(8 * j + 4 * e)) & np.uint32(15)).astype(np.float64)
            np.testing.assert_array_equal(value, q * 2.0 ** (-129 if j % 2 else -133), err_msg=(j, e))
    np.testing.assert_array_equal(np.asarray(from_lane_words(jnp.asarray(halves), halves=True)), np.asarray(words))


def test_subnormal_lowers_for_the_h200():
    """The "subnormal" and "halves" conversions lower with and without their row scale operand (and in the "tiles"
    layout)."""
    sds = jax.ShapeDtypeStruct
    for k, n in ((5120, 34816), (17408, 5120)):
        aw = _abstract_weight(n, k)
        g = k // 64
        for conversion in qmm_mgpu.SUBNORMAL_CONVERSIONS:
            laid = QuantizedWeight(aw.words, aw.scales, aw.biases, 4, 64, sds((g, n), jnp.bfloat16),
                                   sds((g, n), jnp.bfloat16), lanes=True, subnormal=True,
                                   halves=conversion == "halves")
            for w, kw in ((laid, {}), (aw, {}), (laid, dict(layout="tiles"))):
                text = jax.jit(lambda x, w: qmm_mgpu.qmm_decode(x, w, conversion=conversion, **kw)).trace(
                    sds((1, k), jnp.bfloat16), w).lower(lowering_platforms=("cuda",)).as_text()
                assert "mosaic_gpu" in text
                # "halves": one mask a pair and no byte permutes; "subnormal": a prmt a pair
                assert ("prmt" in text) == (conversion == "subnormal"), conversion


@pytest.mark.gpu
@pytest.mark.parametrize("conversion", qmm_mgpu.SUBNORMAL_CONVERSIONS)
@pytest.mark.parametrize("k,n", [(5120, 34816), (17408, 5120), (5120, 6144), (128, 392)])
def test_gpu_subnormal_conversion_same_bits(k, n, conversion):
    _subnormal_same_bits(n, k, interpret=False, rows_cases=(1, 5, 16), conversion=conversion)


def test_unstaggered_loads_lower_for_the_h200(monkeypatch):
    monkeypatch.setattr(qmm_mgpu, "STAGGERED_LOADS", False)
    sds = jax.ShapeDtypeStruct
    for conversion in qmm_mgpu.LANE_CONVERSIONS:
        text = jax.jit(lambda x, w: qmm_mgpu.qmm_decode(x, w, conversion=conversion)).trace(
            sds((1, 5120), jnp.bfloat16), _abstract_weight(34816, 5120)).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.parametrize("conversion", ["words", "subnormal"])
def test_gpu_unstaggered_loads_same_bits(conversion, monkeypatch):
    """The lane words loaded in place (STAGGERED_LOADS False) give the staggered loads' bits."""
    rng = np.random.default_rng(4300)
    w = _wide_scale_weight(rng, 5120, 17408)
    x = jnp.asarray(rng.normal(size=(16, 17408)), jnp.bfloat16)
    run = lambda: np.asarray(qmm_mgpu.qmm_decode(x, w, conversion=conversion)).view(np.uint16)
    want = run()
    monkeypatch.setattr(qmm_mgpu, "STAGGERED_LOADS", False)
    np.testing.assert_array_equal(run(), want)
