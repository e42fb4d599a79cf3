"""Row norms over the last axis whose bits for a row never depend on how many rows share the call.

XLA:GPU picks the reduction strategy of a row reduction (threads per row, vector width, rows per block) from the
whole array's shape, so a norm emitted by XLA may give row 0 different bits in a [1, H] call than in a [16, H]
call; that breaks "concurrent == solo" decoding. These kernels fix the order of every row's sum from the row
length alone:

  * the rows are flattened to [N, D] and cut into blocks of `block_rows` rows, one block per program;
  * a row is read as D / chunk column chunks of `chunk` (a power of two dividing D) columns; the squares of the
    chunks are added elementwise in chunk order, then one in-kernel sum reduces the [block_rows, chunk] block
    along the columns, the same Triton reduction for every row;
  * the live row count N reaches the kernel as a runtime operand, not a constant, and the grid has at least two
    programs, so the compiled kernel is the same program for every N and only the grid size changes.

Default tiles depend on D only (`tiles_for`). The math follows qwen_jax.model's norms op for op: fp32 sum of
squares, times the rounded 1/D (XLA rewrites jnp.mean's division by D into that multiply), rsqrt, multiplies in the
same order, casts at the same points. Against those jnp forms the kernels differ only by the summation order, i.e.
within fp32 rounding.

Shapes: x [..., D] any rank; weight [D]; gate [..., D] like x.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.calls import pallas_call

_F32 = jnp.float32
_MAX_CHUNK = 1024  # columns per load: one 5120-wide hidden row is five 1024-column chunks
_BLOCK_ELEMENTS = 4096  # rows per program are chosen so a block holds about this many elements


@dataclasses.dataclass(frozen=True)
class RowTiles:
    """block_rows rows per program, read `chunk` columns at a time (both powers of two; chunk divides D)."""
    block_rows: int
    chunk: int
    num_warps: int = 4


def tiles_for(d: int) -> RowTiles:
    """The default tiles for rows of length d: a function of d alone, which is what makes the kernels' bits
    independent of the row count."""
    chunk = min(d & -d, _MAX_CHUNK)  # the largest power of two dividing d, capped
    chunks = d // chunk
    block_rows = max(1, min(64, _BLOCK_ELEMENTS // (chunks * chunk)))
    block_rows = 1 << (block_rows.bit_length() - 1)
    num_warps = 8 if block_rows * d > _BLOCK_ELEMENTS else 4
    return RowTiles(block_rows=block_rows, chunk=chunk, num_warps=num_warps)


# ------------------------------------------------------------------------------------------------ reference


def rms_norm_reference(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., D]; weight [D] (the fp32 multiplier) -> [..., D] x.dtype: normalise in fp32, times weight, cast."""
    xf = x.astype(_F32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * weight).astype(x.dtype)


