"""Benchmark of the group-quantized matmul on the 27B's projection shapes (GPU; `--interpret` runs it on CPU).

    python -m pallas_kernels.bench qmm [--shapes 5120x17408,...] [--m 1,16,...] [--no-torch] [--json PATH]
    python -m pallas_kernels.bench qmm --sweep [--shapes ...] [--m 1,16] [--prompt-ms 1024,4096] --json PATH
    python -m pallas_kernels.bench qmm --sweep --interpret --shapes 512x256 --m 1,16 --prompt-ms 128   # CPU smoke

Comparison mode, per shape (K -> N, 4-bit, group 64, random weights made on the device) and M: `qmm()` as the
model calls it (decode rows up to M = 256: on a GPU the Mosaic GPU decode kernel, `qmm.DECODE_IMPL`; prompt rows
from M = 64: the prompt path), the XLA dequantize + matmul (`qmm.reference`, fp32), a bf16 matmul of the same shape,
and torch's int4 tinygemm (`_weight_int4pack_mm`, group 64) when torch is there. Bytes moved = packed weight +
scales + biases + x + y. With `--trace DIR` every jax call is also timed from a profiler trace of one chain (the
device's busy time a call: its kernels summed, no launch gaps), and the table's rates use that.

Sweep mode: decode tile candidates (`_sweep_candidates`, or `--candidates`) for each shape and M, the default tiles
among them, ranked per shape; with `--prompt-ms`, the prompt comparison at each `--prompt-shapes` shape: the fused
prompt kernel, the dequant implementation end to end for each of `dequant_candidates` (XLA dequantization + the
Pallas matmul), its matmul alone and its dequantization alone, "dequantize the whole weight to bf16 in one XLA
fusion, then jnp.dot" (a measurement only: cuBLAS picks its algorithm by M, so that path is not row-invariant), and
the bf16 jnp.dot on an already-bf16 weight (the "% bf16 dot" column's reference). `--prompt-only` skips the decode
tiles:
    python -m pallas_kernels.bench qmm --sweep --prompt-only --prompt-ms 1024,4096 --json PATH
Programs are lowered one by one, compiled on worker threads, then timed one by one; `--budget-s` bounds the run.

Timing (`device_us`): one jitted program runs the function `reps` times as a data-dependent chain (each call's
arguments pass through an optimization barrier with the previous call's output, so XLA can neither merge nor
overlap the calls), rotating over enough weight copies to defeat the L2. The program is timed once alone and twice
back to back; per call = (two - one) / reps, so the host's dispatch, launch and sync cost cancel (the host
enqueues the second program while the device runs the first). `fixed_us` reports what cancelled.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from pallas_kernels import qmm, qmm_mgpu
from pallas_kernels.bench.common import table, traced_us
from pallas_kernels.qweight import QuantizedWeight, dequantize, natural_words, to_lane_words

SHAPES = ((5120, 17408), (17408, 5120), (5120, 10240), (5120, 6144), (6144, 5120), (5120, 12288), (5120, 248320))
# The Mosaic GPU decode kernel's variants `--mgpu` times: `qmm_mgpu.qmm_decode` keywords, and whether the scales
# and biases come transposed and the words repacked beforehand (`pre`; else every call does it).
# `rows`: the piece height (qmm_mgpu.PIECE_ROWS, default 16); M past it runs in pieces of that height, as
# `qmm_rows` cuts them (the weight read once a piece).
MGPU_VARIANTS = (dict(stages=4, block_groups=4, pre=True), dict(stages=4, block_groups=4, pre=False),
                 dict(stages=4, block_groups=4, pre=True, conversion="nibbles"),
                 dict(stages=6, block_groups=4, pre=True), dict(stages=4, block_groups=4, pre=True, conversion="unsigned"),
                 dict(stages=3, block_groups=8, pre=True), dict(stages=8, block_groups=2, pre=True),
                 dict(stages=4, block_groups=4, pre=True, rows=32), dict(stages=4, block_groups=4, pre=True, rows=64),
                 dict(stages=4, block_groups=4, pre=True, rows=8), dict(stages=8, block_groups=4, pre=True, rows=8),
                 dict(stages=4, block_groups=8, pre=True, rows=8))
SWEEP_SHAPES = ((5120, 17408), (17408, 5120), (5120, 6144), (6144, 5120))
MS = (1, 4, 16, 64, 256, 1024, 4096)
BITS, GROUP = 4, 64
BF16_DOT_LABEL = "bf16 jnp.dot (weight already bf16)"
L2_BYTES = 60 << 20  # H200: 50 MB (rounded up, so the copies surely spill it)
TARGET_US, MIN_REPS, MAX_REPS = 2000.0, 3, 64  # device time a program aims at; calls a program


# ---------------------------------------------------------------------------------------------------------------
# timing


@dataclasses.dataclass(frozen=True)
class Timing:
    us: float  # device µs a call: (two programs back to back - one) / reps
    fixed_us: float  # what cancelled: one program's time - reps * us (host dispatch, launch, sync)
    reps: int
    dispatch_us: float  # host time to enqueue one program; must stay well below reps * us
    # --trace: the device's busy µs a call (the program's kernels summed from a jax.profiler trace of one run,
    # divided by reps: no launch gaps), and the same by kernel name; NaN / {} without a trace
    busy_us: float = math.nan
    by_name: dict = dataclasses.field(default_factory=dict)

    @property
    def best(self) -> float:
        """The figure a table row uses (`_best`)."""
        return _best(self.us, self.busy_us)


def _reps(est_us: float, interpret: bool) -> int:
    if interpret:
        return 2  # CPU smoke runs: the path, not the number
    return int(min(MAX_REPS, max(MIN_REPS, math.ceil(TARGET_US / max(est_us, 0.5)))))


def lower_chain(fn, arg_sets: list[tuple], reps: int, takes_after: bool = False):
    """The jitted program fn(*arg_sets[0]) -> fn(*arg_sets[1]) -> ... (`reps` calls), lowered. Each call is
    ordered after the previous one: through `fn(*args, after=y)` when fn takes it (the Pallas kernel: an operand it
    never reads, a true data dependency), else by an optimization barrier on its arguments (XLA removes the
    barrier after scheduling; the barrier's copy of each output is returned, since XLA prunes a barrier's unused
    results). fn is jitted once, so its kernel is lowered once and XLA compiles it once for all the calls."""
    inner = jax.jit(fn)

    def program(arg_sets):
        if takes_after:  # the first call gets an `after` too, so every call is one kernel (one Triton compile)
            first = jax.eval_shape(inner, *arg_sets[0])
            y = inner(*arg_sets[0], after=jnp.zeros(first.shape, first.dtype))
        else:
            y = inner(*arg_sets[0])
        kept = []
        for i in range(1, reps):
            args, y = jax.lax.optimization_barrier((arg_sets[i % len(arg_sets)], y))
            kept.append(y)
            y = inner(*args, after=y) if takes_after else inner(*args)
        return kept + [y]

    return jax.jit(program).lower(arg_sets)


def time_chain(compiled, arg_sets: list[tuple], reps: int, samples: int = 7) -> Timing:
    def run(times: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        for _ in range(times):
            out = compiled(arg_sets)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) * 1e6, (t1 - t0) * 1e6 / times

    for _ in range(2):
        run(1)
        run(2)
    one, two, dispatch = [], [], []
    for _ in range(samples):
        t, d = run(1)
        one.append(t)
        dispatch.append(d)
        two.append(run(2)[0])
    t1, t2 = statistics.median(one), statistics.median(two)
    us = max(t2 - t1, 0.0) / reps
    return Timing(us, t1 - reps * us, reps, statistics.median(dispatch))


TRACE_DIR: str | None = None  # --trace: where device_us's traces go (each removed once read)


def device_us(fn, arg_sets: list[tuple], est_us: float, interpret: bool = False, takes_after: bool = False
              ) -> Timing:
    reps = _reps(est_us, interpret)
    compiled = lower_chain(fn, arg_sets, reps, takes_after).compile()
    t = time_chain(compiled, arg_sets, reps)
    if TRACE_DIR and not interpret:
        busy, by_name = traced_us(lambda: compiled(arg_sets), TRACE_DIR, per=reps)
        t = dataclasses.replace(t, busy_us=busy, by_name=by_name)
    return t


def copy_tbs(interpret: bool = False) -> float:
    """Device copy bandwidth now (bytes read + written, TB/s), timed like the kernels: x + 1 over 2 x 512 MB."""
    n = (1 << 20) if interpret else (128 << 20)
    srcs = [(jax.random.normal(jax.random.key(i), (n,), jnp.float32),) for i in range(2)]
    t = device_us(lambda a: a + 1.0, srcs, 2 * 4 * n / 4e12 * 1e6, interpret)
    # A chain too fast for the clock reads 0 µs (seen in interpret mode on a loaded CI box): no figure, not a crash.
    return 2 * 4 * n / (t.best * 1e-6) / 1e12 if t.best > 0 else float("nan")


# ---------------------------------------------------------------------------------------------------------------
# inputs


def _estimate_us(m: int, n: int, k: int) -> float:
    return max(_weight_bytes(n, k) / 3.0e12, 2 * m * n * k / 4.0e14) * 1e6


def _parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        k, n = item.lower().split("x")
        out.append((int(k), int(n)))
    return out


def _parse_ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _weight_bytes(n: int, k: int) -> int:
    return n * k * BITS // 8 + 2 * n * (k // GROUP) * 2


def _moved(m: int, n: int, k: int) -> int:
    return _weight_bytes(n, k) + 2 * m * (k + n)


def _random_weights(n: int, k: int, copies: int) -> list[QuantizedWeight]:
    ws = []
    for i in range(copies):
        key = jax.random.key(1000 + i)
        kw, ks, kb = jax.random.split(key, 3)
        words = jax.random.bits(kw, (n, k * BITS // 32), jnp.uint32)
        scales = (jax.random.uniform(ks, (n, k // GROUP), jnp.float32, 0.002, 0.02)).astype(jnp.bfloat16)
        biases = (-8.0 * scales.astype(jnp.float32) + jax.random.normal(kb, (n, k // GROUP)) * 1e-3).astype(
            jnp.bfloat16)
        ws.append(QuantizedWeight(words, scales, biases, BITS, GROUP))
    return qmm.decode_layout(ws)  # as the engine holds them: transposed scales, lane words where the kernel wants them


def _copies(nbytes: int, interpret: bool = False) -> int:
    return 2 if interpret else max(2, math.ceil(3 * L2_BYTES / nbytes))


def _x(m: int, k: int, seed: int = 50) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (m, k), jnp.bfloat16)


def _chunk_order(x: jax.Array) -> jax.Array:
    return qmm._to_kernel_order(x, qmm.block_cols(x.shape[1], BITS), BITS)


def _kernel_x(x: jax.Array, tiles: qmm.Tiles) -> jax.Array:
    """x as the fused kernel reads it with these tiles: natural order (strided loads) or permuted by XLA."""
    return x if tiles.x_natural else _chunk_order(x)


def _kernel_fn(tiles: qmm.Tiles, interpret: bool = False):
    """The pallas_call alone (plus the split-K sum), on x as the tiles read it (`_kernel_x`: natural order, or
    already permuted into chunk order as a jitted model sees it once XLA fuses the permutation into x's
    producer)."""
    def run(xk, w, after=None):
        return qmm._qmm_call(xk, w.words, w.scales, w.biases, w.out_features, w.bits, w.group_size, xk.dtype,
                             tiles, interpret, after=after)
    return run


def _path_fn(tiles: qmm.Tiles, x: jax.Array, ws: list[QuantizedWeight], interpret: bool = False):
    """(fn, takes_after, arg_sets) timing one path's tiles (decode or prompt) as a jitted model runs them: the
    fused kernel alone on x as the tiles read it (`_kernel_fn`, `_kernel_x`); the dequant implementation end to end (XLA dequantization of the whole weight,
    then the matmul kernel), ordered by the barrier chain like the XLA rows, so no call's dequantization runs
    ahead of the previous call."""
    if tiles.impl == "dequant":
        def run(x, w):
            return qmm.qmm(x, w, prompt=True, interpret=interpret, tiles=tiles)
        return run, False, [(x, w) for w in ws]
    return _kernel_fn(tiles, interpret), True, [(_kernel_x(x, tiles), w) for w in ws]


def _matmul_fn(tiles: qmm.Tiles, interpret: bool = False):
    """The dequant implementation's Pallas matmul alone, on a weight already dequantized to bf16 [N, K]."""
    def run(x, wd, after=None):
        return qmm._matmul_call(x, wd, x.dtype, tiles, interpret, after=after)
    return run


