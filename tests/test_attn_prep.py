"""The attention rows' q/k norm + RoPE kernel (pallas_kernels/attn_prep.py) against its reference, the model's own
ops, float64, and a row alone against the same row among others (bitwise). CPU: interpret mode at the tiny
checkpoint's heads and the 27B's; `gpu`: compiled at the 27B's (24 / 4 heads, D 256, rotary 64)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import attn_prep as ap
from pallas_kernels import rownorm
from qwen_jax.model.layers import apply_rope

INTERPRET = jax.default_backend() != "gpu"
TINY = dict(hq=4, hkv=2, d=64, rotary_dim=16)
BIG = dict(hq=24, hkv=4, d=256, rotary_dim=64)
EPS = 1e-6


def _case(rng, dims, s, r, dtype):
    hq, hkv, d, rd = dims["hq"], dims["hkv"], dims["d"], dims["rotary_dim"]
    y = jnp.asarray(rng.normal(size=(s, r, hq * 2 * d + 2 * hkv * d)) * 3, dtype)
    qw, kw = (jnp.asarray(rng.uniform(0.5, 1.5, size=d), jnp.float32) for _ in range(2))
    ang = jnp.asarray(rng.uniform(0, 4096, size=(s, r, rd // 2)) / (10000.0 ** (np.arange(rd // 2) / (rd // 2))),
                      jnp.float32)
    return y, qw, kw, jnp.cos(ang), jnp.sin(ang), ang


def _run(dims, *args):
    return jax.jit(functools.partial(ap.prep, interpret=INTERPRET, eps=EPS, **dims))(*args)


def _rel(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def _check(dims, dtype):
    rng = np.random.default_rng(5)
    s, r = 3, 4
    y, qw, kw, cos, sin, ang = _case(rng, dims, s, r, dtype)
    out = _run(dims, y, qw, kw, cos, sin)
    ref = ap.prep_reference(y, qw, kw, cos, sin, eps=EPS, **dims)
    hq, hkv, d, rd = dims["hq"], dims["hkv"], dims["d"], dims["rotary_dim"]
    # the model's ops: the row-norm reference, then apply_rope
    q = y[..., :hq * 2 * d].reshape(s, r, hq, 2 * d)[..., :d]
    k = y[..., hq * 2 * d:hq * 2 * d + hkv * d].reshape(s, r, hkv, d)
    model = (apply_rope(rownorm.rms_norm_reference(q, qw, EPS), ang, rd),
             apply_rope(rownorm.rms_norm_reference(k, kw, EPS), ang, rd))
    tol = 1e-6 if dtype == jnp.float32 else 4e-3  # fp32 sums in another order; bf16: one rounding apart at most
    for name, a, b, m in zip("qk", out, ref, model):
        assert a.shape == b.shape and a.dtype == dtype
        assert _rel(a, b) < tol, name
        assert _rel(a, m) < tol, name
    assert np.array_equal(np.asarray(out[2]), np.asarray(ref[2])), "v is a copy"
    # float64: the norm and the rotation without roundings
    y64 = np.asarray(y, np.float64)
    x = y64[..., :hq * 2 * d].reshape(s, r, hq, 2 * d)[..., :d]
    n = x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * np.asarray(qw, np.float64)
    a64 = np.asarray(ang, np.float64)[:, :, None, :]
    lo, hi = n[..., :rd // 2], n[..., rd // 2:rd]
    q64 = np.concatenate([lo * np.cos(a64) - hi * np.sin(a64), hi * np.cos(a64) + lo * np.sin(a64), n[..., rd:]], -1)
    assert _rel(out[0], q64) < (1e-5 if dtype == jnp.float32 else 8e-3)
    # a row alone == the same row among others
    alone = _run(dims, y[1:2, 2:3], qw, kw, cos[1:2, 2:3], sin[1:2, 2:3])
    for name, a, b in zip("qkv", alone, out):
        assert np.array_equal(np.asarray(a)[0, 0], np.asarray(b)[1, 2]), f"{name}: alone != among others"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("dims", [TINY, BIG], ids=["tiny", "27b"])
def test_attn_prep_matches_reference_model_ops_and_float64(dims, dtype):
    _check(dims, dtype)


def _check_pieces(dims, r: int):
    """`qmm_mgpu.Pieces` (the qkv projection's decode qmm pieces, summed and rounded in the kernel): q, k, v the bits
    of the same call on their materialized y, and the gate y's gate columns, for 3 streams x 2 rows in an r-row
    piece; unwritten pieces hold NaN and must be selected away; the reference agrees."""
    from pallas_kernels.qmm_mgpu import Pieces
    from tests.test_swiglu import random_pieces
    rng = np.random.default_rng(7)
    s, rows = 3, 2
    y0, qw, kw, cos, sin, _ = _case(rng, dims, s, rows, jnp.bfloat16)
    parts, valid = random_pieces(rng, 3, y0.shape[-1], r)
    pieces = Pieces(parts, valid, (s, rows))
    y = pieces.materialize()
    got = _run(dims, pieces, qw, kw, cos, sin)
    want = _run(dims, y, qw, kw, cos, sin) + (ap.gate_of(y, dims["hq"], dims["d"]),)
    assert len(got) == 4 and got[3].shape == (s, rows, dims["hq"] * dims["d"])
    for name, a, b in zip(("q", "k", "v", "gate"), got, want):
        assert a.dtype == jnp.bfloat16 and np.array_equal(np.asarray(a), np.asarray(b)), name
    ref = ap.prep_reference(pieces, qw, kw, cos, sin, eps=EPS, **dims)
    for name, a, b in zip(("q", "k", "v", "gate"), ref, ap.prep_reference(y, qw, kw, cos, sin, eps=EPS, **dims)
                          + (ap.gate_of(y, dims["hq"], dims["d"]),)):
        assert np.array_equal(np.asarray(a), np.asarray(b)), name
    with pytest.raises(ValueError, match="live rows"):
        ap.prep(Pieces(parts, valid, (s, r)), qw, kw, cos, sin, eps=EPS, **dims)


def test_attn_prep_reads_pieces_bitwise():
    _check_pieces(TINY, 8)


@pytest.mark.parametrize("dims,r,packed_rows", [(TINY, 4, 16), (TINY, 3, 64), (BIG, 1, 64), (BIG, 16, 128)],
                         ids=["tiny-4", "tiny-3", "27b-1", "27b-16"])
def test_attn_prep_packs_q_for_the_window(dims, r, packed_rows):
    """packed_rows: the packed q is `attention_window_mgpu.pack_queries` of the call's own q, bit for bit, zero rows
    included (in 27B-1 58 of a KV head's 64 rows are zero, in tiny-3 3 rows of the last share are not written by
    every row's program), from an array and from pieces; q, k, v and the gate are the call's without it."""
    from pallas_kernels import attention_window_mgpu as awm
    from pallas_kernels.qmm_mgpu import Pieces
    from tests.test_swiglu import random_pieces
    rng = np.random.default_rng(9)
    s = 2
    y, qw, kw, cos, sin, _ = _case(rng, dims, s, r, jnp.bfloat16)
    parts, valid = random_pieces(rng, 3, y.shape[-1], 8 * -(-s * r // 8))
    for src in (y, Pieces(parts, valid, (s, r))):
        plain = _run(dims, src, qw, kw, cos, sin)
        got = _run(dict(dims, packed_rows=packed_rows), src, qw, kw, cos, sin)
        assert len(got) == len(plain) + 1
        for a, b in zip(got, plain):
            assert np.array_equal(np.asarray(a), np.asarray(b))
        live = r * dims["hq"] // dims["hkv"]  # pack_queries pads to whole warpgroups: its live rows, then zeros
        want = jnp.zeros((s, dims["hkv"], packed_rows, dims["d"]), jnp.bfloat16).at[:, :, :live].set(
            awm.pack_queries(plain[0], dims["hkv"])[:, :, :live])
        assert got[-1].shape == want.shape and np.array_equal(np.asarray(got[-1]).view(np.uint16),
                                                              np.asarray(want).view(np.uint16))
    with pytest.raises(ValueError, match="packed_rows"):
        ap.prep(y, qw, kw, cos, sin, eps=EPS, packed_rows=r * dims["hq"] // dims["hkv"] - 1, **dims)


def test_attn_prep_rejects_bad_inputs():
    rng = np.random.default_rng(6)
    y, qw, kw, cos, sin, _ = _case(rng, TINY, 1, 2, jnp.float32)
    with pytest.raises(ValueError, match="columns"):
        ap.prep(y[..., 1:], qw, kw, cos, sin, eps=EPS, **TINY)
    with pytest.raises(ValueError, match="powers of two"):
        ap.prep(y, qw, kw, cos, sin, eps=EPS, **dict(TINY, rotary_dim=12))
    with pytest.raises(ValueError, match="q_weight must be"):
        ap.prep(y, qw[:8], kw, cos, sin, eps=EPS, **TINY)
    with pytest.raises(ValueError, match="cos must be"):
        ap.prep(y, qw, kw, cos[:, :1], sin, eps=EPS, **TINY)


def test_attn_prep_lowers_for_h200(h200_lowering):
    sds = jax.ShapeDtypeStruct
    d, rd = BIG["d"], BIG["rotary_dim"]
    args = (sds((2, 16, BIG["hq"] * 2 * d + 2 * BIG["hkv"] * d), jnp.bfloat16), sds((d,), jnp.float32),
            sds((d,), jnp.float32), sds((2, 16, rd // 2), jnp.float32), sds((2, 16, rd // 2), jnp.float32))
    text = jax.jit(functools.partial(ap.prep, eps=EPS, **BIG)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_attn_prep_27b(dtype):
    _check(BIG, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("r", [8, 16])
def test_gpu_attn_prep_reads_pieces_27b(r):
    _check_pieces(BIG, r)
