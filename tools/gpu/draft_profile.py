"""Where a copy-draft chain window's time goes on the 27B: one stream at --context, chain windows of --rows rows
(draft + commit, as `python -m qwen_jax bench --draft-rows`), a few traced with jax.profiler and summarized by
kernel (decode_profile.summarize_trace), beside a traced decode round."""

import argparse
import os
import sys

import jax
import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=4, help="traced windows")
    ap.add_argument("--trace", default="/tmp/trace_draft", help="trace dir prefix ('' = no trace)")
    args = ap.parse_args(argv)
    from qwen_jax import programs as P
    from qwen_jax import sampling
    from qwen_jax.engine import bench
    from qwen_jax.model import Backend
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from decode_profile import summarize_trace
    params, cfg = bench.synthetic_params("27b", dtype="bfloat16")
    dp = P.pages_for(args.context + 64 * args.rows + 64, 64)
    lay = P.Layout(64, dp, dp + 1, 2, "bfloat16", "bf16")
    b = P.Buckets((P.GRID,), (1,), (1,), packing=P.Packing.BATCHED, chain_rows=(args.rows,))
    progs = P.Programs(params, cfg, lay, b, Backend.default())
    progs.compile([k for k in progs.bucket_keys() if k[0] != "prompt"])
    rule = sampling.RequestSampling(seed=0, temperature=0.0)
    table = np.arange(1, dp + 1, dtype=np.int32)
    rng = np.random.default_rng(0)
    import time
    for what in ("draft", "decode"):
        for traced in (False, True) if args.trace else (False,):
            if traced:
                jax.profiler.start_trace(f"{args.trace}_{what}", create_perfetto_trace=True)
            t0 = time.perf_counter()
            if what == "draft":
                bench.draft_windows(progs, [table], args.context, rule, args.rows, args.windows, 1, 400, rng)
            else:
                bench.pipelined_decode(progs, [table], [args.context], rule, args.windows, first_tokens=[1])
            jax.block_until_ready(progs.state)
            if not traced:
                n = args.windows + (2 if what == "draft" else 0)
                print(f"{what}: {(time.perf_counter() - t0) * 1e3 / n:.2f} ms a "
                      f"{'window' if what == 'draft' else 'round'} (untraced, {n})")
            if traced:
                jax.profiler.stop_trace()
        if args.trace:
            print(f"=== {what} ({args.rows if what == 'draft' else 1} rows), per window / round")
            summarize_trace(f"{args.trace}_{what}", args.windows + (2 if what == "draft" else 0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
