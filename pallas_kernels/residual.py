"""The residual stream's decode rows after an output projection: the Mosaic GPU decode qmm's pieces summed, rounded,
and added to the residual, in one launch.

Without it XLA fuses the projection's epilogue (the pieces [P, N, R] summed in piece order, rounded to bf16) with
the residual add into one loop fusion per projection. Its reads follow the pieces' row-minor layout, and the 128
such fusions of a one-stream 27B round (the output projection and the MLP's down projection of each layer) took
about 440 µs, 3.4 µs a call (BENCHMARKS.md, engine, session 29). Here, as in `swiglu`, each program takes a block
of columns whole: [BN, R] tiles of every piece, each row of a column contiguous.

Math (`reference`): per column and row, the pieces added in piece order as `qmm_mgpu._decode` adds them (a piece
the tile never wrote selected as 0.0, then added), the sum rounded to bf16, then added to the residual row in
fp32 and rounded to bf16. Two bf16 values' fp32 sum rounded to bf16 is their correctly rounded sum, so this is the
model's `x + y` in bf16 whatever way XLA adds. Each output element reads only its own column and row, so a row's
bits never depend on the others.

Shapes: parts [P, N, R] fp32, valid [P, N] bool (`qmm_mgpu.qmm_parts`), x [M, N] bf16 with M <= R (the live rows
of the piece) -> x + y [M, N] bf16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import rownorm
from pallas_kernels.calls import pallas_call
from pallas_kernels.qmm_mgpu import sum_pieces

BLOCK_N = 128  # columns a program
WARPS = 4


def add(x: jax.Array, y: jax.Array) -> jax.Array:
    """x + y for bf16 x, y, rounded once (their fp32 sum is exact or rounds away only what the bf16 rounding
    drops): the kernel's and the reference's add."""
    return (x.astype(jnp.float32) + y.astype(jnp.float32)).astype(x.dtype)


def reference(parts: jax.Array, valid: jax.Array, x: jax.Array) -> jax.Array:
    total = sum_pieces(lambda i: (parts[i], valid[i][:, None]), parts.shape[0]).astype(x.dtype)  # [N, R]
    return add(x, total[:, :x.shape[0]].T)


def _add_block(valid_ref, parts_ref, x_ref, o_ref, j, *, n: int, n_pieces: int, r: int, m: int):
    """Column block j's BLOCK_N columns of x + y: valid_ref [P, N] int8; parts_ref [P, N, R] fp32; x_ref, o_ref
    [M, N] bf16, the M live rows as the first of R (the rest masked). -> (the columns' mask [BLOCK_N], the block's
    rows [R, 1], the block's slices)."""
    cols = j * BLOCK_N + jnp.arange(BLOCK_N)
    in_n = cols < n

    def load(p):
        p = jnp.int32(p)
        ok = plgpu.load(valid_ref.at[p, pl.ds(j * BLOCK_N, BLOCK_N)], mask=in_n, other=0) != 0
        vals = plgpu.load(parts_ref.at[p, pl.ds(j * BLOCK_N, BLOCK_N), :], mask=in_n[:, None], other=0.0)
        return vals, ok[:, None]

    y = sum_pieces(load, n_pieces).astype(o_ref.dtype).T  # [R, BLOCK_N]
    row = jnp.arange(r)[:, None]
    mask = (row < m) & in_n[None, :]
    block = (pl.ds(0, r), pl.ds(j * BLOCK_N, BLOCK_N))
    x = plgpu.load(x_ref.at[block], mask=mask, other=0.0)
    plgpu.store(o_ref.at[block], add(x, y), mask=mask)
    return in_n, row, block


def _kernel(valid_ref, parts_ref, x_ref, o_ref, *, n: int, n_pieces: int, r: int, m: int):
    _add_block(valid_ref, parts_ref, x_ref, o_ref, pl.program_id(0), n=n, n_pieces=n_pieces, r=r, m=m)


@functools.partial(jax.jit, static_argnames=("interpret",))
def residual_add(parts: jax.Array, valid: jax.Array, x: jax.Array, *, interpret: bool = False) -> jax.Array:
    """parts [P, N, R] fp32, valid [P, N] bool, x [M, N] bf16 (M <= R) -> [M, N] bf16 (`reference`'s values)."""
    p, n, r = parts.shape
    m = x.shape[0]
    if (valid.shape != (p, n) or r & (r - 1) or x.ndim != 2 or x.shape[1] != n or not 0 < m <= r
            or x.dtype != jnp.bfloat16):
        raise ValueError(f"residual_add: parts [P, N, R] (R a power of two), valid [P, N] and bf16 x [M <= R, N]; "
                         f"got {parts.shape}, {valid.shape}, {x.dtype} {x.shape}")
    kernel = functools.partial(_kernel, n=n, n_pieces=p, r=r, m=m)
    with jax.named_scope("residual_add"):
        return pallas_call(
            kernel,
            grid=(pl.cdiv(n, BLOCK_N),),
            in_specs=[pl.BlockSpec((p, n), lambda j: (0, 0)), pl.BlockSpec((p, n, r), lambda j: (0, 0, 0)),
                      pl.BlockSpec((m, n), lambda j: (0, 0))],
            out_specs=pl.BlockSpec((m, n), lambda j: (0, 0)),
            out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
            interpret=interpret,
            compiler_params=plgpu.CompilerParams(num_warps=WARPS, num_stages=1),
            name="residual_add",
        )(valid.astype(jnp.int8), parts, x)


# ------------------------------------------------------------------------------------------------ with the norm


def reference_norm(parts: jax.Array, valid: jax.Array, x: jax.Array, weight: jax.Array, eps: float, out_rows: int
                   ) -> tuple[jax.Array, jax.Array]:
    """(x + y as `reference`, rms_norm of it [out_rows, N] with zero rows past M): the residual add and the norm
    that reads it."""
    h = reference(parts, valid, x)
    return h, jnp.pad(rownorm.rms_norm_reference(h, weight, eps), ((0, out_rows - x.shape[0]), (0, 0)))


def _norm_kernel(valid_ref, parts_ref, x_ref, w_ref, _, o_ref, h_ref, count_ref, *, n: int, n_pieces: int, r: int,
                 m: int, out_rows: int, eps: float, tiles: rownorm.RowTiles, tail: str, blocks: int,
                 interpret: bool):
    # Programs 0 .. blocks - 1: `_kernel`'s BLOCK_N columns of x + y (o_ref [M, N]) and the norm's padding rows
    # M .. out_rows of h_ref [out_rows, N] (the norm of a zero row: 0 x weight), then each counts itself in
    # (count_ref[0] int32, zero on entry and left zero). The norm of rows 0 .. M of o_ref into h_ref, with
    # `rownorm.norm_block` (the rms_norm kernel's own body and tiles, so its bits): tail "last", by the last of
    # those programs to count in, a block of rows after another; tail "rows", by programs blocks .. blocks +
    # cdiv(M, block_rows) - 1, a block of rows each, once the count shows every column block written.
    j = pl.program_id(0)
    zero = (jnp.int32(0),)

    def add():
        in_n, row, block = _add_block(valid_ref, parts_ref, x_ref, o_ref, j, n=n, n_pieces=n_pieces, r=r, m=m)
        if out_rows > m:
            w = plgpu.load(w_ref.at[block[1]], mask=in_n, other=0.0).astype(jnp.float32)
            pad = (jnp.zeros((r, BLOCK_N), jnp.float32) * w[None, :]).astype(h_ref.dtype)
            plgpu.store(h_ref.at[block], pad, mask=(row >= m) & (row < out_rows) & in_n[None, :])
        return rownorm.count_in(count_ref, 0, interpret)

    def norm(row0):
        rownorm.counted_in(interpret)
        rownorm.norm_block(o_ref, None, w_ref, h_ref, row0, m, m, kind="rms", d=n, eps=eps, tiles=tiles,
                           io_dtype=o_ref.dtype)

    if tail == "last":
        done = add()

        @pl.when(done == blocks - 1)
        def _last():
            for row0 in range(0, m, tiles.block_rows):
                norm(row0)
            plgpu.atomic_add(count_ref, zero, jnp.int32(-blocks))  # zero for the next call
        return
    norms = pl.cdiv(m, tiles.block_rows)

    @pl.when(j < blocks)
    def _add():
        add()

    @pl.when(j >= blocks)
    def _norm():
        # Wait until every add program has counted in: they are the grid's first programs, dispatched before these
        # (and in interpret mode run before them), and the grid fits the GPU at once.
        # (the read is an atomic add of zero; its index and value come from the carry: a loop body may not close
        # over arrays in interpret mode)
        lax.while_loop(lambda c: c < blocks, lambda c: plgpu.atomic_add(count_ref, (c - c,), c - c), jnp.int32(0))
        norm((j - blocks) * tiles.block_rows)
        done = rownorm.count_in(count_ref, 0, interpret)

        @pl.when(done == blocks + norms - 1)
        def _reset():
            plgpu.atomic_add(count_ref, zero, jnp.int32(-(blocks + norms)))  # zero for the next call


TAILS = ("last", "rows")


@functools.partial(jax.jit, static_argnames=("eps", "out_rows", "tail", "interpret"))
def residual_add_norm(parts: jax.Array, valid: jax.Array, x: jax.Array, weight: jax.Array, count: jax.Array, *,
                      eps: float, out_rows: int | None = None, tail: str = "last", interpret: bool = False
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`residual_add` and the `rownorm.rms_norm` that reads its result, in one launch: parts [P, N, R] fp32, valid
    [P, N] bool, x [M, N] bf16 (M <= R), weight [N], count int32 [>= 1] zero (launch counters, the first used:
    give each call the previous call's returned ones) -> (x + y [M, N], its norm [out_rows, N] with zero rows past
    M as `rms_norm(..., out_rows=out_rows)` writes them (out_rows None: M), count, zero again). Each value is the
    unfused kernels' bit for bit (`reference_norm`'s up to the norm's summation order). tail (TAILS): who
    normalises once the sum is written: "last", the last add program to finish, the rows one after another;
    "rows", programs of their own, a block of rows each, in parallel."""
    p, n, r = parts.shape
    m = x.shape[0]
    out_rows = m if out_rows is None else out_rows
    if (valid.shape != (p, n) or r & (r - 1) or x.ndim != 2 or x.shape[1] != n or not 0 < m <= r
            or x.dtype != jnp.bfloat16):
        raise ValueError(f"residual_add_norm: parts [P, N, R] (R a power of two), valid [P, N] and bf16 x [M <= R, "
                         f"N]; got {parts.shape}, {valid.shape}, {x.dtype} {x.shape}")
    if weight.shape != (n,) or count.ndim != 1 or count.dtype != jnp.int32 or not m <= out_rows <= r:
        raise ValueError(f"residual_add_norm: weight [{n}], count int32 [>= 1], M <= out_rows <= R; got "
                         f"{weight.shape}, {count.dtype} {count.shape}, out_rows={out_rows}")
    if tail not in TAILS:
        raise ValueError(f"residual_add_norm: tail {tail!r} is not one of {TAILS}")
    tiles = rownorm.tiles_for(n)
    blocks = pl.cdiv(n, BLOCK_N)
    kernel = functools.partial(_norm_kernel, n=n, n_pieces=p, r=r, m=m, out_rows=out_rows, eps=float(eps),
                               tiles=tiles, tail=tail, blocks=blocks, interpret=interpret)
    whole = lambda *shape: pl.BlockSpec(shape, lambda j: (0,) * len(shape))
    with jax.named_scope("residual_add_norm"):
        return pallas_call(
            kernel,
            grid=(blocks + (pl.cdiv(m, tiles.block_rows) if tail == "rows" else 0),),
            in_specs=[whole(p, n), whole(p, n, r), whole(m, n), whole(n), whole(*count.shape)],
            out_specs=[whole(m, n), whole(out_rows, n), whole(*count.shape)],
            out_shape=[jax.ShapeDtypeStruct((m, n), x.dtype), jax.ShapeDtypeStruct((out_rows, n), x.dtype),
                       jax.ShapeDtypeStruct(count.shape, jnp.int32)],
            input_output_aliases={4: 2},
            interpret=interpret,
            # the norm's own warps: its row reductions then lower as rms_norm's do
            compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
            name="residual_add_norm",
        )(valid.astype(jnp.int8), parts, x, weight, count)
