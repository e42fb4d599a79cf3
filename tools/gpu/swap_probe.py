"""Can the window's pass 1 swap its MMA operands for few rows? A probe of the pieces, not a kernel.

The 1-row decode packs 6 real query rows into the wgmma's M = 64 (`attention_window_mgpu`), so S = Q K^T and P V
do ~10x the MMA work the rows need, and a 64-key block costs ~1.3 µs on an SM (the 4K decode). Swapped, the rows
are the MMA's N: S^T = K Q^T (M = 64 keys, N = 8 rows, K = d), then the softmax runs down the columns of S^T
(reductions over axis 0, across the warps), and O^T = V^T P^T (M = d in tiles of 64, N = 8, K = 64 keys) with
V^T read from V's [keys, d] tile as an MN-major A operand and P^T stored to shared memory as B.

One CTA, one warpgroup, one block: q [8, d], k, v [64, d] bf16 ->
  s [64, 8] fp32 = k q^T (wgmma, N = 8)             -- "s"
  m [8] = max over keys, l [8] = sum of 2^(s - m)    -- "reduce" (axis 0 of the wgmma layout)
  o [d, 8] fp32 = v^T bf16(2^(s - m))                -- "pv" (A transposed from shared memory, B = P^T)
each checked against numpy (s and o to fp32 rounding of the same products; m exactly). Each piece is lowered
for sm_90 on its own (on a CPU only that), so one that Mosaic GPU lacks fails alone.

    python tools/gpu/swap_probe.py [--pieces s,reduce,pv] [--d 256] [--n 8]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

BK = 64


def _tiles(shape, dtype=jnp.bfloat16):
    swizzle = 128 if shape[-1] * jnp.dtype(dtype).itemsize >= 128 else shape[-1] * jnp.dtype(dtype).itemsize
    elems = swizzle // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle)))


def piece_call(piece: str, n: int, d: int):
    f32 = jnp.float32

    def kernel(q_gmem, k_gmem, v_gmem, s_out, m_out, l_out, o_out, q_smem, k_smem, v_smem, p_smem, bar):
        plgpu.copy_gmem_to_smem(q_gmem, q_smem, bar)
        plgpu.copy_gmem_to_smem(k_gmem, k_smem, bar)
        plgpu.copy_gmem_to_smem(v_gmem, v_smem, bar)
        plgpu.barrier_wait(bar)

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, k_smem, q_smem.T)
            return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((BK, n), f32))
        s_out[...] = s
        if piece == "s":
            return
        m = s.max(axis=0)
        p = jnp.exp2(s - jax.lax.broadcast_in_dim(m, s.shape, [1]))
        m_out[...] = m
        l_out[...] = p.sum(axis=0)
        if piece == "reduce":
            return
        if piece == "pv":  # P^T [n, keys] (K-major B), written through a transposed view
            p_smem.T[...] = p.astype(jnp.bfloat16)
        else:  # "pv_t": the transpose in registers
            p_smem[...] = p.T.astype(jnp.bfloat16)
        plgpu.commit_smem()
        for j in range(d // 64):
            def pv(acc_ref):
                plgpu.wgmma(acc_ref, v_smem.at[:, pl.ds(j * 64, 64)].T, p_smem.T)
                return acc_ref[...]

            o_out[pl.ds(j * 64, 64)] = pl.run_scoped(pv, plgpu.ACC((64, n), f32))

    return plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((BK, n), f32), jax.ShapeDtypeStruct((n,), f32),
                  jax.ShapeDtypeStruct((n,), f32), jax.ShapeDtypeStruct((d, n), f32)),
        scratch_types=(_tiles((n, d)), _tiles((BK, d)), _tiles((BK, d)), _tiles((n, BK)),
                       plgpu.Barrier(num_arrivals=3)),
        kernel_name=f"swap_probe_{piece}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pieces", default="s,reduce,pv,pv_t")
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--n", type=int, default=8)
    args = ap.parse_args()
    gpu = jax.devices()[0].platform == "gpu"
    n, d = args.n, args.d
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (n, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (BK, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (BK, d), jnp.bfloat16)
    s64 = np.asarray(k, np.float64) @ np.asarray(q, np.float64).T
    for piece in args.pieces.split(","):
        call = piece_call(piece, n, d)
        try:
            if not gpu:
                jax.jit(call).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
                print(f"{piece}: lowered for sm_90")
                continue
            s, m, l, o = (np.asarray(x) for x in jax.block_until_ready(jax.jit(call)(q, k, v)))
        except Exception as e:  # noqa: BLE001 - a probe reports what failed and goes on
            print(f"{piece}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            continue
        line = f"{piece}: s max rel err {np.abs(s - s64).max() / np.abs(s64).max():.2e}"
        if piece != "s":
            m_want = s.max(axis=0)
            p = np.exp2(s - m_want[None, :])
            line += (f"; m {'exact' if np.array_equal(m, m_want) else 'DIFFERS'}, l rel err "
                     f"{np.abs(l - p.sum(0)).max() / np.abs(p.sum(0)).max():.2e}")
        if piece.startswith("pv"):
            p16 = np.asarray(jnp.asarray(np.exp2(s - s.max(axis=0)[None, :])).astype(jnp.bfloat16), np.float64)
            o_want = np.asarray(v, np.float64).T @ p16
            line += f"; o rel err {np.abs(o - o_want).max() / np.abs(o_want).max():.2e}"
        print(line)


if __name__ == "__main__":
    main()
