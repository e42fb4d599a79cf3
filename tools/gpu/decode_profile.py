"""Where a decode round's time goes: wall time per round vs the sum of its kernels' device times, per kernel name.

The 27B bench measured 20.7 ms a serial decode round (48.4 forwards/s) where the kernels' own timings add up to
roughly half of that; this separates kernel time from launch gaps. Run it under Nsight Compute, which profiles
only the rounds between the profiler start/stop calls made here:

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \\
        --log-file $OUT/ncu.csv python3 tools/gpu/decode_profile.py --synthetic 27b
    python3 tools/gpu/decode_profile.py --summarize $OUT/ncu.csv     # per-kernel-name table

Without ncu it still prints the wall time of a host-synchronous round (tokens back to the host every round, as the
engine runs) beside a device-bound round (the same program dispatched back to back on device-resident inputs,
one sync at the end): their difference is the host's share. `--trace DIR` also records two rounds with JAX's
profiler and prints, from its perfetto trace, the device's busy time per round, launches, and the top kernels
(when the runtime's CUPTI works; otherwise it says the trace has no device events).
CPU smoke run: --model captures/tiny-mlx-4bit.
"""

from __future__ import annotations

import argparse
import collections
import csv
import ctypes
import sys
import time

import numpy as np


def _profiler(call: str) -> None:
    try:
        getattr(ctypes.CDLL("libcuda.so.1"), call)()
    except (OSError, AttributeError):
        pass  # no driver (CPU smoke run)


