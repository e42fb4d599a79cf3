"""The attention layers' verify and step rows between the qkv projection and the window: q/k RMS norm and partial
rotate-half RoPE in one launch.

Without it a gated attention layer of a decode round runs, after its projection, the q and k norms (one row-norm
kernel each) and XLA fusions for the q, k and v slices and the two rotations (each a concatenation). `prep` takes
the projection's output y [S, R, N] whole (columns: per query head [q D | gate D], then k, then v) and writes q and k
normed and rotated, and v, for every (stream, row, head) in one program each. The gate stays in y, where the
output's sigmoid multiply reads it. Given the projection's decode qmm pieces instead (`qmm_mgpu.Pieces`), it sums and
rounds y's columns itself (the projection's epilogue, `piece_row`) and writes the gate [S, R, Hq D] too, so no
launch sits between the qmm and it. Given `packed_rows` M, it also writes q packed as the Mosaic GPU window pass 1
reads it (`attention_window_mgpu.pack_queries`: [S, Hkv, M, D], KV head g's row r G + h query head g G + h of row r,
zeros after R G), so no pad launch sits between it and the window either.

The math is `prep_reference`'s, which is the model's own path (`ops.rms_norm`, then `layers.apply_rope`): normalise
in fp32 (the sum of squares times the fp32-rounded 1/D, as XLA emits jnp.mean), times the fp32 multiplier, round to
the activation dtype; rotate the first rotary_dim dims of that in fp32 and round again. The kernel's sums run in
another order (pieces of D added in sequence, each reduced by Triton), so the two agree to fp32 rounding before the
casts. Each program reads one row and writes one row, so a row's bits never depend on the other rows or streams.

Shapes: y [S, R, Hq 2D + 2 Hkv D]; q_weight, k_weight [D] fp32; cos, sin [S, R, rotary_dim / 2] fp32 (of the
rows' RoPE angles, shared by every layer); D and rotary_dim powers of two, rotary_dim <= D.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.calls import pallas_call
from pallas_kernels.qmm_mgpu import Pieces, piece_row, rows_operands, rows_shape

_F32 = jnp.float32
WARPS = 1


def _pieces(d: int, rd: int) -> list[tuple[int, int]]:
    """[0, D) as power-of-two pieces (start, size): the two halves of the rotary dims, then doubling blocks."""
    half = rd // 2
    out = [(0, half), (half, half)]
    start = rd
    while start < d:
        out.append((start, start))
        start *= 2
    return out


def supports(d: int, rotary_dim: int) -> bool:
    """Whether `prep` takes these dims: D and rotary_dim powers of two (at least 2), rotary_dim <= D."""
    return all(n >= 2 and n & (n - 1) == 0 for n in (d, rotary_dim)) and rotary_dim <= d


def _check(y, q_weight: jax.Array, k_weight: jax.Array, cos: jax.Array, sin: jax.Array, *, hq: int,
           hkv: int, d: int, rotary_dim: int) -> tuple[tuple[int, ...], jnp.dtype]:
    shape, dtype = rows_shape(y, "attn_prep")
    s, r, n = shape
    if n != hq * 2 * d + 2 * hkv * d:
        raise ValueError(f"attn_prep: y's last axis must hold q|gate, k, v = {hq * 2 * d + 2 * hkv * d} columns for "
                         f"hq={hq}, hkv={hkv}, d={d}, got {n}")
    if not supports(d, rotary_dim):
        raise ValueError(f"attn_prep: d ({d}) and rotary_dim ({rotary_dim}) must be powers of two, rotary_dim <= d")
    for label, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (d,):
            raise ValueError(f"attn_prep: {label} must be [D] = ({d},), got {w.shape}")
    for label, a in (("cos", cos), ("sin", sin)):
        if a.shape != (s, r, rotary_dim // 2):
            raise ValueError(f"attn_prep: {label} must be [S, R, rotary_dim / 2] = {(s, r, rotary_dim // 2)}, "
                             f"got {a.shape}")
    return shape, dtype


def prep_reference(y: jax.Array, q_weight: jax.Array, k_weight: jax.Array, cos: jax.Array, sin: jax.Array, *,
                   hq: int, hkv: int, d: int, rotary_dim: int, eps: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """-> q [S, R, Hq, D], k, v [S, R, Hkv, D] in y.dtype (see the module docstring); for `Pieces` y also the gate
    [S, R, Hq D]."""
    _check(y, q_weight, k_weight, cos, sin, hq=hq, hkv=hkv, d=d, rotary_dim=rotary_dim)
    pieces = isinstance(y, Pieces)
    if pieces:
        y = y.materialize()
    s, r, _ = y.shape
    q = y[..., :hq * 2 * d].reshape(s, r, hq, 2 * d)[..., :d]
    k = y[..., hq * 2 * d:hq * 2 * d + hkv * d].reshape(s, r, hkv, d)
    v = y[..., hq * 2 * d + hkv * d:].reshape(s, r, hkv, d)
    half = rotary_dim // 2
    c, sn = (jnp.concatenate([a, a], axis=-1)[:, :, None, :] for a in (cos, sin))

    def norm_rope(x, w):
        xf = x.astype(_F32)
        n = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * w).astype(y.dtype)
        xr = n[..., :rotary_dim].astype(_F32)
        rotated = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
        return jnp.concatenate([(xr * c + rotated * sn).astype(y.dtype), n[..., rotary_dim:]], axis=-1)

    out = norm_rope(q, q_weight), norm_rope(k, k_weight), v
    return out + (gate_of(y, hq, d),) if pieces else out


def gate_of(y: jax.Array, hq: int, d: int) -> jax.Array:
    """The output gate [S, R, Hq D] in y [S, R, N] (per query head [q D | gate D])."""
    s, r, _ = y.shape
    return y[..., :hq * 2 * d].reshape(s, r, hq, 2 * d)[..., d:].reshape(s, r, hq * d)


def _kernel(*refs, hq: int, hkv: int, d: int, rd: int, eps: float, n_pieces: int, rows: int,
            packed_rows: int | None):
    """Program (stream s, row r, head j): query head j for j < Hq (and its gate, from pieces; and its packed row),
    else KV head j - Hq (k, and v copied; and its share of the packed q's zero rows). refs: y [S, R, N] (n_pieces 0)
    or `Pieces`' valid [P, N] int8 and parts [P, N, R'] (P pieces, y's row (s, r) their row s R + r with rows = R);
    the weights, cos, sin; q, k, v (and the gate, from pieces; and the packed q, with packed_rows)."""
    qp_ref = refs[-1] if packed_rows else None
    refs = refs[:-1] if packed_rows else refs
    if n_pieces:
        valid_ref, parts_ref, qw_ref, kw_ref, cos_ref, sin_ref, q_ref, k_ref, v_ref, gate_ref = refs
    else:
        y_ref, qw_ref, kw_ref, cos_ref, sin_ref, q_ref, k_ref, v_ref = refs
    s, r, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    group = hq // hkv
    dtype = q_ref.dtype

    def y_at(cols):
        if n_pieces:
            return piece_row(parts_ref, valid_ref, n_pieces, s * rows + r, cols, dtype)
        return y_ref[s, r, cols]

    is_q = j < hq
    kv = jnp.maximum(j - hq, 0)
    base = jnp.where(is_q, j * 2 * d, hq * 2 * d + kv * d)
    spans = _pieces(d, rd)
    xs = [y_at(pl.ds(base + a, n)).astype(_F32) for a, n in spans]
    ws = [jnp.where(is_q, qw_ref[pl.ds(a, n)], kw_ref[pl.ds(a, n)]).astype(_F32) for a, n in spans]
    c, sn = cos_ref[s, r, :], sin_ref[s, r, :]
    total = jnp.sum(xs[0] * xs[0])
    for x in xs[1:]:
        total = total + jnp.sum(x * x)
    inv = jax.lax.rsqrt(total * np.float32(1.0 / d) + eps)
    ns = [((x * inv) * w).astype(dtype) for x, w in zip(xs, ws)]
    lo, hi = ns[0].astype(_F32), ns[1].astype(_F32)
    outs = [(lo * c - hi * sn).astype(dtype), (hi * c + lo * sn).astype(dtype)] + ns[2:]

    @pl.when(is_q)
    def _():
        for (a, n), o in zip(spans, outs):
            q_ref[s, r, j, pl.ds(a, n)] = o
            if packed_rows:
                qp_ref[s, j // group, r * group + j % group, pl.ds(a, n)] = o
        if n_pieces:
            gate_ref[s, r, pl.ds(j * d, d)] = y_at(pl.ds(j * 2 * d + d, d))

    @pl.when(jnp.logical_not(is_q))
    def _():
        for (a, n), o in zip(spans, outs):
            k_ref[s, r, kv, pl.ds(a, n)] = o
        v_ref[s, r, kv, :] = y_at(pl.ds(hq * 2 * d + hkv * d + kv * d, d))
        if packed_rows:  # KV head kv's zero rows R G + r + R i (i = 0, 1, ...) below packed_rows
            zeros = jnp.zeros((d,), dtype)
            live = rows * group
            for i in range(-(-(packed_rows - live) // rows)):
                if live + rows * (i + 1) <= packed_rows:  # every row r has this one
                    qp_ref[s, kv, live + r + rows * i, :] = zeros
                else:
                    @pl.when(live + r + rows * i < packed_rows)
                    def _():
                        qp_ref[s, kv, live + r + rows * i, :] = zeros


def prep(y, q_weight: jax.Array, k_weight: jax.Array, cos: jax.Array, sin: jax.Array, *, hq: int,
         hkv: int, d: int, rotary_dim: int, eps: float, packed_rows: int | None = None,
         interpret: bool = False) -> tuple[jax.Array, ...]:
    """`prep_reference` in one launch, grid (stream, row, Hq + Hkv heads); y an array or `Pieces`. packed_rows M:
    q packed for the Mosaic GPU window pass 1 ([S, Hkv, M, D], M >= R Hq / Hkv) comes last, after the gate."""
    (s, r, _), dtype = _check(y, q_weight, k_weight, cos, sin, hq=hq, hkv=hkv, d=d, rotary_dim=rotary_dim)
    if packed_rows is not None and packed_rows < r * (hq // hkv):
        raise ValueError(f"attn_prep: packed_rows ({packed_rows}) must hold the window's R * Hq / Hkv = "
                         f"{r * (hq // hkv)} packed query rows")
    ys, n_pieces = rows_operands(y)
    out_shape = (jax.ShapeDtypeStruct((s, r, hq, d), dtype), jax.ShapeDtypeStruct((s, r, hkv, d), dtype),
                 jax.ShapeDtypeStruct((s, r, hkv, d), dtype))
    if n_pieces:
        out_shape += (jax.ShapeDtypeStruct((s, r, hq * d), dtype),)
    if packed_rows:
        out_shape += (jax.ShapeDtypeStruct((s, hkv, packed_rows, d), dtype),)
    return pallas_call(
        functools.partial(_kernel, hq=hq, hkv=hkv, d=d, rd=rotary_dim, eps=float(eps), n_pieces=n_pieces, rows=r,
                          packed_rows=packed_rows),
        out_shape=out_shape,
        grid=(s, r, hq + hkv),
        compiler_params=plgpu.CompilerParams(num_warps=WARPS),
        interpret=interpret,
        name="attn_prep",
    )(*ys, q_weight, k_weight, cos.astype(_F32), sin.astype(_F32))