def _dequantize_fn(x, w):
    """XLA's dequantization pass alone (x unused: it keeps the chain's argument shape)."""
    del x
    return qmm.dequantize_for_matmul(w, jnp.bfloat16)


# The Pallas dequantization pass's blocks timed besides the shipped one: (rows, words, warps).
DEQUANT_PASS_VARIANTS = ((qmm.DEQUANT_PASS_ROWS, qmm.DEQUANT_PASS_WORDS, 4), (32, 128, 4), (16, 128, 4),
                         (32, 64, 4), (8, 128, 2))


def _dequant_pass_fn(interpret: bool = False, rows: int = qmm.DEQUANT_PASS_ROWS, words: int = qmm.DEQUANT_PASS_WORDS,
                     warps: int = 4):
    """The dequant implementation's Pallas dequantization pass alone (same bits as `_dequantize_fn`)."""
    def run(x, w):
        del x
        return qmm.dequant_pass(w, interpret=interpret, rows=rows, words=words, num_warps=warps)
    return run


def _dequant_dot(x, w):
    """The whole weight dequantized to bf16 by one XLA fusion into memory (the barrier keeps XLA from fusing it
    into the matmul), then a bf16 matmul with fp32 accumulation."""
    deq = jax.lax.optimization_barrier(dequantize(w, jnp.bfloat16))
    return jnp.dot(x, deq.T, preferred_element_type=jnp.float32).astype(x.dtype)