def run(args) -> None:
    import jax

    from qwen_jax import programs as P
    from qwen_jax import sampling
    from qwen_jax.model import Backend
    from pallas_kernels import qmm, qmm_mgpu
    if args.decode_tiles:  # A/B of qmm's decode tiles in the whole program (e.g. prefetch=1,lop3=1)
        qmm.DECODE_TILES = qmm.replace_tiles(qmm.DECODE_TILES, args.decode_tiles)
        print(f"decode tiles: {qmm.DECODE_TILES}")
    from pallas_kernels import attention
    from qwen_jax.model import ops
    if args.mgpu_compute_wgs:
        qmm_mgpu.COMPUTE_WGS, qmm_mgpu.CTA_N = args.mgpu_compute_wgs, qmm_mgpu.TILE_N * args.mgpu_compute_wgs
        print(f"Mosaic GPU decode kernel: {qmm_mgpu.COMPUTE_WGS} compute warpgroups")
    if args.no_decode_prep:
        ops.DECODE_PREP = ops.ATTN_PREP = False
        print("GDN and attention rows without their prep kernels")
    a = args
    switches = [  # (given, module, attribute, value, what it does)
        (a.qmm_decode_impl, qmm, "DECODE_IMPL", a.qmm_decode_impl, f"qmm decode implementation: {a.qmm_decode_impl}"),
        (a.narrow_rows, qmm_mgpu, "NARROW_ROWS", a.narrow_rows,
         f"Mosaic GPU decode kernel: pieces of at least {a.narrow_rows} rows"),
        (a.mgpu_stages, qmm_mgpu, "STAGES", a.mgpu_stages, f"Mosaic GPU decode kernel: {a.mgpu_stages} stages"),
        (a.mgpu_block_groups, qmm_mgpu, "BLOCK_GROUPS", a.mgpu_block_groups,
         f"Mosaic GPU decode kernel: up to {a.mgpu_block_groups} groups a step"),
        (a.mgpu_rounding, qmm_mgpu, "ROUNDING", a.mgpu_rounding,
         f"Mosaic GPU decode kernel: output rounding kept by {a.mgpu_rounding}"),
        (a.mgpu_conversion, qmm_mgpu, "CONVERSION", a.mgpu_conversion,
         f"Mosaic GPU decode kernel: {a.mgpu_conversion} conversion"),
        (a.staggered_loads is not None, qmm_mgpu, "STAGGERED_LOADS", bool(a.staggered_loads),
         f"Mosaic GPU decode kernel: lane words' loads staggered: {bool(a.staggered_loads)}"),
        (a.short_chunk, attention, "SHORT_CHUNK", a.short_chunk,
         f"attention: short contexts' chunk {a.short_chunk} (at least the pass's: none)"),
        (a.no_swiglu, ops, "SWIGLU", False,
         "the MLP's decode rows take the projection's epilogue and XLA's activation"),
        (a.no_pad_at_norm, ops, "PAD_AT_NORM", False, "norms feeding the decode qmm write unpadded rows"),
        (a.no_prep_pieces, ops, "PREP_PIECES", False,
         "the GDN and attention preps read their projection's output (its epilogue an XLA fusion)"),
        (a.residual_norm_rows, ops, "RESIDUAL_NORM_ROWS", a.residual_norm_rows,
         f"the residual add and its norm in one launch up to {a.residual_norm_rows} rows"),
        (a.residual_norm_tail, ops, "RESIDUAL_NORM_TAIL", a.residual_norm_tail,
         f"the fused residual norm's tail: {a.residual_norm_tail}"),
        (a.step_norm, ops, "STEP_NORM", True, "the GDN step and its output norm in one launch"),
        (a.pack_queries, ops, "PACK_QUERIES", True, "the attention prep packs q for the window's pass 1"),
        (a.no_step_norm, ops, "STEP_NORM", False, "the GDN step and its output norm as two launches"),
        (a.no_pack_queries, ops, "PACK_QUERIES", False, "the window packs q itself (an XLA pad)"),
        (a.no_residual_norm, ops, "RESIDUAL_NORM", False,
         "the residual adds and the norms after them as separate launches"),
        (a.no_residual, ops, "RESIDUAL", False, "the output projections' residual adds as XLA fusions"),
    ]
    for given, module, name, value, what in switches:
        if given:
            setattr(module, name, value)
            print(what)
    if args.synthetic:
        from qwen_jax.engine.bench import synthetic_params
        params, cfg = synthetic_params(args.synthetic, dtype="bfloat16", layers=args.layers)
    else:
        from qwen_jax.checkpoint import load_checkpoint
        import jax.numpy as jnp
        ck = load_checkpoint(args.model, dtype=jnp.bfloat16, progress=False)
        params, cfg = ck.params, ck.config
    backend = Backend.default()
    s, page = args.streams, 64
    dp = P.pages_for(args.context + args.rounds * 2 + 8, page)
    lay = P.Layout(page, dp, s * dp + 1, s + 1, "bfloat16", "bf16")
    progs = P.Programs(params, cfg, lay, P.Buckets((P.GRID,), (1,), (s,)), backend)
    t0 = time.perf_counter()
    progs.compile([("decode", (s, 1))])
    print(f"{cfg.text.num_layers} layers: decode program compiled in {time.perf_counter() - t0:.1f} s")
    tables = [np.arange(1 + i * dp, 1 + (i + 1) * dp, dtype=np.int32) for i in range(s)]
    greedy = sampling.RequestSampling(seed=0, temperature=0.0)
    tokens, cache = [1] * s, [args.context] * s

    def rounds(n):
        nonlocal tokens
        for _ in range(n):
            w = P.decode_window(lay, s, tokens, cache, list(range(1, s + 1)), tables)
            out = progs.decode(w, P.sample_params([greedy] * s, [c + 1 for c in cache], s))
            tokens = [int(t) for t in out.tokens[:s]]
            for i in range(s):
                cache[i] += 1

    rounds(3)
    t0 = time.perf_counter()
    rounds(args.rounds)
    ms = (time.perf_counter() - t0) * 1e3 / args.rounds
    print(f"{jax.default_backend()}: {s} streams @ {args.context} ctx: {ms:.2f} ms a host-synchronous round "
          f"({1e3 / ms:.1f}/s)")
    exe = progs._get(("decode", (s, 1)))
    hlo = exe.as_text()
    print(f"compiled decode program: {hlo.count('custom_call_target=')} custom calls, "
          f"{hlo.count(' fusion(')} fusions, {hlo.count('command_buffer')} command-buffer mentions")
    if args.dump:
        with open(f"{args.dump}.hlo.txt", "w") as f:
            f.write(hlo)
    w = jax.device_put(P.decode_window(lay, s, tokens, cache, list(range(1, s + 1)), tables))
    sp = jax.device_put(P.sample_params([greedy] * s, [c + 1 for c in cache], s))
    pen = jax.device_put(P.penalties([], s))
    progs.state, progs.last, progs.history, tok, _ = exe(progs.params, progs.state, progs.last,
                                                         progs.history, w, sp, pen)
    jax.block_until_ready(tok)
    t0 = time.perf_counter()
    for _ in range(args.rounds):
        progs.state, progs.last, progs.history, tok, _ = exe(progs.params, progs.state, progs.last,
                                                             progs.history, w, sp, pen)
    enq = (time.perf_counter() - t0) * 1e3 / args.rounds
    jax.block_until_ready((progs.state, tok))
    dev = (time.perf_counter() - t0) * 1e3 / args.rounds
    print(f"device-bound round (same inputs, back to back, one sync): {dev:.2f} ms; host share {ms - dev:.2f} ms; "
          f"the host's enqueue of a call {enq:.2f} ms (when it is below the round, the device is the limit)")
    # The enqueue above can block once the runtime's queue of work is full (it then reads as the device's time);
    # a call enqueued onto an idle device shows the host's own cost.
    idle = []
    for _ in range(8):
        jax.block_until_ready((progs.state, tok))
        t0 = time.perf_counter()
        progs.state, progs.last, progs.history, tok, _ = exe(progs.params, progs.state, progs.last,
                                                             progs.history, w, sp, pen)
        idle.append((time.perf_counter() - t0) * 1e3)
    jax.block_until_ready((progs.state, tok))
    print(f"the host's enqueue of a call onto an idle device: {np.median(idle):.2f} ms (median of 8, "
          f"min {min(idle):.2f})")
    # The engine's way: each call dispatched before the previous call's tokens come back.
    from qwen_jax.engine.bench import pipelined_decode
    t0 = time.perf_counter()
    pipelined_decode(progs, tables, cache, greedy, args.rounds)
    piped = (time.perf_counter() - t0) * 1e3 / args.rounds
    print(f"pipelined round (dispatch the next call, then fetch the previous one): {piped:.2f} ms")
    if args.trace:
        with jax.profiler.trace(args.trace, create_perfetto_trace=True):
            rounds(2)
            jax.block_until_ready(progs.state)
        summarize_trace(args.trace, 2, args.dump)
    _profiler("cuProfilerStart")
    rounds(args.profiled)
    jax.block_until_ready(progs.state)
    _profiler("cuProfilerStop")
    print(f"profiled {args.profiled} rounds")


