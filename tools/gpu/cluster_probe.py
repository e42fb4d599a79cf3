"""Can a Mosaic GPU kernel of this jax fold a window's chunk partials on chip? A probe of the pieces, not a kernel.

Each CTA of a cluster of C along the chunk axis writes a [rows, d] fp32 tile (its "partial") to its shared memory,
the cluster meets on a `plgpu.ClusterBarrier`, and CTA i reads column slice i of every peer's tile through
`plgpu.cluster_ref` (distributed shared memory) in peer order, sums them in that order and stores its slice; a
second cluster barrier keeps every tile alive until the last peer has read it. The result must equal numpy's
ordered sum bit for bit. On a CPU the kernels are only lowered for sm_90 (jax 0.11.2's Mosaic GPU interpreter runs
clusters and cluster barriers but rejects `cluster_ref`); on the H200 they run and are checked, then timed.

    python tools/gpu/cluster_probe.py [--clusters 2,4,8] [--rows 96] [--d 256]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def exchange_call(c: int, rows: int, d: int, groups: int):
    """x [groups, c, rows, d] fp32 -> o [groups, rows, d]: o[g] = sum over p in order 0..c-1 of x[g, p], CTA i of
    cluster g summing columns [i d / c, (i + 1) d / c)."""
    cols = d // c

    def kernel(x_gmem, o_gmem, tiles, bar):
        # tiles: c shared-memory tiles [rows, d / c], column slice k of this CTA's partial in tiles[k]. A slice of
        # one [rows, d] tile through cluster_ref failed Mosaic GPU's dialect lowering (a strided memref with an
        # offset, static or traced), so each slice is an allocation of its own.
        g = lax.axis_index("groups")
        i = lax.axis_index("cluster")
        for k in range(c):
            tiles[k][...] = x_gmem[g, i, :, pl.ds(k * cols, cols)]
        plgpu.commit_smem()
        plgpu.barrier_arrive(bar)
        plgpu.barrier_wait(bar)  # every peer's tiles are written
        for k in range(c):  # a branch a CTA index: the tile read is static
            @pl.when(i == k)
            def _():
                total = plgpu.cluster_ref(tiles[k], {"cluster": 0})[...]
                for p in range(1, c):
                    total = total + plgpu.cluster_ref(tiles[k], {"cluster": p})[...]
                o_gmem[g, :, pl.ds(k * cols, cols)] = total
        plgpu.barrier_arrive(bar)
        plgpu.barrier_wait(bar)  # no CTA leaves while a peer may still read its tiles

    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((groups, rows, d), jnp.float32),
        grid=(groups,), grid_names=("groups",), cluster=(c,), cluster_names=("cluster",),
        scratch_types=(tuple(plgpu.SMEM((rows, cols), jnp.float32) for _ in range(c)),
                       plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=1)),
        kernel_name=f"cluster_probe_{c}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clusters", default="2,4,8")
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--groups", type=int, default=64, help="clusters in the grid (timing)")
    args = ap.parse_args()
    gpu = jax.devices()[0].platform == "gpu"
    for c in (int(v) for v in args.clusters.split(",")):
        call = exchange_call(c, args.rows, args.d, args.groups)
        shape = jax.ShapeDtypeStruct((args.groups, c, args.rows, args.d), jnp.float32)
        if not gpu:
            text = jax.jit(call).trace(shape).lower(lowering_platforms=("cuda",)).as_text()
            print(f"cluster {c}: lowered for sm_90 ({text.count('custom_call @mosaic_gpu')} Mosaic GPU call)")
            continue
        x = jax.random.normal(jax.random.key(c), shape.shape, jnp.float32)
        try:
            out = np.asarray(jax.block_until_ready(jax.jit(call)(x)))
        except Exception as e:  # noqa: BLE001 - a probe reports what failed and goes on
            print(f"cluster {c}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            continue
        xs = np.asarray(x)
        want = xs[:, 0].copy()
        for p in range(1, c):
            want = want + xs[:, p]  # numpy's fp32 sum in peer order, as the kernel
        same = np.array_equal(out.view(np.uint32), want.view(np.uint32))
        fn = jax.jit(call)
        for _ in range(3):
            jax.block_until_ready(fn(x))
        t0 = time.perf_counter()
        for _ in range(50):
            y = fn(x)
        jax.block_until_ready(y)
        us = (time.perf_counter() - t0) / 50 * 1e6
        moved = x.size * 4
        print(f"cluster {c}: bits {'equal' if same else 'DIFFER'} to numpy's ordered sum; {us:.1f} µs a call "
              f"({args.groups} clusters, {moved / us / 1e3:.0f} GB/s of tiles through shared memory)")


if __name__ == "__main__":
    main()
