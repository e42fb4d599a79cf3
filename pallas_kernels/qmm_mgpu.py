"""Decode qmm on Mosaic GPU (experimental; off by default: `qmm.DECODE_IMPL = "mgpu"` or `bench --qmm-decode-impl
mgpu` route the decode calls it supports here): y [M, N] = x [M, K] @ dequantize(w)^T for
M <= 16 decode/verify rows, 4-bit MLX weights with bf16 scales and biases, group 64, bf16 x.

Why a second kernel: the Triton decode kernel (`qmm.py`) runs at 35-44 % of copy on the H200 because its loads and
its dequantize-and-MMA chain share one instruction stream and each chunk's wgmma is waited before the next chunk
is built (docs/kernels/qmm.md, runs 4-5). Here the structure is Mosaic GPU's warp-specialised pipeline: a memory
warpgroup keeps `stages` TMA copies in flight (x, weight words, scales, biases of one group of K each), and
`COMPUTE_WGS` compute warpgroups each own `TILE_N` = 64 output features (N need not be a multiple of their
128: a last CTA past N reads zeros and its stores are clipped, TMA's bounds handling).

Arithmetic (a per-group epilogue; the issue's `bias x sum(x)` form): for group g of K,
    y[n, m] += s[n, g] * sum_k (q[n, k] - 8) x[m, k]  +  (b[n, g] + 8 s[n, g]) * sum_k x[m, k]
with q the 4-bit field. The weight words are viewed as uint4 [N, K] without moving a byte
(`lax.bitcast_convert_type` gives element j = bits 4j..4j+3, MLX's field j). The compute warpgroup flips bit 3 of
each field and reads it as signed int4, which is q - 8 exactly, so Mosaic GPU's fast int4 -> bf16 conversion
applies (unsigned takes a per-element path), and the bias term becomes (b + 8 s) sum x. The [64, 64] tile of
q - 8 in bf16 (exact) is the wgmma A operand in registers; one wgmma gives the (q - 8) . x sums, a second against a
constant all-ones A gives the group's sum of x for every column (a fixed tensor-core order, so no reduction whose
order could depend on M), and the fp32 epilogue folds both into the running total. x is the B operand: x^T
[K, 16] (rows padded to 16), in shared memory.

Exactness: every row is one column of the MMAs, the padding is fixed at 16 rows, the K splits (`k_splits`, fp32
partials added in one fixed sequence) and every tile come from the weight's shape alone, so a row's bits do not
depend on M or on the other rows. The bits differ from the Triton kernel's (another formula); a model would use
one kernel for all its decode and verify programs.

Status (session 5): lowers for the H200 on the CPU, and runs in Mosaic GPU's interpreter (`interpret=True`, which
routes the two A tiles through shared memory, the only place its wgmma reads A from) against the float64 oracle
with row invariance (`tests/test_qmm_mgpu.py`). The compiled kernel's numbers and speed are device-only: `pytest
-m gpu tests/test_qmm_mgpu.py` and `python -m pallas_kernels.bench qmm --sweep --mgpu` (`tools/gpu/run.sh mgpu`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.qweight import QuantizedWeight

ROWS = 16  # x rows a call carries (the MMA's N); M <= ROWS
GROUP = 64
TILE_N = 64  # output features a compute warpgroup
COMPUTE_WGS = 2
STAGES = 4
# CTAs a launch should have at least (K splits are added until it does). The warp-specialised pipeline gives the
# compute warpgroups most of the register file (setmaxnreg 232 in the lowered module), so likely one CTA a SM:
# 528 = 4 waves of 132; fewer, longer CTAs (132, 264) are the bench's alternatives (`bench qmm --sweep --mgpu`).
MIN_CTAS = 528


def k_splits_for(n: int, k: int, min_ctas: int = MIN_CTAS) -> int:
    """The fewest K splits (a divisor of K's group count) giving `min_ctas` CTAs over N: a function of the shape."""
    groups = k // GROUP
    ctas = -(-n // (TILE_N * COMPUTE_WGS))
    return next((s for s in range(1, groups + 1) if groups % s == 0 and ctas * s >= min_ctas), groups)


def _unsupported(x: jax.Array, w: QuantizedWeight) -> str | None:
    """What keeps this call (any M) off the kernel, or None: it takes 4-bit group-64 weights with bf16 scales and
    biases, bf16 x [M, K], N a multiple of 8 (a last CTA past N reads zeros and its stores are clipped: TMA's
    bounds handling)."""
    n, k = w.shape
    if w.bits != 4 or w.group_size != GROUP or w.scales.dtype != jnp.bfloat16 or w.biases.dtype != jnp.bfloat16:
        return (f"needs 4-bit weights, group {GROUP}, bf16 scales and biases; got bits={w.bits}, "
                f"group={w.group_size}, scales {w.scales.dtype}, biases {w.biases.dtype}")
    if x.ndim != 2 or x.dtype != jnp.bfloat16 or x.shape[1] != k:
        return f"x must be bf16 [M, {k}], got {x.dtype} {tuple(x.shape)}"
    if n % 8:
        return f"N={n} must be a multiple of 8"
    return None


def supports(x: jax.Array, w: QuantizedWeight) -> bool:
    """Whether `qmm_rows` takes this call (`_unsupported`); everything else stays on the Triton kernels."""
    return _unsupported(x, w) is None


def qmm_rows(x: jax.Array, w: QuantizedWeight, *, interpret: bool = False) -> jax.Array:
    """`qmm_decode` for any M: 16-row pieces, each padded to 16 like a lone row (so a row's bits never depend on
    which piece it rides in), outputs concatenated. Every piece re-reads the weight: a verify program with many
    rows pays for it (the Triton decode path re-reads it every 32 rows)."""
    if x.shape[0] == 0:
        return jnp.zeros((0, w.out_features), x.dtype)
    return _rows(x, w, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("interpret",))
def _rows(x: jax.Array, w: QuantizedWeight, *, interpret: bool) -> jax.Array:
    # One program (see `qmm_decode` on eager calls).
    return jnp.concatenate([qmm_decode(x[i:i + ROWS], w, interpret=interpret) for i in range(0, x.shape[0], ROWS)],
                           axis=0)


def _check(x: jax.Array, w: QuantizedWeight) -> None:
    why = _unsupported(x, w)
    if why is None and not 1 <= x.shape[0] <= ROWS:
        why = f"x must be bf16 [M <= {ROWS}, {w.in_features}], got {x.dtype} {tuple(x.shape)}"
    if why is not None:
        raise ValueError(f"qmm_mgpu: {why}")


def _smem_transforms(cols: int, bits: int, operand: str) -> tuple:
    """Tiling and swizzle of a shared-memory tile with rows of `cols` elements of `bits` bits (a wgmma operand)."""
    swizzle = plgpu.find_swizzle(cols * bits, operand)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


@functools.partial(jax.jit, static_argnames=("k_splits", "stages", "interpret"))
def _partials(xt: jax.Array, q4: jax.Array, st: jax.Array, bt: jax.Array, *, k_splits: int, stages: int,
              interpret: bool) -> jax.Array:
    """xt [K, ROWS] bf16; q4 [N, K] uint4; st, bt [G, N] bf16 -> fp32 partials [k_splits, N, ROWS].
    interpret: run in Mosaic GPU's interpreter (CPU), whose wgmma takes its A operand only from shared memory, so
    the converted tile and the all-ones tile go through shared memory there (the same values into the same
    MMAs); compiled, both stay in registers. Jitted, so a program lowers each distinct kernel once (as
    `pallas_kernels/calls.py` does for the Pallas Triton kernels)."""
    k, rows = xt.shape
    n = q4.shape[0]
    cta_n = TILE_N * COMPUTE_WGS
    steps = k // GROUP // k_splits
    q_transforms = _smem_transforms(GROUP, 4, "lhs")
    x_transforms = _smem_transforms(rows, 16, "rhs")
    a_transforms = _smem_transforms(GROUP, 16, "lhs")  # interpret mode's A tiles

    def kernel(x_gmem, q_gmem, s_gmem, b_gmem, out_gmem, out_smem, *a_smem):
        def pipeline(body, context):
            return plgpu.emit_pipeline_warp_specialized(
                body, grid=(steps,), memory_registers=40, wg_axis="wg", num_compute_wgs=COMPUTE_WGS,
                max_concurrent_steps=stages, compute_context=context,
                in_specs=[plgpu.BlockSpec((GROUP, rows), lambda g: (g, 0), transforms=x_transforms,
                                          memory_space=plgpu.SMEM),
                          plgpu.BlockSpec((cta_n, GROUP), lambda g: (0, g), transforms=q_transforms,
                                          memory_space=plgpu.SMEM),
                          plgpu.BlockSpec((1, cta_n), lambda g: (g, 0), memory_space=plgpu.SMEM),
                          plgpu.BlockSpec((1, cta_n), lambda g: (g, 0), memory_space=plgpu.SMEM)])

        split = lax.axis_index("split")
        n_slice = pl.ds(lax.axis_index("cta") * cta_n, cta_n)
        g0 = split * steps
        operands = (x_gmem.at[pl.ds(g0 * GROUP, steps * GROUP)],
                    q_gmem.at[n_slice, pl.ds(g0 * GROUP, steps * GROUP)],
                    s_gmem.at[pl.ds(g0, steps), n_slice], b_gmem.at[pl.ds(g0, steps), n_slice])
        ignore = lambda *_, **__: None

        @functools.partial(pl.run_scoped, allocs=pipeline(ignore, ignore).get_allocations(*operands),
                           collective_axes="wg")
        def _scope(allocs):
            wg = lax.axis_index("wg")
            wg_slice = pl.ds(wg * TILE_N, TILE_N)

            def context(run):
                if interpret:
                    a_smem[0][wg, 1] = jnp.ones((TILE_N, GROUP), jnp.bfloat16)
                    plgpu.commit_smem()
                total = run(jnp.zeros((TILE_N, rows), jnp.float32))
                out_smem[wg] = total
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[split, n_slice].at[wg_slice])
                plgpu.wait_smem_to_gmem(0)

            def body(_, x_smem, q_smem, s_smem, b_smem, total):
                # q XOR 8 read as signed int4 is q - 8 exactly; signed int4 -> bf16 is Mosaic GPU's fast
                # conversion (prmt, lop3, sub a pair), where uint4 takes a per-element one.
                q = lax.bitcast_convert_type(q_smem[wg_slice] ^ jnp.uint4(8), jnp.int4).astype(jnp.bfloat16)
                ones = jnp.ones((TILE_N, GROUP), jnp.bfloat16)
                if interpret:
                    a_smem[0][wg, 0] = q
                    plgpu.commit_smem()
                    q, ones = a_smem[0].at[wg, 0], a_smem[0].at[wg, 1]

                def mmas(qx, sx):  # fresh accumulators: this group's sums alone
                    plgpu.wgmma(qx, q, x_smem)  # sum_k (q - 8) x
                    plgpu.wgmma(sx, ones, x_smem)  # sum_k x, on every row
                    return qx[...], sx[...]  # (waits for both)

                qx, sx = pl.run_scoped(mmas, plgpu.ACC((TILE_N, rows), jnp.float32),
                                       plgpu.ACC((TILE_N, rows), jnp.float32))
                s = s_smem[0, wg_slice].astype(jnp.float32)
                b = b_smem[0, wg_slice].astype(jnp.float32) + 8.0 * s  # q = (q - 8) + 8: exact 8s, one rounding
                return total + s[:, None] * qx + b[:, None] * sx

            pipeline(body, context)(*operands, allocations=allocs)

    call = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((k_splits, n, rows), jnp.float32),
        grid=(pl.cdiv(n, cta_n), k_splits), grid_names=("cta", "split"), num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        scratch_types=[plgpu.SMEM((COMPUTE_WGS, TILE_N, rows), jnp.float32)]
        + ([plgpu.SMEM((COMPUTE_WGS, 2, TILE_N, GROUP), jnp.bfloat16, transforms=a_transforms)] if interpret else []),
        interpret=plgpu.InterpretGPUParams() if interpret else None)
    return call(xt, q4, st, bt)


