"""Benchmark of the group-quantized matmul on the 27B's projection shapes (GPU).

    python -m pallas_kernels.bench qmm [--shapes 5120x17408,...] [--m 1,16,...] [--no-torch] [--json PATH]
    python -m pallas_kernels.bench qmm --sweep [--shapes ...] [--m ...]     # tile variants, to pick the defaults

Per shape (K -> N, 4-bit, group 64, random weights made on the GPU) and M: the Pallas kernel (decode path for
M <= 256, prompt path for M >= 64; the kernel alone on an x already in chunk order, as a jitted model sees it
once XLA fuses the permutation into x's producer, and `qmm()` end to end for M <= 16), the XLA dequantize +
matmul (`qmm.reference`, fp32, jitted), a bf16 matmul of the same shape, and torch's int4 tinygemm
(`_weight_int4pack_mm`, group 64) when torch is there. Times are device times with the host dispatch amortized
(`device_us`; torch: CUDA events). Bytes moved = packed weight + scales + biases + x + y; weights are rotated over
enough copies to defeat the 60 MB L2. The last table is compact.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from pallas_kernels import qmm
from pallas_kernels.bench.common import copy_bandwidth_tbs, table
from pallas_kernels.qweight import QuantizedWeight

SHAPES = ((5120, 17408), (17408, 5120), (5120, 10240), (5120, 6144), (6144, 5120), (5120, 12288), (5120, 248320))
MS = (1, 4, 16, 64, 256, 1024, 4096)
BITS, GROUP = 4, 64
L2_BYTES = 60 << 20


def device_us(fn, make_args, est_us: float, budget_us: float = 3000.0, samples: int = 5) -> float:
    """µs per call of fn, with the host's dispatch cost amortized: one jitted program runs fn on R distinct
    argument sets back to back (R from an estimate of one call, so a sample takes about `budget_us`), and the
    median of `samples` runs is divided by R. `make_args(i)` gives the i-th argument tuple; distinct x per call
    keeps XLA from merging identical calls. (common.time_us times one dispatch + sync per call: on the device
    machine that host cost was ~80 µs, larger than the small kernels themselves.)"""
    reps = int(min(20, max(1, budget_us // max(est_us, 1.0))))
    sets = [make_args(i) for i in range(reps)]
    prog = jax.jit(lambda sets: [fn(*a) for a in sets])
    jax.block_until_ready(prog(sets))
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        jax.block_until_ready(prog(sets))
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times) / reps


def _estimate_us(m: int, n: int, k: int) -> float:
    return max(_weight_bytes(n, k) / 3.0e12, 2 * m * n * k / 4.0e14) * 1e6


def _parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        k, n = item.lower().split("x")
        out.append((int(k), int(n)))
    return out


def _weight_bytes(n: int, k: int) -> int:
    return n * k * BITS // 8 + 2 * n * (k // GROUP) * 2


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
    return ws


def _copies(n: int, k: int) -> int:
    return max(2, math.ceil(3 * L2_BYTES / _weight_bytes(n, k)))


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
    path: str
    us: float
    tbs: float
    pct_copy: float
    tflops: float
    plain_us: float | None = None
    xla_ref_us: float | None = None
    bf16_us: float | None = None
    torch_us: float | None = None


def _kernel_fn(tiles: qmm.Tiles):
    """The pallas_call alone, on x already permuted into the kernel's chunk order (as a jitted model sees it once
    XLA fuses the permutation into x's producer)."""
    def run(xk, w):
        return qmm._qmm_call(xk, w.words, w.scales, w.biases, w.out_features, w.bits, w.group_size, xk.dtype,
                             tiles, False)
    return run


def _chunk_xs(m: int, k: int, count: int = 2):
    xs = [jax.random.normal(jax.random.key(50 + i), (m, k), jnp.bfloat16) for i in range(count)]
    return xs, [qmm._to_kernel_order(x, qmm.block_cols(k, BITS), BITS) for x in xs]