def _dequant_dot_fused(x, w):
    """The same, with XLA free to fuse the dequantization into the matmul as it sees fit."""
    return jnp.dot(x, dequantize(w, jnp.bfloat16).T, preferred_element_type=jnp.float32).astype(x.dtype)


def _bf16_dot(x, dense):
    return jnp.dot(x, dense, preferred_element_type=jnp.float32).astype(x.dtype)


# ---------------------------------------------------------------------------------------------------------------
# comparison table


def _torch_int4(n: int, k: int, ms, copies: int) -> dict[int, float]:
    """µs of torch.ops.aten._weight_int4pack_mm per M (group 64, CUDA events around back-to-back calls), or {}
    when torch or the op is missing."""
    try:
        import torch
        w_u8 = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda") for _ in range(copies)]
        packed = [torch.ops.aten._convert_weight_to_int4pack(w, 8) for w in w_u8]
        sz = [torch.rand((k // GROUP, n, 2), dtype=torch.bfloat16, device="cuda") * 0.01 for _ in range(copies)]
    except Exception as e:  # noqa: BLE001 -- report and carry on: torch is a comparison, not a dependency
        print(f"torch int4: unavailable ({type(e).__name__}: {str(e)[:200]})", file=sys.stderr)
        return {}
    out = {}
    for m in ms:
        try:
            reps = int(min(20, max(1, 3000.0 // _estimate_us(m, n, k))))
            xs = [torch.randn((m, k), dtype=torch.bfloat16, device="cuda") for _ in range(2)]
            for i in range(3):
                torch.ops.aten._weight_int4pack_mm(xs[i % 2], packed[i % copies], GROUP, sz[i % copies])
            torch.cuda.synchronize()
            samples = []
            for _ in range(5):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for i in range(reps):
                    torch.ops.aten._weight_int4pack_mm(xs[i % 2], packed[i % copies], GROUP, sz[i % copies])
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end) * 1e3 / reps)
            out[m] = statistics.median(samples)
        except Exception as e:  # noqa: BLE001
            print(f"torch int4 M={m}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
    return out


@dataclasses.dataclass
class Row:
    shape: str
    m: int
    path: str  # "decode" / "prompt": qmm() as the model calls it (prompt=False / True)
    us: float  # the chain's µs a call (launch gaps included)
    busy_us: float  # --trace: the device's busy µs a call (NaN without)
    tbs: float  # of bytes moved, over busy_us where traced, else us
    pct_copy: float
    tflops: float
    xla_ref_us: float | None = None  # busy where traced, else the chain's µs (as the copy and bf16 columns)
    bf16_us: float | None = None
    torch_us: float | None = None  # CUDA events around back-to-back calls
    by_name: dict = dataclasses.field(default_factory=dict)


def _best(us: float, busy_us: float) -> float:
    """The figure a table row uses: the device's busy µs where traced, else the chain's µs."""
    return us if math.isnan(busy_us) else busy_us


def _bench_shape(k: int, n: int, ms, copy: float, use_torch: bool, ref_max_m: int, on_row=None) -> list[Row]:
    """qmm() as the model calls it (decode rows up to 256: on a GPU the Mosaic GPU kernel, `qmm.DECODE_IMPL`;
    prompt rows from 64: the prompt path), beside the XLA dequantize + matmul, a bf16 matmul and torch's int4."""
    copies = _copies(_weight_bytes(n, k))
    ws = _random_weights(n, k, copies)
    dense = [jax.random.normal(jax.random.key(7 + i), (k, n), jnp.bfloat16) for i in range(_copies(2 * n * k))]
    torch_us = _torch_int4(n, k, ms, copies) if use_torch else {}
    rows = []
    for m in ms:
        est = _estimate_us(m, n, k)
        x = _x(m, k)
        bf16_us = device_us(_bf16_dot, [(x, d) for d in dense], est).best
        xla_ref = device_us(qmm.reference, [(x, w) for w in ws], est * 4).best if m <= ref_max_m else None
        for prompt in (False, True):
            if (prompt and m < 64) or (not prompt and m > 256):
                continue
            t = device_us(lambda x, w, p=prompt: qmm.qmm(x, w, prompt=p), [(x, w) for w in ws], est)
            tbs = _moved(m, n, k) / (t.best * 1e-6) / 1e12
            rows.append(Row(f"{k}->{n}", m, "prompt" if prompt else "decode", t.us, t.busy_us, tbs,
                            100 * tbs / copy, 2 * m * n * k / (t.best * 1e-6) / 1e12, xla_ref, bf16_us,
                            torch_us.get(m), t.by_name))
            print(f"  {k}->{n} M={m} {rows[-1].path}: {t.us:.1f} us chained, {t.busy_us:.1f} us busy "
                  f"({tbs:.2f} TB/s, {rows[-1].pct_copy:.0f}% copy, {rows[-1].tflops:.0f} TFLOP/s) | XLA ref "
                  f"{xla_ref} | bf16 mm {bf16_us:.1f} | torch int4 {torch_us.get(m)} | by kernel "
                  + ", ".join(f"{k_}={v:.1f}" for k_, v in sorted(t.by_name.items(), key=lambda kv: -kv[1])[:4]),
                  flush=True)
            if on_row is not None:
                on_row(rows)
    return rows


def _fmt(v):
    return "-" if v is None else v


def _report(rows: list[Row], copy: float) -> str:
    traced = any(not math.isnan(r.busy_us) for r in rows)
    head = ["K->N", "M", "path", "chained us", "busy us", "TB/s", "%copy", "TFLOP/s", "%bf16", "XLA ref us",
            "bf16 mm us", "torch int4 us"]
    body = []
    for r in rows:
        pct_bf16 = 100 * r.bf16_us / _best(r.us, r.busy_us) if r.bf16_us else None
        body.append([r.shape, r.m, r.path, r.us, r.busy_us, r.tbs, r.pct_copy, r.tflops, _fmt(pct_bf16),
                     _fmt(r.xla_ref_us), _fmt(r.bf16_us), _fmt(r.torch_us)])
    how = ("TB/s, % copy, % bf16 and the XLA / bf16 columns from the device's busy time a call (trace)" if traced
           else "all jax columns from the chained µs (launch gaps included; --trace for busy times)")
    return f"copy bandwidth measured now: {copy:.2f} TB/s; {how}\n" + table(head, body)


# ---------------------------------------------------------------------------------------------------------------
# tile sweep


def tiles_str(t: qmm.Tiles) -> str:
    if t.impl == "dequant":
        return (f"dequant {t.block_m}x{t.block_n}x{t.block_k} w{t.num_warps} s{t.num_stages} g{t.group_m}"
                + (f" split{t.k_splits}" if t.k_splits > 1 else ""))
    # Every switch that is on, by its field name: a variant that differs only in a switch gets its own label.
    switches = [f.name for f in dataclasses.fields(t) if f.type == "bool" and getattr(t, f.name)]
    return " ".join([f"{t.block_m}/{t.block_n}/{t.blocks_per_step}/{t.num_warps}/{t.num_stages}/{t.max_m_blocks}/"
                     f"{t.k_splits}"] + switches)


def dequant_candidates(n: int, k: int) -> list[qmm.Tiles]:
    """The dequant implementation's matmul tiles to time, `DEQUANT_PROMPT_TILES` first, each fitted to the shape
    (duplicates after fitting dropped). All 8 warps (two warpgroups of wgmma) and block_k 64 (128 B of each operand
    row a load). Offline (pip triton 3.6.0, sm_90, XLA's make_ttir passes; docs/kernels/qmm.md): 128x256 147 KB of
    shared memory at 3 stages, 196 KB at 4, 157 registers (one program a SM); 128x128 at 3 stages 98 KB and 94
    registers, so two programs a SM (one's epilogue under the other's MMAs); 256x128 147 KB, 161 registers; none
    spills, all keep one wgmma in flight. group_m 16 halves the weight tiles a wave reads at M = 4096 (a 132-program
    wave: 16 row tiles x ~8 weight tiles instead of 8 x ~16). Split-K 2 / 4 (session 9, untimed): at N = 5120 and
    M = 1024 the shipped tile makes 8 x 20 = 160 programs of one a SM on 132 SMs, a second wave of 28; split in
    two or four, 320 or 640 programs fill the waves better, at the cost of fp32 partials written and summed.
    64-row tiles on one warpgroup (session 10): the same m64n256k16 wgmma a row meets in the shipped tile's two
    warpgroups, so the same bits (`test_gpu_dequant_row_tile_height_same_bits`), and 320 programs at N = 5120,
    M = 1024 without partials."""
    base = qmm.DEQUANT_PROMPT_TILES
    wanted = [base, dataclasses.replace(base, num_stages=4),
              dataclasses.replace(base, block_n=128),
              dataclasses.replace(base, block_m=256, block_n=128),
              dataclasses.replace(base, group_m=16),
              dataclasses.replace(base, k_splits=2), dataclasses.replace(base, k_splits=4),
              dataclasses.replace(base, block_m=64, num_warps=4),
              dataclasses.replace(base, block_m=64, num_warps=4, num_stages=4)]
    out = []
    for t in wanted:
        t = qmm.fit_dequant_tiles(t, n, k)
        if t not in out:
            out.append(t)
    return out


def parse_tiles(text: str) -> qmm.Tiles:
    """"bm/bn/blocks_per_step/warps/stages/max_m_blocks/k_splits" (trailing fields may be left out)."""
    return qmm.Tiles(*(int(v) for v in text.split("/")))


def _fits(t: qmm.Tiles, k: int) -> bool:
    return qmm.fit_tiles(t, k, BITS) == t


def _sweep_candidates(n: int, k: int) -> list[qmm.Tiles]:
    """Decode candidates for one shape (M = 1 and 16 alike), the default first, in priority order (the budget
    guard drops the tail). Offline SASS (docs/kernels/qmm.md, "Occupancy") says every variant gives a warp 16 output
    features, so N/16 warps in all: 8 a SM at N = 17408, 2.4 at N = 5120, whatever the tiles. Split-K multiplies
    that by S, so the candidates are mostly split counts x small-shared-memory tiles; S is the count that cuts this
    K's blocks evenly nearest to the one wanted."""
    blocks = qmm._padded_k(k, BITS) // qmm.block_cols(qmm._padded_k(k, BITS), BITS)

    def split(t: qmm.Tiles, wanted: int) -> qmm.Tiles:
        ok = [s for s in range(1, blocks // t.blocks_per_step + 1) if (blocks // t.blocks_per_step) % s == 0]
        return dataclasses.replace(t, k_splits=min(ok, key=lambda s: (abs(s - wanted), s)))

    T = qmm.Tiles
    bn32, bn32_2st, bm8 = T(16, 32, 1, 2, 3, 2), T(16, 32, 1, 2, 2, 2), T(8, 32, 1, 2, 3, 2)
    wg, bn16, dflt = T(16, 64, 1, 4, 3, 2), T(16, 16, 1, 1, 2, 2), qmm.DECODE_TILES
    if n >= 8192:  # 8+ warps a SM already: S of 2 and 4
        order = [bn32, split(bn32, 2), split(bn32, 4), split(bn32_2st, 4), split(bm8, 2), split(bm8, 4),
                 split(wg, 2), split(wg, 4), split(bn16, 4), split(dflt, 2), split(T(16, 32, 1, 2, 4, 2), 2), bm8,
                 wg]
    else:  # 2-3 warps a SM: S of 4 to 16
        order = [split(bn32, 4), split(bn32, 8), split(bn32, 16), split(bn32_2st, 8), split(bn32_2st, 16),
                 split(bm8, 8), split(wg, 8), split(wg, 16), split(bn16, 8), split(dflt, 4), bn32, split(bm8, 16)]
    def same_kernel(t: qmm.Tiles) -> qmm.Tiles:  # one loop step a program: nothing to pipeline, stages moot
        one_step = blocks == t.blocks_per_step * t.k_splits
        return dataclasses.replace(t, num_stages=0) if one_step else t

    shipped = qmm.decode_tiles(n, k, BITS, GROUP)
    out = [shipped]
    for t in order:
        t = qmm.fit_tiles(dataclasses.replace(t, x_natural=shipped.x_natural), k, BITS)
        if same_kernel(t) not in [same_kernel(o) for o in out]:
            out.append(t)
    # The shipped tiles once more with the other way of reading x (strided natural-order loads vs XLA's permuted
    # copy): what the strided loads cost inside the kernel (the transpose they save is a launch outside it).
    return out[:1] + [dataclasses.replace(shipped, x_natural=not shipped.x_natural)] + out[1:]


@dataclasses.dataclass
class Job:
    kind: str  # "decode" (a tile candidate) or "prompt" (the prompt-path comparison)
    shape: tuple[int, int]  # (K, N)
    m: int
    label: str
    rank: int  # priority: lower is lowered, compiled and timed first
    fn: object  # what one call runs
    takes_after: bool  # fn(*args, after=y) orders the call after y (the Pallas kernel)
    arg_sets: list
    reps: int
    default: bool = False
    tiles: qmm.Tiles | None = None
    lowered: object = None
    compiled: object = None
    error: str | None = None
    timing: Timing | None = None


def _sweep(args, t_start: float) -> dict:
    def elapsed() -> float:
        return time.perf_counter() - t_start

    copy = copy_tbs(args.interpret)
    print(f"[{elapsed():5.1f}s] copy bandwidth {copy:.2f} TB/s", flush=True)
    jobs: list[Job] = []
    for k, n in [] if args.prompt_only else args.shapes:
        copies = _copies(_weight_bytes(n, k), args.interpret)
        ws = _random_weights(n, k, copies)
        default = qmm.decode_tiles(n, k, BITS, GROUP)
        cands = args.candidates or ([qmm.replace_tiles(default, v) for v in args.variants] if args.variants
                                    else _sweep_candidates(n, k))
        if default not in cands:
            cands = [default] + cands
        for t in cands:
            if not _fits(t, k):
                print(f"  {k}->{n}: {tiles_str(t)} does not cut K's blocks evenly; left out", flush=True)
        cands = [t for t in cands if _fits(t, k)][:args.max_candidates]
        for m in args.m:
            x = _x(m, k)
            for rank, t in enumerate(cands):
                jobs.append(Job("decode", (k, n), m, tiles_str(t), rank, *_path_fn(t, x, ws, args.interpret),
                                _reps(_estimate_us(m, n, k), args.interpret), t == default, t))
            for variant in MGPU_VARIANTS if args.mgpu and not args.interpret else ():
                # the experimental Mosaic GPU kernel, ordered by the barrier chain like the XLA rows
                kw = dict(variant)
                pre = kw.pop("pre")
                if (k // GROUP) % kw["block_groups"]:
                    continue
                rows = kw.pop("rows", qmm_mgpu.ROWS)
                one = functools.partial(qmm_mgpu.qmm_decode, rows=rows, **kw)
                fn = (lambda x, w, transposed=None, one=one, rows=rows: jnp.concatenate(
                    [one(x[i:i + rows], w, transposed=transposed) for i in range(0, x.shape[0], rows)]))
                bare = [dataclasses.replace(w, words=natural_words(w), lanes=False, scales_t=None, biases_t=None,
                                            subnormal=False, row_scale=None) for w in ws]
                arg_sets = [(x, w) for w in bare]
                if pre:  # as decode_layout leaves them for the variant's conversion
                    fn = lambda x, w, st, bt, fn=fn: fn(x, w, transposed=(st, bt))
                    lane = kw.get("conversion", qmm_mgpu.CONVERSION) in qmm_mgpu.LANE_CONVERSIONS
                    laid = [dataclasses.replace(w, words=jax.jit(to_lane_words)(w.words), lanes=True) if lane else w
                            for w in bare]
                    arg_sets = [(x, w, w.scales.T, w.biases.T) for w in laid]
                label = "mosaic gpu " + ",".join(f"{key}={val}" for key, val in variant.items())
                jobs.append(Job("decode", (k, n), m, label, 1, fn, False, arg_sets,
                                _reps(_estimate_us(m, n, k), args.interpret)))
    for k, n in args.prompt_shapes if args.prompt_ms else ():
        ws = _random_weights(n, k, _copies(_weight_bytes(n, k), args.interpret))
        dense = [jax.random.normal(jax.random.key(7 + i), (k, n), jnp.bfloat16)
                 for i in range(_copies(2 * n * k, args.interpret))]
        dense_nk = [jax.random.normal(jax.random.key(17 + i), (n, k), jnp.bfloat16)
                    for i in range(_copies(2 * n * k, args.interpret))]
        shipped = qmm.prompt_tiles(n, k, BITS, GROUP)
        fused = qmm.prompt_tiles(n, k, BITS, GROUP, "fused")
        cands = dequant_candidates(n, k)[:args.dequant_candidates]
        for m in args.prompt_ms:
            x = _x(m, k)
            reps = _reps(_estimate_us(m, n, k), args.interpret)
            fn, takes_after, arg_sets = _path_fn(fused, x, ws, args.interpret)
            jobs.append(Job("prompt", (k, n), m, f"pallas fused prompt {tiles_str(fused)}", 2, fn, takes_after,
                            arg_sets, reps, fused == shipped, fused))
            for i, t in enumerate(cands):  # e2e: XLA dequantization + the Pallas matmul, like qmm() in a model
                fn, takes_after, arg_sets = _path_fn(t, x, ws, args.interpret)
                jobs.append(Job("prompt", (k, n), m, f"pallas {tiles_str(t)} (dequant pass + pallas mm)",
                                2 + min(i, 1) + i // 3, fn, takes_after, arg_sets, reps, t == shipped, t))
            jobs.append(Job("prompt", (k, n), m, f"  its matmul alone, {tiles_str(cands[0])}, weight already bf16", 3,
                            _matmul_fn(cands[0], args.interpret), True, [(x, d) for d in dense_nk], reps, False,
                            cands[0]))
            for i, (r, c, nw) in enumerate(DEQUANT_PASS_VARIANTS if m == args.prompt_ms[0] else
                                           DEQUANT_PASS_VARIANTS[:1]):  # x is not read: one M is enough
                jobs.append(Job("prompt", (k, n), m, f"  its dequantization pass alone (pallas {r}x{c} words, "
                                f"{nw} warps{', shipped' if i == 0 else ''})", 3 + min(i, 1),
                                _dequant_pass_fn(args.interpret, r, c, nw), False, [(x, w) for w in ws], reps))
            jobs.append(Job("prompt", (k, n), m, "  the same by xla (dequantize_for_matmul, same bits)", 3,
                            _dequantize_fn, False, [(x, w) for w in ws], reps))
            jobs.append(Job("prompt", (k, n), m, "xla dequant->bf16 in memory, jnp.dot", 2, _dequant_dot, False,
                            [(x, w) for w in ws], reps))
            jobs.append(Job("prompt", (k, n), m, "xla dequant + jnp.dot, fused as XLA likes", 4,
                            _dequant_dot_fused, False, [(x, w) for w in ws], reps))
            jobs.append(Job("prompt", (k, n), m, BF16_DOT_LABEL, 2, _bf16_dot, False, [(x, d) for d in dense], reps))
    jobs.sort(key=lambda j: j.rank)  # stable: within a rank, shapes and M in order
    print(f"[{elapsed():5.1f}s] {len(jobs)} programs: lowering here, compiling on {args.threads} threads",
          flush=True)

    def compile_one(job: Job) -> None:
        try:
            job.compiled = job.lowered.compile()
        except Exception as e:  # noqa: BLE001 -- a candidate that does not compile is a result too
            job.error = f"compile: {type(e).__name__}: {str(e)[:300]}"

    # Lowering (Python, serial) overlaps the compiles (XLA + Triton, threads) of the programs lowered before.
    with concurrent.futures.ThreadPoolExecutor(args.threads) as pool:
        futures = []
        for i, job in enumerate(jobs):
            if elapsed() > 0.6 * args.budget_s:
                job.error = "skipped (budget)"
                continue
            try:
                job.lowered = lower_chain(job.fn, job.arg_sets, job.reps, job.takes_after)
                futures.append(pool.submit(compile_one, job))
            except Exception as e:  # noqa: BLE001
                job.error = f"lower: {type(e).__name__}: {str(e)[:300]}"
            if (i + 1) % 10 == 0:
                done = sum(f.done() for f in futures)
                print(f"[{elapsed():5.1f}s] lowered {i + 1}/{len(jobs)}, compiled {done}", flush=True)
        done = 0
        for _ in concurrent.futures.as_completed(futures):
            done += 1
            if done % 10 == 0 or done == len(futures):
                print(f"[{elapsed():5.1f}s] compiled {done}/{len(futures)}", flush=True)
            if elapsed() > 0.85 * args.budget_s:
                for f in futures:
                    f.cancel()  # not started yet: reported as skipped

    result = dict(copy_tbs=copy, device=jax.devices()[0].device_kind, rows=[])
    for job in jobs:
        if job.compiled is not None and job.error is None:
            if elapsed() > args.budget_s:
                job.error = "skipped (budget)"
            else:
                try:
                    job.timing = time_chain(job.compiled, job.arg_sets, job.reps)
                except Exception as e:  # noqa: BLE001
                    job.error = f"run: {type(e).__name__}: {str(e)[:300]}"
        elif job.error is None:
            job.error = "skipped (budget)"
        job.compiled = job.lowered = None  # free the executables as we go
        k, n = job.shape
        row = dict(kind=job.kind, shape=f"{k}->{n}", m=job.m, label=job.label, default=job.default,
                   tiles=None if job.tiles is None else dataclasses.asdict(job.tiles), error=job.error)
        if job.timing is not None:
            t = job.timing
            if t.us <= 0:
                job.error = row["error"] = "noise: two programs took no longer than one"
            tbs = _moved(job.m, n, k) / (t.us * 1e-6) / 1e12 if t.us > 0 else None
            # Host-bound: the host could not enqueue the second program before the device finished the first.
            row.update(us=t.us, fixed_us=t.fixed_us, reps=t.reps, dispatch_us=t.dispatch_us, tbs=tbs,
                       host_bound=t.dispatch_us > 0.5 * t.reps * t.us,
                       pct_copy=None if tbs is None else 100 * tbs / copy,
                       tflops=2 * job.m * n * k / (t.us * 1e-6) / 1e12 if t.us > 0 else None)
            if job.tiles is not None and job.kind == "decode":
                t_ = job.tiles
                row["programs"] = (-(-n // t_.block_n) * t_.k_splits
                                   * -(-job.m // (t_.block_m * t_.max_m_blocks)))
            print(f"[{elapsed():5.1f}s] {row['shape']} M={job.m} {job.label}: {t.us:.1f} us ({tbs or 0:.2f} TB/s, "
                  f"fixed {t.fixed_us:.0f} us/program, reps {t.reps}, dispatch {t.dispatch_us:.0f} us)", flush=True)
        else:
            print(f"[{elapsed():5.1f}s] {row['shape']} M={job.m} {job.label}: {job.error}", flush=True)
        result["rows"].append(row)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    result["elapsed_s"] = elapsed()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def _sweep_report(result: dict) -> str:
    """One compact table per (shape, M), fastest first; then the prompt-path comparison."""
    rows = result["rows"]
    out = [f"copy bandwidth {result['copy_tbs']:.2f} TB/s; tiles = bm/bn/blocks_per_step/warps/stages/"
           "max_m_blocks/k_splits; * = the shipped default"]
    keys = []
    for r in rows:
        if (r["kind"], r["shape"], r["m"]) not in keys:
            keys.append((r["kind"], r["shape"], r["m"]))
    for kind, shape, m in keys:
        group = [r for r in rows if (r["kind"], r["shape"], r["m"]) == (kind, shape, m)]
        timed = sorted((r for r in group if r["error"] is None), key=lambda r: r["us"])
        ref = next((r["us"] for r in group if r["default"] and r["error"] is None), None)
        bf16 = next((r["us"] for r in timed if r["label"] == BF16_DOT_LABEL), None)
        body = []
        for r in timed:
            body.append([("*" if r["default"] else "") + r["label"] + (" (host-bound!)" if r["host_bound"] else ""),
                         r["us"], _fmt(r.get("tbs")),
                         _fmt(r.get("pct_copy")), _fmt(r.get("tflops")) if kind == "prompt" else r.get("programs"),
                         ref / r["us"] if ref else "-", r["fixed_us"]]
                        + ([100 * bf16 / r["us"] if bf16 else "-"] if kind == "prompt" else []))
        failed = [r for r in group if r["error"] is not None]
        head = ["tiles" if kind == "decode" else "impl", "us", "TB/s", "%copy",
                "TFLOP/s" if kind == "prompt" else "programs", "x default", "fixed us"] + (
                    ["% bf16 dot"] if kind == "prompt" else [])
        out.append(f"\n{kind} {shape} M={m}" + (f" ({len(failed)} failed/skipped)" if failed else ""))
        if body:
            out.append(table(head, body))
        for r in failed:
            out.append(f"  {r['label']}: {r['error']}")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    t_start = time.perf_counter()
    ap = argparse.ArgumentParser(prog="python -m pallas_kernels.bench qmm")
    ap.add_argument("--shapes", type=_parse_shapes, default=None,
                    help="K x N list, e.g. 5120x17408 (default: all 27B shapes; --sweep: the four decode shapes)")
    ap.add_argument("--m", type=_parse_ints, default=None, help="rows (default: 1..4096; --sweep: 1,16)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--ref-max-m", type=int, default=256, help="largest M to time the fp32 XLA reference at")
    ap.add_argument("--sweep", action="store_true", help="time decode tile candidates instead of the comparison")
    ap.add_argument("--candidates", type=lambda s: [parse_tiles(v) for v in s.split(",")], default=None,
                    help="--sweep: tiles to try, bm/bn/bps/warps/stages/mb/splits,... (default: per shape)")
    ap.add_argument("--variants", type=lambda s: [v for v in s.split(";") if v], default=None,
                    help="--sweep: instead of the candidates, the shipped tiles with each of these overrides "
                         "(';'-separated FIELD=V,... as qmm.replace_tiles takes), e.g. 'prefetch=1;lop3=1'")
    ap.add_argument("--max-candidates", type=int, default=12, help="--sweep: candidates per shape and M")
    ap.add_argument("--prompt-ms", type=_parse_ints, default=[],
                    help="--sweep: also compare the prompt path with XLA dequantize + jnp.dot at these M")
    ap.add_argument("--prompt-shapes", "--prompt-shape", dest="prompt_shapes", type=_parse_shapes,
                    default=[(5120, 17408), (17408, 5120)], help="--sweep: K x N list for the prompt comparison")
    ap.add_argument("--dequant-candidates", type=int, default=9,
                    help="--sweep: tiles of the dequant prompt implementation to time (`dequant_candidates`)")
    ap.add_argument("--prompt-only", action="store_true", help="--sweep: only the prompt comparison (no decode tiles)")
    ap.add_argument("--mgpu", action="store_true",
                    help="--sweep: also time the experimental Mosaic GPU decode kernel (pallas_kernels/qmm_mgpu.py; "
                         "compiled kernels only, no interpret mode)")
    ap.add_argument("--budget-s", type=float, default=150.0, help="--sweep: wall-clock bound of the whole run")
    ap.add_argument("--threads", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)),
                    help="--sweep: compile threads")
    ap.add_argument("--interpret", action="store_true", help="run the kernels in interpret mode (CPU smoke test)")
    ap.add_argument("--json", default=None, help="write all results here (rewritten after every row)")
    ap.add_argument("--once", action="store_true", help="run each kernel 3 times untimed (a target for ncu)")
    ap.add_argument("--trace", metavar="DIR", default=None,
                    help="comparison: also time each jax call's kernels from a jax.profiler trace under DIR (the "
                         "device's busy µs a call, without the chain's launch gaps); the table's rates use it")
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu" and not args.interpret:
        print("qmm bench: needs a GPU (jax.default_backend() is "
              f"{jax.default_backend()!r}); --interpret runs the sweep's path on CPU", file=sys.stderr)
        return 2
    print(f"device: {jax.devices()[0].device_kind}", flush=True)
    if args.sweep:
        args.shapes = args.shapes or list(SWEEP_SHAPES)
        args.m = args.m or [1, 16]
        print(_sweep_report(_sweep(args, t_start)), flush=True)
        print(f"sweep done in {time.perf_counter() - t_start:.0f} s", flush=True)
        return 0
    args.shapes = args.shapes or list(SHAPES)
    args.m = args.m or list(MS)
    if args.once:
        _once(args.shapes, args.m)
        return 0
    global TRACE_DIR
    TRACE_DIR = args.trace
    copy = copy_tbs()
    print(f"copy bandwidth: {copy:.2f} TB/s{' (busy time, traced)' if TRACE_DIR else ''}", flush=True)
    rows: list[Row] = []

    def save(partial):
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(copy_tbs=copy, rows=[dataclasses.asdict(r) for r in rows + partial]), f, indent=1)

    for k, n in args.shapes:
        rows += _bench_shape(k, n, args.m, copy, not args.no_torch, args.ref_max_m, on_row=save)
        save([])
    print(_report(rows, copy))
    return 0


def _once(shapes, ms) -> None:
    """Each shape and M through the kernel a few times, untimed: a target for `ncu`."""
    for k, n in shapes:
        w = _random_weights(n, k, 1)[0]
        for m in ms:
            prompt = m > 256
            tiles = (qmm.prompt_tiles if prompt else qmm.decode_tiles)(n, k, BITS, GROUP)
            fn, _, arg_sets = _path_fn(tiles, _x(m, k), [w])
            f = jax.jit(fn)
            for _ in range(3):
                jax.block_until_ready(f(*arg_sets[0]))
            print(f"ran {k}->{n} M={m} {tiles}", flush=True)
