"""One launch of each kernel whose speed is still far from its floor, between profiler start and stop, for Nsight
Compute: the 1-row decode and 16-row window attention at 32K context, the GDN window / step at the engine's
stream counts, and the qmm decode kernel at the 27B's MLP shapes. Every case is compiled and run once before the
profiled launch, so only the steady-state kernels are profiled.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \\
        --export $OUT/kernels python3 tools/gpu/kernel_ncu.py
    ncu --import $OUT/kernels.ncu-rep --page details > $OUT/kernels.txt

Without ncu it prints each case's wall time per call (a rough check that the cases run).
"""

from __future__ import annotations

import argparse
import ctypes
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import attention as at
from pallas_kernels import gdn, qmm
from pallas_kernels.bench import attention as batt
from pallas_kernels.bench import qmm as bqmm

HK, HV, D = 16, 48, 128  # the 27B's GDN heads


def _profiler(call: str) -> None:
    try:
        getattr(ctypes.CDLL("libcuda.so.1"), call)()
    except OSError:
        pass


def attention_case(rows: int, context: int, fp8: bool = False):
    env = batt.Env(interpret=False, page_size=64, reps=1, results=[])
    pool, varying = batt.window_inputs(env, streams=1, rows=rows, context=context, fp8=fp8)
    tiles = at.model_window_tiles(jnp.bfloat16, pool, 24, max_keys=context, interpret=False)  # as the engine runs
    step = jax.jit(batt._window_step(tiles))
    return step, (pool, *varying[0])


def gdn_rows(streams: int, rows: int, seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (streams, rows, HK, D), jnp.bfloat16)
    k = q / jnp.linalg.norm(q.astype(jnp.float32), axis=-1, keepdims=True).astype(jnp.bfloat16)
    v = jax.random.normal(ks[1], (streams, rows, HV, D), jnp.bfloat16)
    g = -jax.nn.softplus(jax.random.normal(ks[2], (streams, rows, HV), jnp.float32))
    beta = jax.nn.sigmoid(jax.random.normal(ks[3], (streams, rows, HV), jnp.float32))
    pool = jax.random.normal(ks[4], (2 * streams, HV, D, D), jnp.float32) * 0.1
    slot = jnp.arange(streams, dtype=jnp.int32) * 2
    return q, k, v, g, beta, pool, slot


def gdn_window_case(streams: int, rows: int, tiles: gdn.WindowTiles):
    q, k, v, g, beta, pool, slot = gdn_rows(streams, rows)
    parents = jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32) - 1, (streams, rows))
    fn = jax.jit(lambda *a: gdn.window(*a, tiles=tiles))
    return fn, (q, k, v, g, beta, parents, pool, slot)


def gdn_step_case(streams: int, tiles: gdn.WindowTiles):
    q, k, v, g, beta, pool, slot = gdn_rows(streams, 1)
    fn = jax.jit(lambda *a: gdn.step(*a, tiles=tiles))
    return fn, (q, k, v, g, beta, pool, slot)


def qmm_case(k: int, n: int, m: int = 1):
    w = bqmm._random_weights(n, k, 1)[0]
    x = bqmm._x(m, k)
    fn = jax.jit(lambda x, w: qmm.qmm(x, w))
    return fn, (x, w)


CASES = {
    "attn_decode_32k": lambda: attention_case(1, 32768),
    "attn_decode_32k_fp8": lambda: attention_case(1, 32768, fp8=True),
    "attn_window16_32k": lambda: attention_case(16, 32768),
    "attn_window16_4k": lambda: attention_case(16, 4096),
    "gdn_window_s16_r1": lambda: gdn_window_case(16, 1, gdn.WindowTiles()),
    "gdn_window_s16_r16": lambda: gdn_window_case(16, 16, gdn.WindowTiles()),
    "gdn_window_s16_r16_bv16w1": lambda: gdn_window_case(16, 16, gdn.WindowTiles(block_v=16, num_warps=1)),
    "gdn_window_s1_r16": lambda: gdn_window_case(1, 16, gdn.WindowTiles()),
    "gdn_step_s16": lambda: gdn_step_case(16, gdn.WindowTiles()),
    "qmm_5120x17408_m1": lambda: qmm_case(5120, 17408),
    "qmm_5120x34816_m1": lambda: qmm_case(5120, 34816),
    "qmm_17408x5120_m1": lambda: qmm_case(17408, 5120),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ", ".join(CASES))
    ap.add_argument("--trace-only", action="store_true", help="build and trace each case, run nothing (CPU check)")
    args = ap.parse_args()
    for name in args.cases.split(","):
        fn, call_args = CASES[name]()
        if args.trace_only:
            fn.trace(*call_args)
            print(f"{name}: traced", flush=True)
            continue
        jax.block_until_ready(fn(*call_args))
        t0 = time.perf_counter()
        for _ in range(5):
            out = fn(*call_args)
        jax.block_until_ready(out)
        wall = (time.perf_counter() - t0) / 5 * 1e6
        _profiler("cuProfilerStart")
        jax.block_until_ready(fn(*call_args))
        _profiler("cuProfilerStop")
        print(f"{name}: {wall:.1f} us a call (host wall, dispatch included)", flush=True)
        del fn, call_args


if __name__ == "__main__":
    np.set_printoptions(linewidth=150)
    main()