def _bench_shape(k: int, n: int, ms, copy_tbs: float, use_torch: bool, ref_max_m: int, on_row=None) -> list[Row]:
    copies = _copies(n, k)
    ws = _random_weights(n, k, copies)
    dense = [jax.random.normal(jax.random.key(7 + i), (k, n), jnp.bfloat16)
             for i in range(max(2, math.ceil(3 * L2_BYTES / (2 * n * k))))]
    torch_us = _torch_int4(n, k, ms, copies) if use_torch else {}
    rows = []
    for m in ms:
        est = _estimate_us(m, n, k)
        reps_max = 20
        xs = [jax.random.normal(jax.random.key(50 + i), (m, k), jnp.bfloat16) for i in range(reps_max)]
        xks = [qmm._to_kernel_order(x, qmm.block_cols(k, BITS), BITS) for x in xs]

        def args(i, xs=xs, ws=ws):
            return xs[i], ws[i % copies]

        def kargs(i, xks=xks, ws=ws):
            return xks[i], ws[i % copies]

        bf16_us = device_us(jnp.dot, lambda i, xs=xs: (xs[i], dense[i % len(dense)]), est)
        xla_ref = device_us(qmm.reference, args, est * 4) if m <= ref_max_m else None
        for prompt in (False, True):
            if (prompt and m < 64) or (not prompt and m > 256):
                continue
            tiles = (qmm.prompt_tiles if prompt else qmm.decode_tiles)(n, k, BITS, GROUP)
            us = device_us(_kernel_fn(tiles), kargs, est)
            e2e = device_us(lambda x, w, p=prompt: qmm.qmm(x, w, prompt=p), args, est) if m <= 16 else None
            moved = _weight_bytes(n, k) + 2 * m * (k + n)
            tbs = moved / (us * 1e-6) / 1e12
            rows.append(Row(f"{k}->{n}", m, "prompt" if prompt else "decode", us, tbs, 100 * tbs / copy_tbs,
                            2 * m * n * k / (us * 1e-6) / 1e12, e2e, xla_ref, bf16_us, torch_us.get(m)))
            print(f"  {k}->{n} M={m} {rows[-1].path}: {us:.1f} us ({tbs:.2f} TB/s, {rows[-1].pct_copy:.0f}% copy, "
                  f"{rows[-1].tflops:.0f} TFLOP/s) qmm() {e2e} | XLA ref {xla_ref} | bf16 mm {bf16_us:.1f} | "
                  f"torch int4 {torch_us.get(m)}", flush=True)
            if on_row is not None:
                on_row(rows)
    return rows


def _fmt(v):
    return "-" if v is None else v


def _report(rows: list[Row], copy_tbs: float) -> str:
    head = ["K->N", "M", "path", "kernel us", "TB/s", "%copy", "TFLOP/s", "%bf16", "qmm() us", "XLA ref us",
            "bf16 mm us", "torch int4 us"]
    body = []
    for r in rows:
        pct_bf16 = 100 * r.bf16_us / r.us if r.bf16_us else None
        body.append([r.shape, r.m, r.path, r.us, r.tbs, r.pct_copy, r.tflops, _fmt(pct_bf16), _fmt(r.plain_us),
                     _fmt(r.xla_ref_us), _fmt(r.bf16_us), _fmt(r.torch_us)])
    return f"copy bandwidth measured now: {copy_tbs:.2f} TB/s\n" + table(head, body)


# ---------------------------------------------------------------------------------------------------------------
# tile sweep


def _sweep_variants(n: int, k: int, m: int) -> list[qmm.Tiles]:
    T = qmm.Tiles
    if m <= 256:
        # The default first; then the variants the device profile points to (docs/kernels/qmm.md, run 2): half
        # the shared memory a program (one block a step, or two stages) so 544 programs of 5120->17408 fit one
        # wave, and one-warp/8-row tiles for more programs on the small-N shapes.
        return [T(16, 32, 2, 2, 3, 2), T(16, 32, 1, 2, 3, 2), T(16, 32, 1, 2, 4, 2), T(16, 32, 2, 2, 2, 2),
                T(8, 32, 1, 2, 3, 2), T(16, 16, 1, 1, 3, 2), T(8, 16, 1, 1, 4, 2), T(16, 64, 1, 4, 3, 2),
                T(16, 64, 1, 4, 5, 2)]
    return [T(128, 128, 1, 8, 3, 1), T(128, 128, 1, 8, 2, 1), T(128, 64, 1, 4, 3, 1), T(64, 128, 1, 8, 3, 1)]