def summarize(path: str, rounds: int) -> None:
    """ncu --csv log -> total device µs a round per kernel name, largest first, and the sum."""
    rows = []
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") == "gpu__time_duration.sum":
            unit = r.get("Metric Unit", "ns")
            v = float(r["Metric Value"].replace(",", ""))
            scale = {"ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}.get(unit, 1e-3)
            rows.append((r["Kernel Name"], v * scale))
    total = sum(us for _, us in rows)
    print(f"{len(rows)} kernels, {total / rounds:.1f} µs of device time a round ({len(rows) / rounds:.0f} launches)")
    _print_top(rows, rounds, "kernel")


# Kernel families by name prefix (our Pallas kernels are named at their pallas_call); the rest is XLA's own.
FAMILIES = (("qmm", "qmm_"), ("norms", "rownorm_"), ("attention", "attn_"), ("kv write", "kv_"), ("gdn", "gdn_"))


def family(name: str) -> str:
    for fam, prefix in FAMILIES:
        if name.startswith(prefix):
            return fam
    return "xla (glue: transposes, slices, sums, elementwise)"


def _print_top(rows, rounds: int, what: str, top: int = 40) -> None:
    """(name, µs) pairs -> µs and calls a round per kernel family, then per name, largest total first."""
    by = collections.defaultdict(lambda: [0, 0.0])
    fams = collections.defaultdict(lambda: [0, 0.0])
    for name, us in rows:
        by[name][0] += 1
        by[name][1] += us
        fams[family(name)][0] += 1
        fams[family(name)][1] += us
    print(f"{'µs/round':>10} {'calls/round':>11}  family")
    for name, (n, us) in sorted(fams.items(), key=lambda kv: -kv[1][1]):
        print(f"{us / rounds:10.1f} {n / rounds:11.1f}  {name}")
    print(f"{'µs/round':>10} {'calls/round':>11}  {what}")
    for name, (n, us) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{us / rounds:10.1f} {n / rounds:11.1f}  {name[:110]}")


def summarize_trace(trace_dir: str, rounds: int, dump: str | None = None) -> None:
    """A perfetto trace from jax.profiler -> device busy µs a round (union of kernel intervals), launches, top
    kernels by total time. Device events are the complete ("X") events on processes named like a GPU. dump: also
    write every device event in time order (start µs, duration µs, gap after the previous one's end, name) to
    DUMP.events.tsv."""
    from pallas_kernels.bench.common import device_events  # (jax stays out of the argument parsing)
    kernels = device_events(trace_dir)
    if kernels is None:
        print(f"no perfetto trace under {trace_dir}")
        return
    if not kernels:
        print("trace has no device events")
        return
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels)
    busy, end = 0.0, -1.0
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    wall = spans[-1][1] - spans[0][0]
    if dump:
        with open(f"{dump}.events.tsv", "w") as f:
            prev = None
            for e in sorted(kernels, key=lambda e: float(e["ts"])):
                ts, dur = float(e["ts"]), float(e["dur"])
                f.write(f"{ts:.1f}\t{dur:.2f}\t{0.0 if prev is None else ts - prev:.2f}\t{e['name']}\n")
                prev = ts + dur
    print(f"trace: {len(kernels) / rounds:.0f} device events a round, busy {busy / rounds:.1f} µs a round of "
          f"{wall / rounds:.1f} µs first-to-last ({busy / wall:.0%})")
    _print_top([(e["name"], float(e["dur"])) for e in kernels], rounds, "event")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--synthetic", choices=("27b",))
    src.add_argument("--model", default="captures/tiny-mlx-4bit")
    ap.add_argument("--layers", type=int, default=None, help="with --synthetic: only the first N layers")
    ap.add_argument("--decode-tiles", default="", metavar="FIELD=V,...",
                    help="override fields of qmm.DECODE_TILES (A/B), e.g. x_natural=1 or prefetch=1,lop3=1")
    ap.add_argument("--qmm-decode-impl", choices=("triton", "mgpu"), default=None)
    ap.add_argument("--no-prep-pieces", action="store_true",
                    help="ops.PREP_PIECES off: the GDN and attention preps read their projection's materialized output")
    ap.add_argument("--narrow-rows", type=int, default=None, choices=(8, 16),
                    help="qmm_mgpu.NARROW_ROWS (the least piece height: 8 carries half the x bytes a step)")
    ap.add_argument("--mgpu-stages", type=int, default=None, help="qmm_mgpu.STAGES (the Mosaic GPU kernel's depth)")
    ap.add_argument("--mgpu-block-groups", type=int, default=None,
                    help="qmm_mgpu.BLOCK_GROUPS (groups of K a pipeline step carries; changes the sums' bits)")
    ap.add_argument("--mgpu-rounding", choices=("barrier", "reduce_precision"), default=None,
                    help="qmm_mgpu.ROUNDING (how the kernel's output keeps its rounding)")
    ap.add_argument("--mgpu-conversion", choices=("words", "subnormal", "halves", "nibbles", "unsigned"),
                    default=None,
                    help="qmm_mgpu.CONVERSION (how the kernel turns 4-bit weights into the MMA's operand)")
    ap.add_argument("--residual-norm-rows", type=int, default=None,
                    help="ops.RESIDUAL_NORM_ROWS (live rows up to which a residual add and its norm are one launch)")
    ap.add_argument("--residual-norm-tail", choices=("last", "rows"), default=None,
                    help="ops.RESIDUAL_NORM_TAIL (who normalises in the fused residual add's launch)")
    ap.add_argument("--step-norm", action="store_true",
                    help="ops.STEP_NORM True (the serial step's GDN recurrence and its output norm one launch)")
    ap.add_argument("--pack-queries", action="store_true",
                    help="ops.PACK_QUERIES True (the attention prep writes q packed for the window's Mosaic GPU pass 1)")
    ap.add_argument("--no-step-norm", action="store_true", help="ops.STEP_NORM False")
    ap.add_argument("--no-pack-queries", action="store_true", help="ops.PACK_QUERIES False")
    ap.add_argument("--no-residual-norm", action="store_true",
                    help="ops.RESIDUAL_NORM False (each residual add and the norm after it two launches)")
    ap.add_argument("--no-residual", action="store_true",
                    help="ops.RESIDUAL False (the output projections' residual adds as XLA fusions)")
    ap.add_argument("--staggered-loads", type=int, choices=(0, 1), default=None,
                    help="qmm_mgpu.STAGGERED_LOADS (1: the lane words' loads staggered, 0: in place)")
    ap.add_argument("--mgpu-compute-wgs", type=int, default=None,
                    help="qmm_mgpu.COMPUTE_WGS (compute warpgroups a CTA of the Mosaic GPU decode kernel)")
    ap.add_argument("--no-decode-prep", action="store_true",
                    help="qwen_jax.model.ops.DECODE_PREP and ATTN_PREP off: GDN rows take the separate conv, l2 norm "
                         "and gate ops, attention rows the separate norms and RoPE")
    ap.add_argument("--no-swiglu", action="store_true",
                    help="qwen_jax.model.ops.SWIGLU off: the MLP's decode rows without the swiglu kernel")
    ap.add_argument("--short-chunk", type=int, default=None,
                    help="pallas_kernels.attention.SHORT_CHUNK (short contexts' chunk; 65536: every context in whole "
                         "chunks, as before session 28)")
    ap.add_argument("--no-pad-at-norm", action="store_true",
                    help="qwen_jax.model.ops.PAD_AT_NORM off: the decode qmm pads the norms' rows itself")
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=16, help="timed rounds (wall clock)")
    ap.add_argument("--profiled", type=int, default=2, help="rounds between the profiler start and stop")
    ap.add_argument("--trace", metavar="DIR", help="also record two rounds with jax.profiler into DIR and summarize")
    ap.add_argument("--summarize", metavar="NCU_CSV", help="print the per-kernel table of an ncu --csv log")
    ap.add_argument("--dump", metavar="PREFIX", help="write the compiled program's HLO to PREFIX.hlo.txt and, with "
                    "--trace, the traced device events in order to PREFIX.events.tsv")
    args = ap.parse_args(argv)
    if args.summarize:
        summarize(args.summarize, args.profiled)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
