"""The MLP's decode rows between its two projections: the Mosaic GPU decode qmm's gate/up pieces summed, rounded,
and SwiGLU'd into the down projection's padded rows, in one launch.

Without it XLA fuses that epilogue with the activation and the pad for the down projection's rows into one loop
fusion, which read the pieces [P, N, R] (R the piece height, N the output features) across their row-minor layout
and took 4.7 µs a call at the 27B's shape (N = 2 x 17408), 301 µs of a one-stream round (BENCHMARKS.md, engine,
session 28). Here each program takes a block of columns of the gate and the up halves whole: [BN, R] tiles, every
row of a column contiguous.

Math (`reference`): per column and row, the pieces added in piece order as `qmm_mgpu._decode` adds them (a piece
the tile never wrote selected as 0.0, then added), the sum rounded to bf16; then silu(gate) x up in fp32, rounded
to bf16 (the model's `layers.mlp`). Rows at or past `live` are written as zeros, as a norm's padded rows are
(`ops.Padded`). Each output element reads only its own column and row, so a row's bits never depend on the
others.

Shapes: parts [P, 2N, R] fp32 (columns: gate 0..N-1, then up), valid [P, 2N] bool (`qmm_mgpu.qmm_parts`) ->
act [R, N] bf16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.calls import pallas_call
from pallas_kernels.qmm_mgpu import sum_pieces

BLOCK_N = 128  # columns a program (of each half)
WARPS = 4


def activation(gate: jax.Array, up: jax.Array, dtype) -> jax.Array:
    """silu(gate) x up in fp32, rounded to dtype: the model's MLP activation (`layers.mlp` calls it too)."""
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(dtype)


def reference(parts: jax.Array, valid: jax.Array, *, live: int) -> jax.Array:
    p, n2, r = parts.shape
    n = n2 // 2
    total = sum_pieces(lambda i: (parts[i], valid[i][:, None]), p).astype(jnp.bfloat16)  # [2N, R]
    act = activation(total[:n], total[n:], jnp.bfloat16).T  # [R, N]
    return jnp.where((jnp.arange(r) < live)[:, None], act, jnp.zeros_like(act))


def _kernel(valid_ref, parts_ref, o_ref, *, n: int, n_pieces: int, live: int):
    # valid_ref [P, 2N] int8; parts_ref [P, 2N, R] fp32; o_ref [R, N] bf16: this program's BLOCK_N columns.
    j = pl.program_id(0)
    r = o_ref.shape[0]
    cols = j * BLOCK_N + jnp.arange(BLOCK_N)
    in_n = cols < n

    def half(first):
        def load(p):
            p = jnp.int32(p)
            ok = plgpu.load(valid_ref.at[p, pl.ds(first + j * BLOCK_N, BLOCK_N)], mask=in_n, other=0) != 0
            vals = plgpu.load(parts_ref.at[p, pl.ds(first + j * BLOCK_N, BLOCK_N), :],
                              mask=in_n[:, None], other=0.0)
            return vals, ok[:, None]
        return sum_pieces(load, n_pieces).astype(jnp.bfloat16)

    act = activation(half(0), half(n), jnp.bfloat16).T  # [R, BLOCK_N]
    act = jnp.where((jnp.arange(r) < live)[:, None], act, jnp.zeros_like(act))
    plgpu.store(o_ref.at[:, pl.ds(j * BLOCK_N, BLOCK_N)], act, mask=in_n[None, :])


@functools.partial(jax.jit, static_argnames=("live", "interpret"))
def swiglu(parts: jax.Array, valid: jax.Array, *, live: int, interpret: bool = False) -> jax.Array:
    """parts [P, 2N, R] fp32, valid [P, 2N] bool -> act [R, N] bf16 (`reference`'s values; rows >= live zero)."""
    p, n2, r = parts.shape
    if n2 % 2 or valid.shape != (p, n2) or r & (r - 1) or not 0 < live <= r:
        raise ValueError(f"swiglu: parts [P, 2N, R] (R a power of two), valid [P, 2N] and 0 < live <= R; got "
                         f"{parts.shape}, {valid.shape}, live={live}")
    n = n2 // 2
    kernel = functools.partial(_kernel, n=n, n_pieces=p, live=live)
    with jax.named_scope("swiglu"):
        return pallas_call(
            kernel,
            grid=(pl.cdiv(n, BLOCK_N),),
            in_specs=[pl.BlockSpec((p, n2), lambda j: (0, 0)), pl.BlockSpec((p, n2, r), lambda j: (0, 0, 0))],
            out_specs=pl.BlockSpec((r, n), lambda j: (0, 0)),
            out_shape=jax.ShapeDtypeStruct((r, n), jnp.bfloat16),
            interpret=interpret,
            compiler_params=plgpu.CompilerParams(num_warps=WARPS, num_stages=1),
            name="swiglu",
        )(valid.astype(jnp.int8), parts)
