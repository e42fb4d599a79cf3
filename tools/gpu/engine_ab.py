"""Decode variants of the 27B engine side by side in one process: the synthetic weights are built once, then each
variant sets the Mosaic GPU decode kernel's knobs (qmm_mgpu.STAGES, WIDE_ROWS, NARROW_ROWS, ROUNDING,
CONVERSION, COMPUTE_WGS), the window's pass 1 chunk (attention_window_mgpu.CHUNK: its bits change with it) and
whether GDN rows take `gdn.decode_prep` (qwen_jax.model.ops.DECODE_PREP, prep=0|1) and attention rows `attn_prep`
(ATTN_PREP, aprep=0|1; the bits of both differ from the separate ops'), compiles its programs and runs the
bench's pipelined decode (`qwen_jax.engine.bench.run`, prompt timing off). Only speed is compared: the depth and the
piece heights change no row's bits (tests/test_qmm_mgpu.py); the conversion changes the weights' rounding.

    python tools/gpu/engine_ab.py --streams 1,16,64 --variants "stages=4,wide=16;stages=4;stages=6;stages=8"
    python tools/gpu/engine_ab.py --streams 1,16 --context 1024,8192 --variants "chunk=512;chunk=1024"
    python tools/gpu/engine_ab.py --streams 1,16 --variants "prep=1,aprep=1;prep=0,aprep=0;prep=1,aprep=1"
    python tools/gpu/engine_ab.py --streams 1,16 --context 1024,4096 --variants "short=65536;short=128"
"""

from __future__ import annotations

import argparse
import time

# A variant's knob -> (the pallas_kernels module holding it, its attribute there).
KNOBS = {"stages": ("pallas_kernels.qmm_mgpu", "STAGES"), "wide": ("pallas_kernels.qmm_mgpu", "WIDE_ROWS"),
         "narrow": ("pallas_kernels.qmm_mgpu", "NARROW_ROWS"), "round": ("pallas_kernels.qmm_mgpu", "ROUNDING"),
         "conv": ("pallas_kernels.qmm_mgpu", "CONVERSION"), "wgs": ("pallas_kernels.qmm_mgpu", "COMPUTE_WGS"),
         "chunk": ("pallas_kernels.attention_window_mgpu", "CHUNK"), "prep": ("qwen_jax.model.ops", "DECODE_PREP"),
         "aprep": ("qwen_jax.model.ops", "ATTN_PREP"),
         # attention.SHORT_CHUNK: short contexts' chunk (`WindowTiles.short_chunk`); one at least the pass's chunk
         # (short=65536) keeps every context in whole chunks, as before session 28 (bits differ between the two)
         "short": ("pallas_kernels.attention", "SHORT_CHUNK")}


def parse_variants(text: str) -> list[dict]:
    out = []
    for spec in filter(None, (v.strip() for v in text.split(";"))):
        v = {}
        for item in spec.split(","):
            key, _, value = item.partition("=")
            if key not in KNOBS or not value:
                raise ValueError(f"--variants: {item!r} is not one of {sorted(KNOBS)}=VALUE")
            v[key] = int(value) if value.isdigit() else value
            if key in ("prep", "aprep"):
                v[key] = bool(v[key])
        out.append(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,16,64")
    ap.add_argument("--rounds", type=int, default=32)
    ap.add_argument("--context", default="1024", help="cached tokens per stream while decoding (a comma list: "
                                                      "every variant at each)")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (a CPU smoke run)")
    ap.add_argument("--variants", required=True,
                    help="';'-separated, each 'stages=N,wide=N,narrow=N,round=barrier|reduce_precision,"
                         "conv=words|nibbles,wgs=N,chunk=N' (each optional)")
    args = ap.parse_args()
    variants = parse_variants(args.variants)
    streams = tuple(int(s) for s in args.streams.split(","))
    contexts = tuple(int(c) for c in args.context.split(","))

    import importlib

    import jax

    from pallas_kernels import qmm_mgpu
    from qwen_jax.engine import bench
    from qwen_jax.model import Backend
    t0 = time.perf_counter()
    params, cfg = bench.synthetic_params("27b", dtype="bfloat16", layers=args.layers)
    print(f"synthetic 27b built in {time.perf_counter() - t0:.1f} s", flush=True)
    homes = {k: (importlib.import_module(m), a) for k, (m, a) in KNOBS.items()}
    shipped = {k: getattr(mod, a) for k, (mod, a) in homes.items()}
    rows = []
    for v in variants:
        knobs = dict(shipped, **v)
        if knobs["wgs"] != qmm_mgpu.COMPUTE_WGS:
            # CTA_N follows; the kernel's traces and its lowering cache are keyed on static arguments only
            qmm_mgpu.CTA_N = qmm_mgpu.TILE_N * knobs["wgs"]
            qmm_mgpu._LOWERED.clear()
            jax.clear_caches()
        for k, (mod, a) in homes.items():  # read when the programs are traced (each variant's programs are new)
            setattr(mod, a, knobs[k])
        for ctx in contexts:
            t0 = time.perf_counter()
            res = bench.run(params, cfg, backend=Backend.default(), streams=streams, prompt_lengths=(), context=ctx,
                            rounds=args.rounds, compile_timing=False, progress=False, log=lambda m: None)
            fps = res.decode_forwards_per_s
            rows.append((knobs, ctx, fps))
            print(f"{knobs} @ {ctx} ctx: " + ", ".join(f"{s} streams {fps[s]:.1f} fwd/s" for s in streams)
                  + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    print("\n| stages | widest piece | narrowest piece | rounding | conversion | compute warpgroups | window chunk | "
          "decode prep | attention prep | context | " + " | ".join(f"{s} streams (fwd/s)" for s in streams) + " |")
    print("|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(streams))
    for knobs, ctx, fps in rows:
        print(f"| {knobs['stages']} | {knobs['wide']} | {knobs['narrow']} | {knobs['round']} | {knobs['conv']} | "
              f"{knobs['wgs']} | {knobs['chunk']} | {knobs['prep']} | {knobs['aprep']} | {ctx} | "
              + " | ".join(f"{fps[s]:.1f}" for s in streams) + " |")


if __name__ == "__main__":
    main()
