"""Where a draft window's time goes on the 27B: one stream at --context, windows of --rows rows (draft + commit, as
`python -m qwen_jax bench --draft-rows`), a few traced with jax.profiler and summarized by kernel
(decode_profile.summarize_trace), beside a traced decode round. Copy-draft chains by default; `--drafter synthetic`
makes them DFlash windows (the drafter run on the device after each) and `--tree 0,2` traces chains and trees of
branch 2 one after the other in one process (each with its own programs)."""

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
    ap.add_argument("--drafter", choices=("synthetic",), default=None,
                    help="DFlash windows with the 27B drafter's shapes (random bf16 weights)")
    ap.add_argument("--tree", default="0", help="with --drafter: branch factors to trace, 0 = chains (e.g. 0,2)")
    ap.add_argument("--pipelined", action="store_true", help="windows enqueued before the previous one is fetched")
    ap.add_argument("--dump", action="store_true", help="also write every device event to <trace>_<what>.events.tsv")
    args = ap.parse_args(argv)
    trees = [int(t) for t in args.tree.split(",")]
    if any(trees) and args.drafter is None:
        ap.error("--tree needs --drafter")
    from qwen_jax import programs as P
    from qwen_jax import sampling
    from qwen_jax.engine import bench
    from qwen_jax.model import Backend
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from decode_profile import summarize_trace
    params, cfg = bench.synthetic_params("27b", dtype="bfloat16")
    drafter = None
    if args.drafter:
        from qwen_jax.synthetic import synthetic_drafter
        drafter = synthetic_drafter(cfg.text, jax.random.key(1), dtype=jax.numpy.bfloat16)
    dp = P.pages_for(args.context + 64 * args.rows + 64, 64)
    rule = sampling.RequestSampling(seed=0, temperature=0.0)
    table = np.arange(1, dp + 1, dtype=np.int32)
    rng = np.random.default_rng(0)
    import time
    for tree in trees:
        lay = P.Layout(64, dp, dp + 1, 2, "bfloat16", "bf16", tree_pages=2 * args.rows if tree else 0)
        b = P.Buckets((P.GRID,), (1,), (1,), packing=P.Packing.BATCHED, chain_rows=(args.rows,))
        block = None
        if drafter is not None:
            from qwen_jax import dflash_programs as D
            block = D.Drafter(*drafter, D.DRAFT_WINDOW, tree_rows=args.rows if tree else 0, tree_branch=tree or 2)
        progs = P.Programs(params, cfg, lay, b, Backend.default(), drafter=block)
        progs.compile([k for k in progs.bucket_keys() if k[0] != "prompt"])
        label = f"tree{tree}" if tree else "chain"
        for what in ("draft", "decode") if tree == trees[0] else ("draft",):
            name = f"{label}_{what}" if what == "draft" else what

            def calls(n: int, repeats: int = 1) -> float:
                """n windows (after two warm-up ones; `repeats` times, the median ms a window) or n decode rounds
                once (ms a round), as `python -m qwen_jax bench --draft-rows` runs them."""
                if what == "draft":
                    return bench.draft_windows(progs, [table], args.context, rule, args.rows, n, repeats, 400, rng,
                                               pipelined=args.pipelined, block=drafter is not None)
                t0 = time.perf_counter()
                bench.pipelined_decode(progs, [table], [args.context], rule, n, first_tokens=[1])
                return (time.perf_counter() - t0) * 1e3 / n

            if what == "decode":
                calls(3)  # warm-up
            print(f"{name}: {calls(16, 3):.2f} ms a {'window' if what == 'draft' else 'round'} (untraced)")
            if args.trace:
                jax.profiler.start_trace(f"{args.trace}_{name}", create_perfetto_trace=True)
                calls(args.windows)
                jax.block_until_ready(progs.state)
                jax.profiler.stop_trace()
                print(f"=== {name} ({args.rows if what == 'draft' else 1} rows), per window / round")
                summarize_trace(f"{args.trace}_{name}", args.windows + (2 if what == "draft" else 0),
                                dump=f"{args.trace}_{name}" if args.dump else None)
        progs.state = None
    return 0


if __name__ == "__main__":
    sys.exit(main())