def gated_rms_norm_reference(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x, gate [..., D]; weight [D] -> [..., D] x.dtype: normalise in fp32, cast, scale by weight in x's dtype,
    then times silu(gate) in fp32, cast (GDN's output norm)."""
    dtype = x.dtype
    xf = x.astype(_F32)
    n = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(dtype)
    y = weight.astype(dtype) * n
    return (y.astype(_F32) * jax.nn.silu(gate.astype(_F32))).astype(dtype)


def l2norm_reference(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x [..., D] -> [..., D] fp32: x * rsqrt(sum(x^2) + eps) (GDN's q/k norm)."""
    xf = x.astype(_F32)
    return xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)


# ------------------------------------------------------------------------------------------------ kernel


def _norm_kernel(n_ref, *refs, kind: str, d: int, eps: float, tiles: RowTiles, io_dtype):
    # n_ref [2] int32: live rows N, output rows R >= N (rows N..R-1 are written as the norm of a zero row: zeros).
    # refs: x_ref [N, D]; gate_ref [N, D] (gated); weight_ref [D] (rms, gated); o_ref [R, D].
    o_ref = refs[-1]
    x_ref = refs[0]
    gate_ref = refs[1] if kind == "gated" else None
    weight_ref = refs[-2] if kind in ("rms", "gated") else None
    norm_block(x_ref, gate_ref, weight_ref, o_ref, pl.program_id(0) * tiles.block_rows, n_ref[0], n_ref[1],
               kind=kind, d=d, eps=eps, tiles=tiles, io_dtype=io_dtype)


def count_in(count_ref, index, interpret: bool) -> jax.Array:
    """For a kernel whose last program to finish a piece of work goes on with it (a norm over what they all
    wrote): count this program in on count_ref[index] (int32) after all its threads' stores, acquire-release at GPU
    scope (one thread's atomic, after a barrier) -> the count before it."""
    if not interpret:
        plgpu.debug_barrier()  # every thread's stores before the release of the count
    return plgpu.atomic_add(count_ref, (jnp.asarray(index, jnp.int32),), jnp.int32(1))


def counted_in(interpret: bool) -> None:
    """After a `count_in` (or an atomic read of the count) that showed every program in: the barrier that extends
    that one thread's acquire to the program's other threads, so their loads see the other programs' stores in the
    PTX memory model (the acquire at GPU scope also drops this SM's stale L1 lines)."""
    if not interpret:
        plgpu.debug_barrier()


def norm_block(x_ref, gate_ref, weight_ref, o_ref, row0, live_rows, written_rows, *, kind: str, d: int, eps: float,
               tiles: RowTiles, io_dtype, only_row=None) -> None:
    """One program's block of rows: rows row0 .. row0 + block_rows of o_ref get the norm of x_ref's rows, those at
    or past live_rows read as zeros, those at or past written_rows left unwritten. The kernels' one body: another
    kernel that calls it with the same tiles (and num_warps) reduces each row in the same order, so gives it the
    same bits. only_row: store that row of the block alone (each row's values depend on that row only, so the
    block's other rows may hold anything)."""
    bn, c = tiles.block_rows, tiles.chunk
    rows = pl.ds(row0, bn)
    row = row0 + jax.lax.broadcasted_iota(jnp.int32, (bn, c), 0)
    live, written = row < live_rows, row < written_rows
    if only_row is not None:
        written = written & (row == only_row)
    cols = [pl.ds(j * c, c) for j in range(d // c)]

    xs = [plgpu.load(x_ref.at[rows, col], mask=live, other=0).astype(_F32) for col in cols]
    # The weight and gate chunks are read before the reduction, not after it: their loads then overlap the x loads
    # instead of adding a second memory round trip after the sum (the norms are latency-bound at decode sizes).
    # Same values and operations, so the same bits.
    ws = [weight_ref[col] for col in cols] if weight_ref is not None else [None] * len(cols)
    gs = ([plgpu.load(gate_ref.at[rows, col], mask=live, other=0) for col in cols] if gate_ref is not None
          else [None] * len(cols))
    squares = xs[0] * xs[0]
    for xc in xs[1:]:
        squares = squares + xc * xc
    total = jnp.sum(squares, axis=1, keepdims=True)  # [bn, 1]
    if kind == "l2":
        inv = jax.lax.rsqrt(total + eps)
    else:
        # jnp.mean's division by D, as XLA emits it: a multiply by the fp32-rounded 1/D.
        inv = jax.lax.rsqrt(total * np.float32(1.0 / d) + eps)

    for col, xc, wc, gc in zip(cols, xs, ws, gs):
        if kind == "l2":
            out = xc * inv
        elif kind == "rms":
            out = (xc * inv) * wc.astype(_F32)[None, :]
        else:
            n = (xc * inv).astype(io_dtype)
            # A product of two values of io_dtype is exact in fp32 for bf16 (and is the fp32 product for fp32),
            # so one rounding gives the correctly rounded product in io_dtype, as the reference's multiply does.
            w = wc.astype(io_dtype).astype(_F32)[None, :]
            y = (w * n.astype(_F32)).astype(io_dtype)
            out = y.astype(_F32) * jax.nn.silu(gc.astype(_F32))
        plgpu.store(o_ref.at[rows, col], out.astype(o_ref.dtype), mask=written)


def _check_tiles(tiles: RowTiles, d: int) -> None:
    for name in ("block_rows", "chunk", "num_warps"):
        v = getattr(tiles, name)
        if v < 1 or v & (v - 1):
            raise ValueError(f"RowTiles.{name} must be a power of two, got {v}")
    if d % tiles.chunk:
        raise ValueError(f"RowTiles.chunk={tiles.chunk} must divide the row length {d}")


def _row_length(x: jax.Array) -> int:
    if x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must have a non-empty last axis to normalise over, got shape {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be floating point, got {x.dtype}")
    return x.shape[-1]


def _check_weight(weight: jax.Array, d: int) -> None:
    if tuple(weight.shape) != (d,):
        raise ValueError(f"weight must have shape ({d},) to match x's last axis, got {tuple(weight.shape)}")


def _call(kind: str, x: jax.Array, gate: jax.Array | None, weight: jax.Array | None, eps: float, out_dtype,
          tiles: RowTiles | None, interpret: bool, out_rows: int | None = None) -> jax.Array:
    d = x.shape[-1]
    tiles = tiles_for(d) if tiles is None else tiles
    _check_tiles(tiles, d)
    lead = x.shape[:-1]
    n = int(np.prod(lead, dtype=np.int64))
    if out_rows is not None:
        if out_rows < n:
            raise ValueError(f"out_rows={out_rows} must be at least the {n} rows of x")
        if n == 0:
            return jnp.zeros((out_rows, d), out_dtype)
    elif n == 0:
        return jnp.zeros(x.shape, out_dtype)
    r = n if out_rows is None else out_rows
    operands = [a.reshape(n, d) for a in (x, gate) if a is not None] + ([] if weight is None else [weight])
    # A fresh partial per call: jax#40847 reuses a stale jaxpr when one kernel function meets several grids.
    kernel = functools.partial(_norm_kernel, kind=kind, d=d, eps=float(eps), tiles=tiles, io_dtype=x.dtype)
    with jax.named_scope(f"rownorm_{kind}"):
        out = pallas_call(
            kernel,
            # At least two programs: the Triton lowering turns the program id of a one-program grid into the
            # constant 0, which would make a single block's kernel a different program from the others'.
            grid=(max(2, pl.cdiv(r, tiles.block_rows)),),
            out_shape=jax.ShapeDtypeStruct((r, d), out_dtype),
            interpret=interpret,
            compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
            name=f"rownorm_{kind}",
        )(jnp.asarray([n, r], jnp.int32), *operands)
    return out if out_rows is not None else out.reshape(*lead, d)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, tiles: RowTiles | None = None,
             interpret: bool = False, out_rows: int | None = None) -> jax.Array:
    """rms_norm_reference as a kernel: x [..., D] bf16/fp32; weight [D] -> [..., D] x.dtype. Row i's bits depend on
    row i, weight, eps and the tiles (by default a function of D) only, never on the other rows or their count.
    out_rows: return [out_rows, D] instead, x's N rows flattened first and zero rows after them (a matmul that
    pads its rows reads them as they are)."""
    d = _row_length(x)
    _check_weight(weight, d)
    return _call("rms", x, None, weight, eps, x.dtype, tiles, interpret, out_rows)


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float, *, tiles: RowTiles | None = None,
                   interpret: bool = False, out_rows: int | None = None) -> jax.Array:
    """gated_rms_norm_reference as a kernel: x, gate [..., D]; weight [D] -> [..., D] x.dtype, row invariant like
    rms_norm; out_rows as there."""
    d = _row_length(x)
    if tuple(gate.shape) != tuple(x.shape):
        raise ValueError(f"gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
    _check_weight(weight, d)
    return _call("gated", x, gate, weight, eps, x.dtype, tiles, interpret, out_rows)


def l2norm(x: jax.Array, eps: float = 1e-6, *, tiles: RowTiles | None = None, interpret: bool = False
           ) -> jax.Array:
    """l2norm_reference as a kernel: x [..., D] -> [..., D] fp32, row invariant like rms_norm."""
    _row_length(x)
    return _call("l2", x, None, None, eps, _F32, tiles, interpret)