def _sweep(shapes, ms) -> list[dict]:
    results = []
    for k, n in shapes:
        copies = _copies(n, k)
        ws = _random_weights(n, k, copies)
        for m in ms:
            _, xks = _chunk_xs(m, k, 20)
            best = None
            for t in _sweep_variants(n, k, m):
                try:
                    us = device_us(_kernel_fn(t), lambda i, xks=xks: (xks[i], ws[i % copies]),
                                   _estimate_us(m, n, k))
                except Exception as e:  # noqa: BLE001 -- a variant that does not compile is a result too
                    print(f"  {k}->{n} M={m} {t}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                    results.append(dict(shape=f"{k}->{n}", m=m, tiles=dataclasses.asdict(t), us=None))
                    continue
                gbs = (_weight_bytes(n, k) + 2 * m * (k + n)) / (us * 1e-6) / 1e12
                print(f"  {k}->{n} M={m} bm={t.block_m} bn={t.block_n} bps={t.blocks_per_step} w={t.num_warps} "
                      f"st={t.num_stages} mb={t.max_m_blocks}: {us:.1f} us {gbs:.2f} TB/s", flush=True)
                results.append(dict(shape=f"{k}->{n}", m=m, tiles=dataclasses.asdict(t), us=us))
                if best is None or us < best[0]:
                    best = (us, t)
            if best:
                print(f"BEST {k}->{n} M={m}: {best[0]:.1f} us {best[1]}", flush=True)
    return results


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m pallas_kernels.bench qmm")
    ap.add_argument("--shapes", type=_parse_shapes, default=list(SHAPES), help="K x N list, e.g. 5120x17408")
    ap.add_argument("--m", type=lambda s: [int(v) for v in s.split(",")], default=list(MS))
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--ref-max-m", type=int, default=256, help="largest M to time the fp32 XLA reference at")
    ap.add_argument("--sweep", action="store_true", help="time tile variants instead of the comparison table")
    ap.add_argument("--json", default=None, help="write all results here (rewritten after every row)")
    ap.add_argument("--once", action="store_true", help="run each kernel 3 times untimed (a target for ncu)")
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("qmm bench: needs a GPU (jax.default_backend() is "
              f"{jax.default_backend()!r})", file=sys.stderr)
        return 2
    print(f"device: {jax.devices()[0].device_kind}", flush=True)
    if args.sweep:
        res = _sweep(args.shapes, args.m)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return 0
    if args.once:
        _once(args.shapes, args.m)
        return 0
    copy_tbs = copy_bandwidth_tbs()
    print(f"copy bandwidth: {copy_tbs:.2f} TB/s", flush=True)
    rows: list[Row] = []

    def save(partial):
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(copy_tbs=copy_tbs, rows=[dataclasses.asdict(r) for r in rows + partial]), f,
                          indent=1)

    for k, n in args.shapes:
        rows += _bench_shape(k, n, args.m, copy_tbs, not args.no_torch, args.ref_max_m, on_row=save)
        save([])
    print(_report(rows, copy_tbs))
    return 0


def _once(shapes, ms) -> None:
    """Each shape and M through the kernel a few times, untimed: a target for `ncu`."""
    for k, n in shapes:
        w = _random_weights(n, k, 1)[0]
        for m in ms:
            prompt = m > 256
            tiles = (qmm.prompt_tiles if prompt else qmm.decode_tiles)(n, k, BITS, GROUP)
            _, xks = _chunk_xs(m, k)
            f = jax.jit(_kernel_fn(tiles))
            for i in range(3):
                jax.block_until_ready(f(xks[i % 2], w))
            print(f"ran {k}->{n} M={m} {tiles}", flush=True)
