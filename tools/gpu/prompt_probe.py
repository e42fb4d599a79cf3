"""Could the Mosaic GPU decode qmm (pallas_kernels/qmm_mgpu.py) carry prompt rows? Times M prompt rows cut into
pieces of R rows (R = 64, 128, 256: each piece one launch that reads the whole weight, x the MMA's N) against the
shipped prompt path (`qmm.qmm(prompt=True)`: the dequantization pass then the Triton bf16 matmul) and XLA's bf16
matmul of the dequantized weight (cuBLAS), at the 27B's shapes, random 4-bit weights. Knobs per config:
R rows a piece, compute warpgroups a CTA (CTA_N follows), groups a pipeline step. Also checks each config's output
against the 64-row pieces bit for bit and against the float32 reference.

    python3 tools/gpu/prompt_probe.py [--shapes 17408x5120,...] [--m 1024] [--configs 64:3:4,128:2:2,...]
"""
import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import qmm, qmm_mgpu
from pallas_kernels.bench import qmm as bq
from pallas_kernels.qweight import dequantize


def _set(wgs: int, bg: int) -> None:
    """Module knobs the kernel's trace reads (its jit caches and lowering cache are keyed on static args only)."""
    qmm_mgpu.COMPUTE_WGS, qmm_mgpu.CTA_N, qmm_mgpu.BLOCK_GROUPS = wgs, qmm_mgpu.TILE_N * wgs, bg
    qmm_mgpu._LOWERED.clear()
    jax.clear_caches()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="17408x5120,6144x5120,5120x10240,5120x17408")
    ap.add_argument("--m", default="1024")
    ap.add_argument("--configs", default="64:3:4,128:2:2,128:2:1,128:3:1,256:2:1",
                    help="R:wgs:block_groups, comma-separated")
    ap.add_argument("--stages", type=int, default=qmm_mgpu.STAGES)
    args = ap.parse_args()
    qmm_mgpu.PIECE_ROWS = (8, 16, 32, 64, 128, 256)
    default = (qmm_mgpu.COMPUTE_WGS, qmm_mgpu.BLOCK_GROUPS)
    print(f"device: {jax.devices()[0].device_kind}")
    print(f"{'K->N':>12} | {'M':>5} | {'path':>16} | {'us':>8} | {'TFLOP/s':>7} | check")
    for shape in args.shapes.split(","):
        k, n = map(int, shape.split("x"))
        copies = bq._copies(bq._weight_bytes(n, k))
        ws = bq._random_weights(n, k, copies)
        dense = [(jax.lax.optimization_barrier(dequantize(w, jnp.bfloat16)).T,) for w in ws]
        for m in map(int, args.m.split(",")):
            x = bq._x(m, k)
            flop = 2 * m * n * k

            def row(name, us, check=""):
                print(f"{shape:>12} | {m:>5} | {name:>16} | {us:8.1f} | {flop / us / 1e6:7.1f} | {check}", flush=True)

            _set(*default)
            for name, fn, sets in (("dequant+triton", lambda x, w: qmm.qmm(x, w, prompt=True), [(x, w) for w in ws]),
                                   ("bf16 (cuBLAS)", bq._bf16_dot, [(x,) + d for d in dense])):
                try:
                    row(name, bq.device_us(fn, sets, flop / 5e14 * 1e6).us)
                except Exception as e:  # noqa: BLE001 -- report, go on
                    print(f"{shape:>12} | {m:>5} | {name:>16} | failed: {type(e).__name__}: {str(e)[:300]}")
            ref = (x.astype(jnp.float32) @ dequantize(ws[0], jnp.float32).T)
            base = None
            for cfg in args.configs.split(","):
                r, wgs, bg = map(int, cfg.split(":"))
                if m % r:
                    continue
                _set(wgs, bg)
                heights = (r,) * (m // r)

                def fn(x, w, heights=heights):
                    return qmm_mgpu._rows(x, w, interpret=False, heights=heights, rounding=qmm_mgpu.ROUNDING)

                name = f"R{r} wgs{wgs} bg{bg}"
                try:
                    y = np.asarray(jax.jit(fn)(x, ws[0]).astype(jnp.float32))
                    err = float(np.max(np.abs(y - np.asarray(ref))) / np.max(np.abs(np.asarray(ref))))
                    same = "" if base is None else (" same bits as first" if np.array_equal(y, base) else
                                                    f" differs from first in {np.mean(y != base) * 100:.2f} %")
                    base = y if base is None else base
                    t = bq.device_us(fn, [(x, w) for w in ws], flop / 4e14 * 1e6)
                    stages = qmm_mgpu.stages_for(r, args.stages, bg)
                    row(name, t.us, f"rel err {err:.2e}{same}; {stages} stages")
                except Exception as e:  # noqa: BLE001 -- report, go on
                    print(f"{shape:>12} | {m:>5} | {name:>16} | failed: {type(e).__name__}: {str(e)[:300]}",
                          flush=True)
    _set(*default)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main()
