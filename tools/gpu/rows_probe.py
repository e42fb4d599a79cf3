"""What `attention.window_rows` saves a drafted window: its rows' attention with pass 1 below them shared, against
every row as its own one-row call (`attention.SHARED_ROWS` False, the path before session 44), at the 27B's shape
(24 query heads, 4 KV heads, head dim 256, 64-key pages), one stream of 16 chain rows, the model's tiles. Prints,
for each pool dtype and context, the µs of a call each way (synchronised calls, median) and whether every row's
bits agree. The kernels only; a window runs 16 such calls (one an attention layer).

    python tools/gpu/rows_probe.py [--contexts 1024,8192,32768] [--rows 16] [--calls 30] [--kv bf16,fp8]
        [--interpret]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import attention as at
from pallas_kernels import kv_quant as kq


def case(rng, context: int, rows: int, dtype):
    hq, hkv, d, ps = 24, 4, 256, 64
    pmax = -(-(context + rows) // ps) + 1
    num_pages = pmax + 1
    shape = (hkv, num_pages, ps, d)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    if dtype == "fp8":
        (kc, ks), (vc, vs) = kq.quantize_reference(jnp.asarray(k)), kq.quantize_reference(jnp.asarray(v))
        pool = kq.with_v_layout(kq.KVPool(kc, vc, ks, vs), "keys")
    else:
        pool = kq.KVPool(jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16))
    table = jnp.asarray(rng.permutation(np.arange(1, num_pages))[None, :pmax], jnp.int32)
    q = jnp.asarray(rng.standard_normal((1, rows, hq, d)), jnp.bfloat16)
    kw = jnp.asarray(rng.standard_normal((1, rows, hkv, d)), jnp.bfloat16)
    vw = jnp.asarray(rng.standard_normal((1, rows, hkv, d)), jnp.bfloat16)
    base = jnp.asarray([context], jnp.int32)
    row_len = base[:, None] + jnp.arange(rows, dtype=jnp.int32)[None, :]
    return q, kw, vw, pool, table, jnp.repeat(table, rows, axis=0), row_len, base


def timed(fn, args, calls: int) -> tuple[float, np.ndarray]:
    out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e6, np.asarray(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--kv", default="bf16,fp8")
    ap.add_argument("--interpret", action="store_true", help="the kernels interpreted (a CPU check of the tool)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'kv':>5} {'context':>8} {'shared us':>10} {'per-row us':>11} {'saved us':>9}  bits")
    for kv in args.kv.split(","):
        for context in (int(c) for c in args.contexts.split(",")):
            operands = case(rng, context, args.rows, kv)
            res, default = {}, at.SHARED_ROWS
            for shared in (True, False):
                at.SHARED_ROWS = shared  # read at tracing: a fresh jit each way
                fn = jax.jit(lambda *a: at.window_rows(*a, scale=256 ** -0.5, interpret=args.interpret))
                res[shared] = timed(fn, operands, args.calls)
            at.SHARED_ROWS = default
            same = np.array_equal(res[True][1].view(np.uint16), res[False][1].view(np.uint16))
            print(f"{kv:>5} {context:>8} {res[True][0]:10.1f} {res[False][0]:11.1f} "
                  f"{res[False][0] - res[True][0]:9.1f}  {'same' if same else 'DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
