"""The residual add after an output projection's decode rows (pallas_kernels/residual.py): against its reference bit
for bit (interpret mode), against the model's own path (the decode qmm's epilogue, then `x + y`) on the Mosaic GPU
interpreter, a row alone against the same row among others and in every piece height; `gpu`: compiled at the 27B's
down projection (17408 -> 5120). The add with the norm that reads it (`residual_add_norm`): the unfused kernels'
bits, in interpret mode, on the Mosaic GPU interpreter through `ops.add_residual_norm`, and compiled on the H200."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import qmm, qmm_mgpu
from pallas_kernels import residual as rs
from pallas_kernels.qweight import QuantizedWeight
from qwen_jax.model import ops
from qwen_jax.model.ops import Backend, Deferred, Padded
from tests.test_swiglu import bits, random_pieces

INTERPRET = jax.default_backend() != "gpu"


@pytest.mark.parametrize("p,n,r,m", [(2, 200, 16, 1), (3, 256, 8, 8), (1, 384, 64, 37), (4, 96, 32, 20)])
def test_residual_add_matches_reference_bitwise(p, n, r, m):
    """Unwritten pieces hold NaN: selected away, never summed; the residual rows are m <= R."""
    rng = np.random.default_rng(600 + n)
    parts, valid = random_pieces(rng, p, n, r)
    x = jnp.asarray(rng.standard_normal((m, n)) * 4, jnp.bfloat16)
    got = rs.residual_add(parts, valid, x, interpret=INTERPRET)
    want = rs.reference(parts, valid, x)
    assert got.shape == (m, n) and got.dtype == jnp.bfloat16
    assert np.array_equal(bits(got), bits(want)) and np.all(np.isfinite(np.asarray(got, np.float32)))
    # the reference is the model's bf16 add of the rounded sum
    total = qmm_mgpu.sum_pieces(lambda i: (parts[i], valid[i][:, None]), p).astype(jnp.bfloat16)[:, :m].T
    assert np.array_equal(bits(want), bits(x + total))


def test_residual_add_rejects_bad_inputs():
    parts = jnp.zeros((2, 64, 16), jnp.float32)
    valid = jnp.ones((2, 64), bool)
    with pytest.raises(ValueError, match="M <= R"):
        rs.residual_add(parts, valid, jnp.zeros((17, 64), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="valid"):
        rs.residual_add(parts, jnp.ones((2, 32), bool), jnp.zeros((1, 64), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="bf16"):
        rs.residual_add(parts, valid, jnp.zeros((1, 64), jnp.float32), interpret=True)


def _weight(rng, n: int, k: int) -> QuantizedWeight:
    words = rng.integers(0, 2**32, size=(n, k // 8), dtype=np.uint32)
    scales = jnp.asarray(rng.uniform(0.002, 0.02, size=(n, k // 64)), jnp.bfloat16)
    biases = jnp.asarray(rng.normal(size=(n, k // 64)) * 0.01, jnp.bfloat16)
    return qmm.decode_layout(QuantizedWeight(jnp.asarray(words), scales, biases, 4, 64))


def test_residual_add_is_the_model_add_on_the_interpreter(monkeypatch):
    """With the Mosaic GPU decode qmm (its interpreter): `project` defers a decode projection and `add_residual`
    gives the bits of `x + linear(h, w)` (the same operations in the same order), for plain and `Padded` rows; a
    row alone has the bits it has among 20 (a 32-row piece); a prompt call or an fp32 residual take the plain
    path."""
    monkeypatch.setattr(qmm, "DECODE_IMPL", "mgpu")
    rng = np.random.default_rng(610)
    backend = Backend(kernels=True, interpret=True)
    w = _weight(rng, 192, 256)
    h = jnp.asarray(rng.normal(size=(20, 256)), jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(20, 192)) * 3, jnp.bfloat16)
    y = ops.project(h, w, backend, prompt=False)
    assert isinstance(y, Deferred)
    assert not isinstance(ops.project(h, w, backend, prompt=True), Deferred)
    want = x + ops.linear(h, w, backend, prompt=False)
    got = ops.add_residual(backend, x, y)
    assert got.shape == x.shape and np.array_equal(bits(got), bits(want))
    assert np.array_equal(bits(ops.materialize(backend, y)), bits(ops.linear(h, w, backend, prompt=False)))
    alone = ops.add_residual(backend, x[7:8], ops.project(h[7:8], w, backend, prompt=False))
    assert np.array_equal(bits(alone[0]), bits(got[7]))
    padded = Padded(jnp.pad(h[:3], ((0, 13), (0, 0))), (3,))
    assert np.array_equal(bits(ops.add_residual(backend, x[:3], ops.project(padded, w, backend, prompt=False))),
                          bits(want[:3]))
    x32 = x.astype(jnp.float32)
    assert np.array_equal(np.asarray(ops.add_residual(backend, x32, y)),
                          np.asarray(x32 + ops.linear(h, w, backend, prompt=False)))


def test_project_pieces_is_the_projection_on_the_interpreter(monkeypatch):
    """`ops.project_pieces` (a projection's decode rows as `qmm_mgpu.Pieces` for the prep kernels): its values are
    `linear(x, w)`'s bit for bit, for plain and `Padded` rows of [S, R] streams; None where the rows need two
    pieces, where PREP_PIECES is off, off the Mosaic GPU kernel, or for rows that are not bf16."""
    monkeypatch.setattr(qmm, "DECODE_IMPL", "mgpu")
    rng = np.random.default_rng(620)
    backend = Backend(kernels=True, interpret=True)
    w = _weight(rng, 192, 256)
    x = jnp.asarray(rng.normal(size=(3, 2, 256)), jnp.bfloat16)
    want = bits(ops.linear(x, w, backend, prompt=False))
    for rows in (x, Padded(jnp.pad(x.reshape(6, 256), ((0, 2), (0, 0))), (3, 2))):
        got = ops.project_pieces(rows, w, backend)
        assert got.lead == (3, 2) and got.parts.shape[2] == 8
        assert np.array_equal(bits(got.materialize()), want)
    assert ops.project_pieces(jnp.zeros((5, 13, 256), jnp.bfloat16), w, backend) is None  # 65 rows: (64, 8)
    assert ops.project_pieces(x.astype(jnp.float32), w, backend) is None
    monkeypatch.setattr(ops, "PREP_PIECES", False)
    assert ops.project_pieces(x, w, backend) is None
    monkeypatch.setattr(ops, "PREP_PIECES", True)
    monkeypatch.setattr(qmm, "DECODE_IMPL", "triton")
    assert ops.project_pieces(x, w, backend) is None


def test_attention_gate_writes_the_o_projection_padding(monkeypatch):
    """The attention output's gate writes the o projection's padded rows (`attention.finish`, `ops.Padded`) on the
    Mosaic GPU interpreter: the residual after it has the bits it has with the qmm padding the rows itself
    (PAD_AT_NORM off), for 3 streams x 2 rows; the `Padded` rows pass an optimization barrier as they are (the
    serial step's barrier around an attention layer's output)."""
    import types
    from qwen_jax.model import attention
    monkeypatch.setattr(qmm, "DECODE_IMPL", "mgpu")
    rng = np.random.default_rng(630)
    backend = Backend(kernels=True, interpret=True)
    cfg = types.SimpleNamespace(num_heads=2, head_dim=128)
    p = {"o": _weight(rng, 192, 256)}
    o = jnp.asarray(rng.normal(size=(3, 2, 2, 128)), jnp.bfloat16)
    gate = jnp.asarray(rng.normal(size=(3, 2, 256)), jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(3, 2, 192)) * 3, jnp.bfloat16)
    y = attention.finish(o, gate, p, cfg, backend, prompt=False)
    assert isinstance(y, Deferred) and isinstance(y.h, Padded) and y.h.rows.shape == (8, 256)
    assert not np.any(bits(y.h.rows[6:]))
    barred = jax.lax.optimization_barrier(y)
    assert isinstance(barred.h, Padded) and barred.h.lead == (3, 2)
    got = ops.add_residual(backend, x, barred)
    monkeypatch.setattr(ops, "PAD_AT_NORM", False)
    plain = attention.finish(o, gate, p, cfg, backend, prompt=False)
    assert not isinstance(plain.h, Padded)
    assert np.array_equal(bits(got), bits(ops.add_residual(backend, x, plain)))


def test_residual_add_lowers_for_h200(h200_lowering):
    sds = jax.ShapeDtypeStruct
    for m in (1, 13):
        text = jax.jit(rs.residual_add).trace(sds((6, 5120, 16), jnp.float32), sds((6, 5120), jnp.bool_),
                                              sds((m, 5120), jnp.bfloat16)).lower(
            lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.gpu
def test_gpu_residual_add_27b():
    """The 27B's down projection on the H200: the kernel's rows bit for bit its reference's and the model's
    unfused `x + linear(h, w)`; a row's bits the same alone, among 16 rows and in a 64-row piece (pieces 64 + 16
    for 70 rows)."""
    rng = np.random.default_rng(620)
    backend = Backend(kernels=True, interpret=False)
    w = _weight(rng, 5120, 17408)
    h = jnp.asarray(rng.normal(size=(70, 17408)), jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(70, 5120)) * 3, jnp.bfloat16)
    parts, written = qmm_mgpu.qmm_parts(h[:16], w, rows=16)
    kernel = rs.residual_add(parts, jnp.asarray(written), x[:16])
    assert np.array_equal(bits(kernel), bits(rs.reference(parts, jnp.asarray(written), x[:16])))
    many = ops.add_residual(backend, x, ops.project(h, w, backend, prompt=False))
    unfused = jax.jit(lambda x, h: x + ops.linear(h, w, backend, prompt=False))(x, h)
    assert np.array_equal(bits(many), bits(unfused))
    for lo, hi in ((3, 4), (0, 16)):
        part = ops.add_residual(backend, x[lo:hi], ops.project(h[lo:hi], w, backend, prompt=False))
        assert np.array_equal(bits(part), bits(many[lo:hi])), (lo, hi)


@pytest.mark.parametrize("tail", rs.TAILS)
@pytest.mark.parametrize("p,n,r,m,out_rows", [(2, 200, 16, 1, 16), (3, 256, 8, 8, 8), (2, 320, 8, 3, 8),
                                              (4, 96, 32, 20, 32), (1, 5120, 8, 1, 8), (2, 5120, 16, 5, 16)])
def test_residual_add_norm_is_the_two_kernels_bitwise(p, n, r, m, out_rows, tail):
    """x + y as `residual_add`, its norm as `rownorm.rms_norm(..., out_rows)` (zero rows past M included), bit for
    bit, with either tail; the launch counter comes back zero."""
    from pallas_kernels import rownorm
    rng = np.random.default_rng(700 + n)
    parts, valid = random_pieces(rng, p, n, r)
    x = jnp.asarray(rng.standard_normal((m, n)) * 4, jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(n), jnp.float32)
    total, h, count = rs.residual_add_norm(parts, valid, x, w, jnp.zeros((1,), jnp.int32), eps=1e-6,
                                           out_rows=out_rows, tail=tail, interpret=INTERPRET)
    want = rs.residual_add(parts, valid, x, interpret=INTERPRET)
    assert np.array_equal(bits(total), bits(want))
    assert np.array_equal(bits(h), bits(rownorm.rms_norm(want, w, 1e-6, interpret=INTERPRET, out_rows=out_rows)))
    assert h.shape == (out_rows, n) and np.asarray(count).tolist() == [0]
    ref_total, ref_h = rs.reference_norm(parts, valid, x, w, 1e-6, out_rows)
    assert np.array_equal(bits(total), bits(ref_total))
    np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(ref_h, np.float32), rtol=1e-2, atol=1e-2)


def test_residual_add_norm_rejects_bad_inputs():
    parts = jnp.zeros((2, 64, 8), jnp.float32)
    valid = jnp.ones((2, 64), bool)
    x = jnp.zeros((2, 64), jnp.bfloat16)
    zero = jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match="weight"):
        rs.residual_add_norm(parts, valid, x, jnp.ones(32), zero, eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="count"):
        rs.residual_add_norm(parts, valid, x, jnp.ones(64), jnp.zeros((1,), jnp.float32), eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="out_rows"):
        rs.residual_add_norm(parts, valid, x, jnp.ones(64), zero, eps=1e-6, out_rows=16, interpret=True)
    with pytest.raises(ValueError, match="M <= R"):
        rs.residual_add_norm(parts, valid, jnp.zeros((9, 64), jnp.bfloat16), jnp.ones(64), zero, eps=1e-6,
                             interpret=True)
    with pytest.raises(ValueError, match="tail"):
        rs.residual_add_norm(parts, valid, x, jnp.ones(64), zero, eps=1e-6, tail="first", interpret=True)


@pytest.mark.parametrize("tail", rs.TAILS)
def test_add_residual_norm_is_the_two_ops_on_the_interpreter(monkeypatch, tail):
    """`ops.add_residual_norm` on the Mosaic GPU interpreter: for a `Deferred` projection of 1 and 3 x 2 live rows
    (plain and `Padded` h) it takes the fused kernel and gives `add_residual` then `rms_norm`'s bits (the norm
    padded for the next projection, `Padded`, or not; RESIDUAL_NORM_ROWS raised to 8 for it); 16 rows (past it), an
    fp32 residual and a plain y take the two ops (and make no counters); the counters it threads come back zero.
    At the default RESIDUAL_NORM_ROWS (1) two rows take the two ops."""
    monkeypatch.setattr(qmm, "DECODE_IMPL", "mgpu")
    default_rows = ops.RESIDUAL_NORM_ROWS
    monkeypatch.setattr(ops, "RESIDUAL_NORM_ROWS", 8)
    monkeypatch.setattr(ops, "RESIDUAL_NORM_TAIL", tail)
    taken = []
    fused = rs.residual_add_norm
    monkeypatch.setattr(rs, "residual_add_norm", lambda *a, **k: taken.append(1) or fused(*a, **k))
    rng = np.random.default_rng(640)
    backend = Backend(kernels=True, interpret=True)
    w, nxt = _weight(rng, 192, 256), _weight(rng, 256, 192)
    norm = jnp.asarray(rng.normal(size=192), jnp.float32)
    for lead, then, expect in (((1,), nxt, True), ((3, 2), nxt, True), ((3, 2), None, True), ((16,), nxt, False)):
        h = jnp.asarray(rng.normal(size=(*lead, 256)), jnp.bfloat16)
        x = jnp.asarray(rng.normal(size=(*lead, 192)) * 3, jnp.bfloat16)
        y = ops.project(h, w, backend, prompt=False)
        assert isinstance(y, Deferred)
        taken.clear()
        counter = ops.LaunchCount(4)
        got_x, got_h = ops.add_residual_norm(backend, x, y, norm, 1e-6, then=then, prompt=False, counter=counter)
        assert bool(taken) == expect, lead
        want_x = ops.add_residual(backend, x, y)
        want_h = ops.rms_norm(backend, want_x, norm, 1e-6, then=then, prompt=False)
        assert type(got_h) is type(want_h) and got_h.shape == want_h.shape
        assert np.array_equal(bits(got_x), bits(want_x))
        assert np.array_equal(bits(ops.rows_of(got_h)[0]), bits(ops.rows_of(want_h)[0]))
        assert (counter.value is not None) == expect
        if expect:
            assert np.asarray(counter.value).tolist() == [0] * 4
    taken.clear()
    x32 = x.astype(jnp.float32)
    counter = ops.LaunchCount(1)
    ops.add_residual_norm(backend, x32[:1], ops.project(h[:1], w, backend, prompt=False), norm, 1e-6, then=nxt,
                          prompt=False, counter=counter)
    ops.add_residual_norm(backend, x[:1], x[:1], norm, 1e-6, then=nxt, prompt=False, counter=counter)
    assert not taken and counter.value is None
    monkeypatch.setattr(ops, "RESIDUAL_NORM_ROWS", default_rows)
    ops.add_residual_norm(backend, x[:2], ops.project(h[:2], w, backend, prompt=False), norm, 1e-6, then=nxt,
                          prompt=False, counter=counter)
    assert not taken
    ops.add_residual_norm(backend, x[:1], ops.project(h[:1], w, backend, prompt=False), norm, 1e-6, then=nxt,
                          prompt=False, counter=counter)
    assert taken


@pytest.mark.parametrize("tail", rs.TAILS)
def test_residual_add_norm_lowers_for_h200(h200_lowering, tail):
    sds = jax.ShapeDtypeStruct
    for m, r in ((1, 8), (8, 8), (16, 16)):
        text = jax.jit(functools.partial(rs.residual_add_norm, eps=1e-6, out_rows=r, tail=tail)).trace(
            sds((6, 5120, r), jnp.float32), sds((6, 5120), jnp.bool_), sds((m, 5120), jnp.bfloat16),
            sds((5120,), jnp.float32), sds((1,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("tail", rs.TAILS)
def test_gpu_residual_add_norm_27b(tail):
    """The 27B's down projection and a 5120-wide norm on the H200: the fused kernel's sum and norm bit for bit the
    two kernels' (`residual_add`, `rownorm.rms_norm(..., out_rows=R)`), at 1 and 8 live rows of an 8-row piece
    and 16 of a 16-row one, the counter zero after each call and after 20 calls chained through it."""
    from pallas_kernels import rownorm
    rng = np.random.default_rng(650)
    w = _weight(rng, 5120, 17408)
    norm = jnp.asarray(rng.normal(size=5120), jnp.float32)
    h = jnp.asarray(rng.normal(size=(16, 17408)), jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(16, 5120)) * 3, jnp.bfloat16)
    for m, r in ((1, 8), (8, 8), (16, 16)):
        parts, written = qmm_mgpu.qmm_parts(h[:r], w, rows=r)
        valid = jnp.asarray(written)
        total, out, count = rs.residual_add_norm(parts, valid, x[:m], norm, jnp.zeros((1,), jnp.int32), eps=1e-6,
                                                 out_rows=r, tail=tail)
        want = rs.residual_add(parts, valid, x[:m])
        assert np.array_equal(bits(total), bits(want)), m
        assert np.array_equal(bits(out), bits(rownorm.rms_norm(want, norm, 1e-6, out_rows=r))), m
        assert np.asarray(count).tolist() == [0]
    parts, written = qmm_mgpu.qmm_parts(h[:8], w, rows=8)
    valid = jnp.asarray(written)

    @jax.jit
    def chained(x):
        count = jnp.zeros((1,), jnp.int32)
        for _ in range(20):
            x, _, count = rs.residual_add_norm(parts, valid, x, norm, count, eps=1e-6, out_rows=8, tail=tail)
        return x, count

    def unfused(x):
        for _ in range(20):
            x = rs.residual_add(parts, valid, x)
        return x

    got, count = chained(x[:1])
    assert np.array_equal(bits(got), bits(jax.jit(unfused)(x[:1]))) and np.asarray(count).tolist() == [0]
