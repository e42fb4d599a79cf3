"""Where the Mosaic GPU decode qmm's time goes (pallas_kernels/qmm_mgpu.py): times the kernel with parts of its
pipeline step left out (`_partials`'s `probe`, under the "nibbles" conversion: wrong numbers, timing only) at the
27B's decode shapes, scales and biases transposed beforehand. "full" is the "nibbles" kernel whole; "words",
"subnormal" and "unsigned" the other conversions whole (subnormal without a row scale); "tiles" the words conversion
reading the "tiles" layout (`tile_layout`); "words_no_compute" / "tiles_no_compute" their copies alone. With
MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=DIR in the environment Mosaic GPU writes each compiled kernel's PTX there
(its SASS too with MOSAIC_GPU_DUMP_SASS=1 where nvdisasm is installed).

    python3 tools/gpu/mgpu_probe.py [--shapes 5120x34816,17408x5120] [--probes full,no_xor,...]
"""
import argparse
import shutil
import time

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import qmm_mgpu
from pallas_kernels.bench.common import device_events

L2_BYTES = 60 << 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="5120x34816,17408x5120,5120x6144")
    ap.add_argument("--probes", default="words,tiles,words_no_compute,tiles_no_compute,full,no_compute")
    ap.add_argument("--stages", type=int, default=qmm_mgpu.STAGES)
    ap.add_argument("--block-groups", type=int, default=qmm_mgpu.BLOCK_GROUPS)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rows", type=int, default=qmm_mgpu.ROWS, help="x's rows (a piece height)")
    ap.add_argument("--trace", metavar="DIR", help="also time the kernel alone: the median duration of its launches "
                    "in a jax.profiler trace of one chain (the chain's µs include the ops that order the calls)")
    ap.add_argument("--staggered", type=int, default=int(qmm_mgpu.STAGGERED_LOADS),
                    help="1: the lane words' loads staggered, 0: in place (qmm_mgpu.STAGGERED_LOADS)")
    ap.add_argument("--compute-wgs", type=int, default=qmm_mgpu.COMPUTE_WGS,
                    help="compute warpgroups a CTA (qmm_mgpu.COMPUTE_WGS; CTA_N follows)")
    args = ap.parse_args()
    qmm_mgpu.COMPUTE_WGS, qmm_mgpu.CTA_N = args.compute_wgs, qmm_mgpu.TILE_N * args.compute_wgs
    # at most args.stages: as many as fit in shared memory beside the output tile (the engine's choice)
    stages = qmm_mgpu.stages_for(args.rows, args.stages, args.block_groups)
    print(f"device: {jax.devices()[0].device_kind}; stages {stages}, {args.block_groups} groups a step, "
          f"{args.rows} rows, {args.compute_wgs} compute warpgroups")
    print(f"{'shape':>12} | {'probe':>10} | {'CTAs':>6} | {'us':>8} | {'TB/s':>5}")
    for shape in args.shapes.split(","):
        k, n = map(int, shape.split("x"))
        g = k // 64
        nbytes = n * k // 2 + 4 * n * g
        copies = max(1, -(-2 * L2_BYTES // nbytes))
        keys = jax.random.split(jax.random.key(0), copies)
        words = [jax.random.bits(kk, (n, k // 8), jnp.uint32) for kk in keys]
        q4s = [lax.bitcast_convert_type(w, jnp.uint4).reshape(n, k) for w in words]
        st = jnp.full((g, n), 0.01, jnp.bfloat16)
        bt = jnp.full((g, n), -0.08, jnp.bfloat16)
        sts = [st + i for i in range(copies)]
        bts = [bt + i for i in range(copies)]
        xp = jax.random.normal(jax.random.key(1), (args.rows, k), jnp.bfloat16)
        tiled = [qmm_mgpu.tile_layout(w, s, b, args.block_groups) for w, s, b in zip(words, sts, bts)]
        for probe in args.probes.split(","):
            base, _, p = probe.partition("_no_")
            p = "no_" + p if p else None
            if base not in ("words", "subnormal", "halves", "unsigned", "tiles"):
                base, p = "nibbles", None if probe == "full" else probe
            conversion = "words" if base == "tiles" else base
            layout = "tiles" if base == "tiles" else "rows"
            if layout == "tiles":
                ops, ss, bs = [t[0] for t in tiled], [t[1] for t in tiled], [None] * copies
            else:
                ops, ss, bs = (words if conversion in qmm_mgpu.LANE_CONVERSIONS else q4s), sts, bts

            @jax.jit
            def chain(xp, q4s, sts, bts, conversion=conversion, p=p, layout=layout):
                total = jnp.zeros((), jnp.float32)
                for r in range(args.reps):
                    i = r % copies
                    out = qmm_mgpu._partials(xp, q4s[i], sts[i], bts[i], stages=stages, sms=qmm_mgpu.SMS,
                                             block_groups=args.block_groups, interpret=False,
                                             conversion=conversion, probe=p, layout=layout, n=n,
                                             staggered=bool(args.staggered))
                    total = total + out[0, 0, 0]
                    xp = xp.at[0, 0].set(total.astype(xp.dtype))  # orders the calls
                return total

            try:
                chain(xp, ops, ss, bs).block_until_ready()
                best = float("inf")
                for _ in range(5):
                    t0 = time.perf_counter()
                    chain(xp, ops, ss, bs).block_until_ready()
                    best = min(best, (time.perf_counter() - t0) / args.reps * 1e6)
                ctas = qmm_mgpu.flat_schedule(n, k, args.block_groups)[2]
                alone = ""
                if args.trace:
                    where = f"{args.trace}/{shape}_{probe}"
                    with jax.profiler.trace(where, create_perfetto_trace=True):
                        chain(xp, ops, ss, bs).block_until_ready()
                    durs = sorted(float(e["dur"]) for e in device_events(where) or []
                                  if e["name"].startswith("kernel_mosaic"))
                    if durs:
                        us = durs[len(durs) // 2]
                        alone = f" | alone {us:8.2f} us {nbytes / us / 1e6:5.2f} TB/s ({len(durs)} launches)"
                    shutil.rmtree(where, ignore_errors=True)
                print(f"{shape:>12} | {probe:>10} | {ctas:>6} | {best:8.2f} | {nbytes / best / 1e6:5.2f}{alone}",
                      flush=True)
            except Exception as e:  # noqa: BLE001 -- report and go on to the next probe
                print(f"{shape:>12} | {probe:>10} | failed: {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
