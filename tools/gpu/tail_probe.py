"""Can a Mosaic GPU kernel of this jax end with its own merge? A probe of the pieces, not a kernel.

The window's pass 1 (`attention_window_mgpu`) writes one partial a chunk; the merge is a launch of its own. A tail
in pass 1 would have the CTA of a (stream, KV head)'s last chunk wait until the other chunks' CTAs have stored
their partials, then fold them. Mosaic GPU's atomics are store-adds without a result (no ticket), but `pl.get_global`
gives semaphores in global memory that persist across calls: every CTA but the last signals (a release at GPU scope
by one thread, after a warpgroup barrier), the last waits for chunks - 1 signals (an acquire, decrementing the count
back to zero for the next call). Only CTAs of a lower index are waited for, and a grid starts its CTAs in index
order, so no waiting CTA holds an SM that a CTA it waits for still needs.

Each CTA of group g, chunk c computes part = x * 2 + c for its [rows, d] fp32 tile and stores it (`--store`:
"generic", register stores; "tma", shared memory then a TMA store, waited for); the last chunk's CTA then reads
every other chunk's part from global memory and adds all of them in chunk order into o[g]. The result must equal
numpy's ordered sum bit for bit, every call (`--calls` of them, fresh inputs each, the same semaphores). Timed: the
kernel per call, and the same kernel without the tail (the last CTA stores its part like the others).

On a CPU the kernels are only lowered for sm_90 (jax 0.11.2's interpreter rejects `get_global`).

    python tools/gpu/tail_probe.py [--chunks 32] [--groups 4] [--rows 8] [--d 256] [--store generic,tma]
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


def tail_call(groups: int, chunks: int, rows: int, d: int, store: str, tail: bool):
    """x [groups, chunks, rows, d] fp32 -> (part [groups, chunks, rows, d], o [groups, rows, d])."""

    def kernel(x_gmem, part_gmem, o_gmem, tile):
        g = lax.axis_index("groups")
        c = lax.axis_index("chunks")
        part = x_gmem[g, c] * 2.0 + c.astype(jnp.float32)
        if store == "tma":
            tile[...] = part
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(tile, part_gmem.at[g, c])
            plgpu.wait_smem_to_gmem(0)
        else:
            part_gmem[g, c] = part
        if not tail:
            return
        sems = pl.get_global(plgpu.SemaphoreType.REGULAR((groups,)))
        last = chunks - 1

        @pl.when(c < last)
        def _():
            plgpu.commit_smem()  # (a warpgroup barrier: every thread's stores precede the one thread's release)
            plgpu.semaphore_signal(sems.at[g], 1, memory_scope="gpu")

        @pl.when(c == last)
        def _():
            plgpu.semaphore_wait(sems.at[g], last, memory_scope="gpu")
            total = part_gmem[g, 0]
            for k in range(1, last):
                total = total + part_gmem[g, k]
            o_gmem[g] = total + part

    f32 = jnp.float32
    return plgpu.kernel(
        kernel, out_type=(jax.ShapeDtypeStruct((groups, chunks, rows, d), f32),
                          jax.ShapeDtypeStruct((groups, rows, d), f32)),
        grid=(groups, chunks), grid_names=("groups", "chunks"),
        scratch_types=(plgpu.SMEM((rows, d), f32),),
        kernel_name=f"tail_probe_{store}_{'tail' if tail else 'plain'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=4, help="(stream, KV head) pairs")
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--store", default="generic,tma")
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    gpu = jax.devices()[0].platform == "gpu"
    shape = (args.groups, args.chunks, args.rows, args.d)
    for store in args.store.split(","):
        call = tail_call(args.groups, args.chunks, args.rows, args.d, store, tail=True)
        if not gpu:
            text = jax.jit(call).trace(jax.ShapeDtypeStruct(shape, jnp.float32)).lower(
                lowering_platforms=("cuda",)).as_text()
            print(f"{store}: lowered for sm_90 ({text.count('custom_call @mosaic_gpu')} Mosaic GPU call)")
            continue
        fn = jax.jit(call)
        bad = 0
        try:
            for i in range(args.calls):
                x = jax.random.normal(jax.random.key(i), shape, jnp.float32)
                _, o = fn(x)
                xs = np.asarray(x)
                parts = xs * np.float32(2.0) + np.arange(args.chunks, dtype=np.float32)[None, :, None, None]
                want = parts[:, 0].copy()
                for k in range(1, args.chunks):
                    want = want + parts[:, k]
                bad += not np.array_equal(np.asarray(o).view(np.uint32), want.view(np.uint32))
        except Exception as e:  # noqa: BLE001 - a probe reports what failed and goes on
            print(f"{store}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            continue
        times = {}
        for tail in (True, False):
            f = jax.jit(tail_call(args.groups, args.chunks, args.rows, args.d, store, tail=tail))
            for _ in range(5):
                jax.block_until_ready(f(x))
            t0 = time.perf_counter()
            for _ in range(100):
                y = f(x)
            jax.block_until_ready(y)
            times[tail] = (time.perf_counter() - t0) / 100 * 1e6
        print(f"{store}: {args.calls - bad} of {args.calls} calls equal to numpy's ordered sum bit for bit; "
              f"{times[True]:.1f} µs a call with the tail, {times[False]:.1f} without ({args.groups} groups x "
              f"{args.chunks} chunks of [{args.rows}, {args.d}])")


if __name__ == "__main__":
    main()