def qmm_decode(x: jax.Array, w: QuantizedWeight, *, k_splits: int | None = None, stages: int = STAGES,
               interpret: bool = False) -> jax.Array:
    """x bf16 [M <= 16, K] -> y bf16 [M, N] (see the module docstring). k_splits: None for `k_splits_for`'s
    shape-derived count (a caller that overrides must keep it fixed per weight shape). interpret: Mosaic GPU's
    interpreter on the CPU (`_partials`)."""
    w.validate("qmm_mgpu weight")
    _check(x, w)
    n, k = w.shape
    splits = k_splits_for(n, k) if k_splits is None else k_splits
    if (k // GROUP) % splits:
        raise ValueError(f"qmm_mgpu: k_splits={splits} must divide K's {k // GROUP} groups")
    return _decode(x, w, k_splits=splits, stages=stages, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("k_splits", "stages", "interpret"))
def _decode(x: jax.Array, w: QuantizedWeight, *, k_splits: int, stages: int, interpret: bool) -> jax.Array:
    # One program around the kernel: called eagerly, separate dispatches of the small ops around an interpreted
    # kernel deadlocked the CPU client now and then (the interpreter's callbacks dispatch jax ops themselves).
    m, k = x.shape
    n = w.out_features
    xt = jnp.pad(x, ((0, ROWS - m), (0, 0))).T
    q4 = lax.bitcast_convert_type(w.words, jnp.uint4).reshape(n, k)
    parts = _partials(xt, q4, w.scales.T, w.biases.T, k_splits=k_splits, stages=stages, interpret=interpret)
    total = parts[0]
    for i in range(1, k_splits):  # one fixed sequence of adds for every element
        total = total + parts[i]
    return total[:, :m].T.astype(x.dtype)
