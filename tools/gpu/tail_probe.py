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

`--gather` (session 37): how the last CTA reads the others' parts. "registers" (session 24's): one load into
registers after another; "tma": every part copied into shared memory at once (one barrier, chunks - 1 arrivals),
then summed from there, the way a tail in the window's pass 1 would read 31 bf16 partials of [8, 256] (128 KiB).
`--dtype bfloat16` stores the parts in bf16 (the pass 1's partials' dtype) and sums them in fp32. `--trace DIR` times
the kernel alone from a profiler trace (the tail's own cost, without the host's dispatch that session 24's host
timing carried), with the tail and without it.

On a CPU the kernels are only lowered for sm_90 (jax 0.11.2's interpreter rejects `get_global`).

    python tools/gpu/tail_probe.py [--chunks 32] [--groups 4] [--rows 8] [--d 256] [--store generic,tma]
        [--gather registers,tma] [--dtype float32|bfloat16] [--trace DIR]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.bench.common import time_us, traced_us


def tail_call(groups: int, chunks: int, rows: int, d: int, store: str, tail: bool, gather: str = "registers",
              dtype=jnp.float32):
    """x [groups, chunks, rows, d] fp32 -> (part [groups, chunks, rows, d] dtype, o [groups, rows, d] fp32)."""
    last = chunks - 1

    def kernel(x_gmem, part_gmem, o_gmem, tile, parts_smem, gathered):
        g = lax.axis_index("groups")
        c = lax.axis_index("chunks")
        part = (x_gmem[g, c] * 2.0 + c.astype(jnp.float32)).astype(dtype)
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

        @pl.when(c < last)
        def _():
            plgpu.commit_smem()  # (a warpgroup barrier: every thread's stores precede the one thread's release)
            plgpu.semaphore_signal(sems.at[g], 1, memory_scope="gpu")

        @pl.when(c == last)
        def _():
            plgpu.semaphore_wait(sems.at[g], last, memory_scope="gpu")
            if gather == "tma":
                for k in range(last):
                    plgpu.copy_gmem_to_smem(part_gmem.at[g, k], parts_smem.at[k], gathered)
                plgpu.barrier_wait(gathered)
                load = lambda k: parts_smem[k].astype(jnp.float32)
            else:
                load = lambda k: part_gmem[g, k].astype(jnp.float32)
            total = load(0)
            for k in range(1, last):
                total = total + load(k)
            o_gmem[g] = total + part.astype(jnp.float32)

    gathers = max(chunks - 1, 1) if gather == "tma" else 1
    return plgpu.kernel(
        kernel, out_type=(jax.ShapeDtypeStruct((groups, chunks, rows, d), dtype),
                          jax.ShapeDtypeStruct((groups, rows, d), jnp.float32)),
        grid=(groups, chunks), grid_names=("groups", "chunks"),
        scratch_types=(plgpu.SMEM((rows, d), dtype), plgpu.SMEM((gathers, rows, d), dtype),
                       plgpu.Barrier(num_arrivals=gathers)),
        kernel_name=f"tail_probe_{store}_{gather}_{'tail' if tail else 'plain'}")


def _want(x: np.ndarray, chunks: int, dtype) -> np.ndarray:
    """numpy's ordered sum of the parts as the kernel rounds them (dtype), in fp32."""
    parts = x * np.float32(2.0) + np.arange(chunks, dtype=np.float32)[None, :, None, None]
    parts = np.asarray(jnp.asarray(parts).astype(dtype).astype(jnp.float32))
    want = parts[:, 0].copy()
    for k in range(1, chunks - 1):
        want = want + parts[:, k]
    return want + parts[:, chunks - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=4, help="(stream, KV head) pairs")
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--store", default="generic,tma")
    ap.add_argument("--gather", default="registers", help="registers,tma: how the last CTA reads the parts")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the parts' dtype")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--trace", metavar="DIR", help="time the kernel alone from a profiler trace under DIR")
    args = ap.parse_args()
    gpu = jax.devices()[0].platform == "gpu"
    dtype = jnp.dtype(args.dtype)
    shape = (args.groups, args.chunks, args.rows, args.d)
    for store in args.store.split(","):
        for gather in args.gather.split(","):
            name = f"{store} stores, {gather} gather, {args.dtype} parts"
            if gather == "tma" and (args.chunks - 1) * args.rows * args.d * dtype.itemsize > 200 * 1024:
                print(f"{name}: skipped (the parts exceed shared memory)")
                continue
            call = tail_call(args.groups, args.chunks, args.rows, args.d, store, True, gather, dtype)
            if not gpu:
                text = jax.jit(call).trace(jax.ShapeDtypeStruct(shape, jnp.float32)).lower(
                    lowering_platforms=("cuda",)).as_text()
                print(f"{name}: lowered for sm_90 ({text.count('custom_call @mosaic_gpu')} Mosaic GPU call)")
                continue
            fn = jax.jit(call)
            bad = 0
            try:
                for i in range(args.calls):
                    x = jax.random.normal(jax.random.key(i), shape, jnp.float32)
                    _, o = fn(x)
                    want = _want(np.asarray(x), args.chunks, dtype)
                    bad += not np.array_equal(np.asarray(o).view(np.uint32), want.view(np.uint32))
            except Exception as e:  # noqa: BLE001 - a probe reports what failed and goes on
                print(f"{name}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                continue
            times = {}
            for tail in (True, False):
                f = jax.jit(tail_call(args.groups, args.chunks, args.rows, args.d, store, tail, gather, dtype))
                if args.trace:
                    times[tail] = traced_us(lambda: [f(x) for _ in range(20)], args.trace, per=20, prefix="")[0]
                else:
                    times[tail] = time_us(f, [(x,)], warmup=5, iters=100)
            how = "the kernel alone (trace)" if args.trace else "a call, host-timed"
            print(f"{name}: {args.calls - bad} of {args.calls} calls equal to numpy's ordered sum bit for bit; "
                  f"{times[True]:.2f} µs with the tail, {times[False]:.2f} without, {how} ({args.groups} groups x "
                  f"{args.chunks} chunks of [{args.rows}, {args.d}])")


if __name__ == "__main__":
    main()
