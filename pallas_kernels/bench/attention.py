"""Attention benchmarks at the 27B shapes (24 query heads, 4 KV heads, head dim 256): the Pallas kernels next to
the plain-XLA references and cuDNN through jax.nn.dot_product_attention (contiguous bf16 K/V, where it applies).

    python -m pallas_kernels.bench attention [--sections decode,window,prompt,write,tune] [--json FILE] [--smoke]
    python -m pallas_kernels.bench attention --sections prompt_mgpu   # Mosaic GPU prompt vs Triton vs cuDNN
    python -m pallas_kernels.bench attention --sections window_mgpu   # Mosaic GPU window pass 1 vs Triton

Times are per call, amortised over a jitted scan of calls that rotate page tables over distinct pages (so small
contexts are not served from L2) and feed every output into a running sum (so no call can be skipped).
--smoke runs every section at toy sizes in interpret mode on the CPU, to check this script, not to time.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import attention as at
from pallas_kernels import attention_mgpu as am
from pallas_kernels import attention_window_mgpu as awm
from pallas_kernels import kv_quant as kq
from pallas_kernels.bench.common import copy_bandwidth_tbs, table, time_us, traced_us

HQ, HKV, D = 24, 4, 256
SCALE = D ** -0.5
ROTATE_BYTES = 256 << 20  # distinct KV bytes touched before a page is reused: several times the 60 MB L2
DEADLINE = math.inf  # time.time() after which remaining measurements are skipped (--budget-s)
JSON_PATH: str | None = None


@dataclasses.dataclass
class Env:
    interpret: bool
    page_size: int
    reps: int
    results: list
    trace: str | None = None  # --trace: where the kernel-alone traces go


def kv_bytes(keys: int, fp8: bool) -> int:
    """Bytes of K and V for `keys` positions over all KV heads (fp8: codes + fp32 scales)."""
    per_key = HKV * (2 * D * (1 if fp8 else 2) + (2 * 4 if fp8 else 0))
    return keys * per_key


def shipped_layout(v_layout: str | None) -> str:
    """An fp8 pool's v layout: `v_layout`, or the one the model's pools take (`kv_quant.FP8_V_LAYOUT`) when None."""
    return kq.FP8_V_LAYOUT if v_layout is None else v_layout


def make_pool(key, num_pages: int, page_size: int, fp8: bool, v_layout: str | None = None) -> kq.KVPool:
    """Random keys and values; fp8 pools quantized, with v in `v_layout` (`kv_quant.KVPool.v_layout`; None: the
    model's)."""
    v_layout = shipped_layout(v_layout)
    shape = (HKV, num_pages, page_size, D)
    k1, k2 = jax.random.split(key)

    @jax.jit
    def build(k1, k2):
        k = jax.random.normal(k1, shape, jnp.float32)
        v = jax.random.normal(k2, shape, jnp.float32)
        if fp8:
            (kc, ks), (vc, vs) = kq.quantize_reference(k), kq.quantize_reference(v)
            return kq.with_v_layout(kq.KVPool(kc, vc, ks, vs), v_layout)
        return kq.KVPool(k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))

    return build(k1, k2)


def page_tables(rng, sets: int, streams: int, pages_per_stream: int) -> np.ndarray:
    """[sets, streams, pages] drawn without repeats from pages 1.. (page 0 is the dummy page)."""
    total = sets * streams * pages_per_stream
    return (rng.permutation(total) + 1).reshape(sets, streams, pages_per_stream).astype(np.int32)


def _chain(step, reps: int):
    """One jitted chain of `reps` calls unrolled in one program: call i takes varying[i % n] with its first element
    (the queries) replaced by call i-1's output, so no call can be merged or skipped, and no host round trip sits
    between calls (built once and reused for every context of a compare case, so a candidate compiles once)."""
    @jax.jit
    def chain(fixed, varying):
        x = varying[0][0]
        for i in range(reps):
            x = step(*fixed, x, *varying[i % len(varying)][1:]).astype(x.dtype)
        return x
    return chain


def amortised_us(env: Env, step, fixed: tuple, varying: list[tuple], *, slow: bool = False) -> float:
    """Median µs per call of `step` in a `_chain` (the launches' gaps included)."""
    reps = max(2, env.reps // 4) if slow else env.reps
    us = time_us(_chain(step, reps), [(fixed, varying)], warmup=2,
                 iters=5 if env.interpret or slow else 10)
    return us / reps


def alone_us(env: Env, step, fixed: tuple, varying: list[tuple], prefix: str, whole: dict | None = None
             ) -> tuple[float, dict[str, float]]:
    """µs per call of `step`'s own kernels (device events named `prefix`...), summed from a jax.profiler trace of
    one `_chain` under env.trace: the kernels alone, without the launch gaps a chain's µs include (NaN when the
    trace has no device events); and the same by kernel name (a name's trailing numbers dropped). whole: as
    `traced_us`'s (every device event of a call, and its span with the gaps)."""
    chain = _chain(step, env.reps)
    return traced_us(lambda: chain(fixed, varying), env.trace, per=env.reps, prefix=prefix, whole=whole)


def record(env: Env, **row) -> None:
    env.results.append(row)
    if JSON_PATH:  # rewritten after every row: a run cut short still leaves what it measured
        with open(JSON_PATH, "w") as f:
            json.dump(env.results, f, indent=1)
    print("  " + ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
          flush=True)


def guarded(fn):
    """One failing configuration must not cost the rest of the run."""
    def run(*a, **k):
        if time.time() > DEADLINE:
            print(f"  skipped {fn.__name__} {k}: over --budget-s", flush=True)
            return None
        try:
            return fn(*a, **k)
        except Exception as e:  # noqa: BLE001 - reported, and the sweep goes on
            print(f"  FAILED {fn.__name__}{a[1:] if len(a) > 1 else ''} {k}: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:300]}", flush=True)
            traceback.print_exc(limit=2, file=sys.stdout)
            return None
    return run


# ---------------------------------------------------------------------------------------------------------------
# window / decode
# ---------------------------------------------------------------------------------------------------------------

def window_inputs(env: Env, *, streams: int, rows: int, context: int, fp8: bool, page_size: int | None = None,
                  v_layout: str | None = None):
    ps = page_size or env.page_size
    pages = -(-context // ps)
    sets = max(1, min(8, ROTATE_BYTES // max(1, kv_bytes(context * streams, fp8))))
    rng = np.random.default_rng(context + streams + rows)
    tables = page_tables(rng, sets, streams, pages)
    pool = make_pool(jax.random.key(1), sets * streams * pages + 1, ps, fp8, v_layout)
    tree = np.array([-1] + [(r - 1) // 2 for r in range(1, rows)], np.int32)  # a binary tree

    def one(i):
        ks = jax.random.split(jax.random.key(100 + i), 3)
        q = jax.random.normal(ks[0], (streams, rows, HQ, D), jnp.bfloat16)
        kw = jax.random.normal(ks[1], (streams, rows, HKV, D), jnp.bfloat16)
        vw = jax.random.normal(ks[2], (streams, rows, HKV, D), jnp.bfloat16)
        par = jnp.asarray(np.broadcast_to(tree, (streams, rows)))
        return (q, kw, vw, par, jnp.asarray(tables[i]), jnp.full((streams,), context, jnp.int32))

    return pool, [one(i) for i in range(sets)]


def _window_step(tiles):
    def step(pool, q, kw, vw, par, table, cache_len):
        return at.window(q, kw, vw, par, pool, table, cache_len, scale=SCALE, tiles=tiles)
    return step


def _window_interp_step(tiles):
    def step(pool, q, kw, vw, par, table, cache_len):
        return at.window(q, kw, vw, par, pool, table, cache_len, scale=SCALE, tiles=tiles, interpret=True)
    return step


def _window_ref_step(pool, q, kw, vw, par, table, cache_len):
    return at.window_reference(q, kw, vw, par, pool, table, cache_len, scale=SCALE)


@guarded
def bench_window(env: Env, *, streams: int, rows: int, context: int, fp8: bool, impls=("kernel", "xla"),
                 tiles: at.WindowTiles | None = None, page_size: int | None = None, tag: str = "",
                 v_layout: str | None = None):
    tiles = tiles or at.WindowTiles()
    pool, varying = window_inputs(env, streams=streams, rows=rows, context=context, fp8=fp8, page_size=page_size,
                                  v_layout=v_layout)
    nbytes = kv_bytes(context * streams, fp8)
    out = {}
    for impl in impls:
        if impl == "kernel":
            step = _window_interp_step(tiles) if env.interpret else _window_step(tiles)
        elif impl == "xla":
            step = _window_ref_step
        else:
            continue
        us = amortised_us(env, step, (pool,), varying)
        out[impl] = us
        extra = {}
        if env.trace and impl == "kernel":
            whole = {}
            extra["alone_us"], by_name = alone_us(env, step, (pool,), varying, "attn_", whole)
            extra.update({f"traced_{k}": v for k, v in whole.items()})  # every kernel of a call; with its gaps
            extra.update({f"alone_{name.removeprefix('attn_window_')}": us for name, us in sorted(by_name.items())})
        record(env, section="window" if rows > 1 else "decode", tag=tag, impl=impl, kv="fp8" if fp8 else "bf16",
               streams=streams, rows=rows, context=context, page=page_size or env.page_size,
               tiles=str(dataclasses.astuple(tiles)) if impl == "kernel" else "", us=us,
               kv_gbs=nbytes / us / 1e3, **extra)
    del pool
    return out


def bench_window_with(flag: str, value, env: Env, **kw):
    """`bench_window` with `attention_window_mgpu.<flag>` (a module flag read when the chain is traced) set to
    `value` for the call, then restored."""
    old = getattr(awm, flag)
    setattr(awm, flag, value)
    try:
        return bench_window(env, **kw)
    finally:
        setattr(awm, flag, old)


@guarded
def bench_cudnn_decode(env: Env, *, streams: int, rows: int, context: int):
    """cuDNN over contiguous bf16 K/V of the same context (no paging, no tree mask: a lower bound on its work)."""
    sets = max(1, min(8, ROTATE_BYTES // kv_bytes(context * streams, False)))
    keys = jax.random.split(jax.random.key(7), 3 * sets)
    varying = [(jax.random.normal(keys[3 * i], (streams, rows, HQ, D), jnp.bfloat16),
                jax.random.normal(keys[3 * i + 1], (streams, context + rows, HKV, D), jnp.bfloat16),
                jax.random.normal(keys[3 * i + 2], (streams, context + rows, HKV, D), jnp.bfloat16))
               for i in range(sets)]

    def step(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=SCALE, implementation="cudnn")

    us = amortised_us(env, step, (), varying)
    record(env, section="window" if rows > 1 else "decode", tag="", impl="cudnn", kv="bf16", streams=streams,
           rows=rows, context=context, page=0, tiles="", us=us, kv_gbs=kv_bytes(context * streams, False) / us / 1e3)
    return us


# ---------------------------------------------------------------------------------------------------------------
# prompt
# ---------------------------------------------------------------------------------------------------------------

def prompt_flops(rows: int, prefix: int) -> float:
    return 4.0 * HQ * D * (rows * prefix + rows * (rows + 1) / 2)


@guarded
def bench_prompt(env: Env, *, rows: int, prefix: int, fp8: bool, impls=("kernel", "xla"),
                 tiles: at.PromptTiles | None = None, tag: str = "", mgpu_tiles: am.PromptMgpuTiles | None = None,
                 v_layout: str | None = None):
    """impls: "kernel" (attention.prompt with `tiles`), "mgpu" (attention_mgpu.prompt_mgpu with `mgpu_tiles`),
    "xla" (the jnp reference). Each call includes the contiguous copy of the stream's keys. v_layout: an fp8
    pool's (`kv_quant.KVPool.v_layout`)."""
    tiles = tiles or at.PromptTiles()
    mgpu_tiles = mgpu_tiles or am.PromptMgpuTiles()
    v_layout = shipped_layout(v_layout)
    ps = env.page_size
    pages = -(-(prefix + rows) // ps)
    sets = 2
    rng = np.random.default_rng(prefix + rows)
    tables = page_tables(rng, sets, 1, pages)
    pool = make_pool(jax.random.key(2), sets * pages + 1, ps, fp8, v_layout)
    varying = [(jax.random.normal(jax.random.key(200 + i), (1, rows, HQ, D), jnp.bfloat16), jnp.asarray(tables[i]),
                jnp.asarray([prefix], jnp.int32), jnp.asarray([rows], jnp.int32)) for i in range(sets)]
    flops = prompt_flops(rows, prefix)
    out = {}
    for impl in impls:
        if impl == "kernel":
            def step(pool, q, table, start, lengths):
                return at.prompt(q, pool, table, start, lengths, scale=SCALE, tiles=tiles, interpret=env.interpret)
        elif impl == "mgpu":
            def step(pool, q, table, start, lengths):
                return am.prompt_mgpu(q, pool, table, start, lengths, scale=SCALE, tiles=mgpu_tiles,
                                      interpret=env.interpret)
        else:
            def step(pool, q, table, start, lengths):
                return at.prompt_reference(q, pool, table, start, lengths, scale=SCALE)
        us = amortised_us(env, step, (pool,), varying, slow=True)
        out[impl] = us
        record(env, section="prompt", tag=tag, impl=impl, kv=f"fp8 v {v_layout}" if fp8 else "bf16", rows=rows,
               prefix=prefix,
               tiles={"kernel": str(dataclasses.astuple(tiles)), "mgpu": str(dataclasses.astuple(mgpu_tiles))}.get(
                   impl, ""), us=us, tflops=flops / us / 1e6)
    del pool
    return out


@guarded
def bench_cudnn_prompt(env: Env, *, rows: int, prefix: int):
    """cuDNN causal over contiguous bf16 K/V. With a prefix the causal mask is bottom-right aligned, which
    jax.nn.dot_product_attention does not offer: then this times the prefix block (no mask) and the diagonal
    block (causal) as two calls, the work a single bottom-right causal call would do, without the merge."""
    keys = jax.random.split(jax.random.key(9), 6)
    q = jax.random.normal(keys[0], (1, rows, HQ, D), jnp.bfloat16)
    kc = jax.random.normal(keys[1], (1, rows, HKV, D), jnp.bfloat16)
    vc = jax.random.normal(keys[2], (1, rows, HKV, D), jnp.bfloat16)
    kp = jax.random.normal(keys[3], (1, max(prefix, 1), HKV, D), jnp.bfloat16)
    vp = jax.random.normal(keys[4], (1, max(prefix, 1), HKV, D), jnp.bfloat16)

    def step(q, kc, vc, kp, vp):
        out = jax.nn.dot_product_attention(q, kc, vc, scale=SCALE, is_causal=True, implementation="cudnn")
        if prefix:
            out = out + jax.nn.dot_product_attention(q, kp, vp, scale=SCALE, implementation="cudnn")
        return out

    us = amortised_us(env, step, (), [(q, kc, vc, kp, vp)], slow=True)
    record(env, section="prompt", tag="", impl="cudnn", kv="bf16", rows=rows, prefix=prefix, tiles="", us=us,
           tflops=prompt_flops(rows, prefix) / us / 1e6)


# Mosaic GPU prompt kernel (attention_mgpu) beside the shipped Triton prompt and cuDNN. Variants: launch choices
# (same bits as the default) and 128-key blocks (order).
MGPU_VARIANTS = (
    ("64-row CTAs, 3 stages (launch)", am.PromptMgpuTiles(block_q=64, stages=3)),
    ("128-key blocks, 1 stage (order)", am.PromptMgpuTiles(block_k=128, stages=1)),
)


def run_prompt_mgpu(env: Env, *, smoke: bool, variants: bool) -> None:
    """One 4K-row bf16 chunk after 0 and 32K cached keys (smoke: 128 rows after 0 and 40): cuDNN, the shipped
    Triton prompt, prompt_mgpu (and its variants), each timed the same way (the prompt kernels include their
    contiguous copy of the stream's keys, as the engine runs them)."""
    rows, prefixes = (128, (0, 40)) if smoke else (4096, (0, 32768))
    shipped = at.prompt_tiles(page_size=env.page_size, max_keys=rows + prefixes[-1], head_dim=D, fp8=False)
    print(f"== prompt_mgpu: {rows} rows after {prefixes}, bf16 and fp8 pools", flush=True)
    for prefix in prefixes:
        if not smoke:
            bench_cudnn_prompt(env, rows=rows, prefix=prefix)
        for fp8 in (False, True):
            bench_prompt(env, rows=rows, prefix=prefix, fp8=fp8, impls=("kernel", "mgpu"), tiles=shipped,
                         tag="prompt_mgpu")
        for name, tiles in MGPU_VARIANTS if variants else ():
            bench_prompt(env, rows=rows, prefix=prefix, fp8=False, impls=("mgpu",), mgpu_tiles=tiles,
                         tag=f"prompt_mgpu {name}")


def summarize_prompt_mgpu(env: Env) -> None:
    rows = [r for r in env.results if r.get("section") == "prompt" and r.get("tag", "").startswith("prompt_mgpu")]
    if not rows:
        return
    cudnn = {r["prefix"]: r["us"] for r in env.results if r.get("section") == "prompt" and r.get("impl") == "cudnn"}
    print("\n### prompt_mgpu: prompt chunk (µs, TFLOP/s causal-halved, cuDNN's bf16 time / ours: target >= 0.8)")
    body = []
    for r in rows:
        name = {"kernel": "Triton", "mgpu": "mgpu"}[r["impl"]] + r["tag"][len("prompt_mgpu"):]
        body.append([name, r["kv"], r["prefix"], r["us"], r["tflops"],
                     cudnn[r["prefix"]] / r["us"] if r["prefix"] in cudnn else math.nan])
    body += [["cuDNN", "bf16", p, us, prompt_flops(rows[0]["rows"], p) / us / 1e6, 1.0] for p, us in cudnn.items()]
    print(table(["impl", "kv", "prefix", "us", "TFLOP/s", "x cuDNN"], body))


def _by_kernel(r: dict) -> str:
    """A window row's kernels alone, "pass 1 / fold / merge" µs (a trace name may carry a suffix: pass 1's is
    "chunks_mgpu_mosaic_gpu_kernel")."""
    sums = [[v for k, v in r.items() if k.startswith(f"alone_{n}")] for n in ("chunks", "fold", "merge")]
    return "/".join(f"{sum(v) if v else math.nan:.1f}" for v in sums)


def _tagged(env: Env, prefix: str):
    """The window rows whose tag starts with `prefix` -> (the timing key: "alone_us" when every row has one, else
    "us"; the rows by (tag, streams, context, rows); how that key times a call), or None without such rows."""
    rows = [r for r in env.results if r.get("tag", "").startswith(prefix)]
    if not rows:
        return None
    key = "alone_us" if all("alone_us" in r for r in rows) else "us"
    how = "of the kernels alone (trace)" if key == "alone_us" else "a chained call"
    return key, {(r["tag"], r["streams"], r["context"], r["rows"]): r for r in rows}, how


def _pct_copy(context: int, streams: int, us: float, bw: float | None, fp8: bool = False) -> float:
    """% of the copy bandwidth a window over `context` keys a stream (bf16 or fp8 pool) moves its keys at in `us`
    µs."""
    return 100 * kv_bytes(context * streams, fp8) / (us * 1e-6) / (bw * 1e12) if bw else math.nan


WINDOW_MGPU_CHUNKS = (512, 1024, 2048)
WINDOW_MGPU_VARIANTS = ("", " split", " ping-pong")  # 16-row windows: as shipped, row_block 64, PING_PONG


def summarize_window_mgpu_variants(env: Env, bw: float | None) -> None:
    if not (got := _tagged(env, "wmv ")):
        return
    key, us, how = got
    print(f"\n### window_mgpu_variants: bf16, µs {how}; 16-row / 1-row target <= 1.3 (split: a CTA a warpgroup; "
          f"ping-pong: two warpgroups taking turns); copy {bw or math.nan:.2f} TB/s; by kernel: pass 1 / fold / merge")
    body = []
    for streams, ctx in dict.fromkeys(k[1:3] for k in us):
        for chunk in WINDOW_MGPU_CHUNKS:
            one = us.get((f"wmv {chunk}", streams, ctx, 1))
            if one is None:
                continue
            cells = [streams, ctx, chunk, one[key], _pct_copy(ctx, streams, one[key], bw), _by_kernel(one)]
            for variant in WINDOW_MGPU_VARIANTS:
                r16 = us.get((f"wmv {chunk}{variant}", streams, ctx, 16))
                cells += [r16[key], r16[key] / one[key], _by_kernel(r16)] if r16 else [math.nan, math.nan, ""]
            body.append(cells)
    heads = ["streams", "context", "chunk", "1-row", "% copy", "by kernel"]
    for variant in WINDOW_MGPU_VARIANTS:
        heads += [f"16-row{variant}", "ratio", "by kernel"]
    print(table(heads, body))


# The tail's launch choices timed by merge_variants (each a `WindowTiles` override; none changes a row's bits):
# the merge's and the fold pass's head-dim columns a program, their warps and the partials a merge loop step loads.
MERGE_VARIANTS = (("rule", {}), ("rows whole", dict(merge_block_rows=128)), ("rows 32", dict(merge_block_rows=32)),
                  ("fold pass", dict(fold_in_merge=False)), ("fused", dict(fold_in_merge=True)),
                  ("warps 8", dict(merge_num_warps=8)),
                  ("warps 8, unroll 2", dict(merge_num_warps=8, merge_unroll=2)),
                  ("unroll 2", dict(merge_unroll=2)), ("unroll 4", dict(merge_unroll=4)),
                  ("fold bd 32", dict(fold_block_d=32)), ("fold bd 16", dict(fold_block_d=16)),
                  ("fold bd 32, warps 8", dict(fold_block_d=32, merge_num_warps=8)),
                  ("merge bd 128, warps 8", dict(merge_block_d=128, merge_num_warps=8)))


def summarize_merge_variants(env: Env) -> None:
    if not (got := _tagged(env, "merge ")):
        return
    key, us, how = got
    print(f"\n### merge_variants: bf16 16-row windows, µs {how} by the tail's launch choices (same bits); cells: "
          "window, its fold pass / merge alone, ratio to the 1-row window")
    body = []
    windows = list(dict.fromkeys(k[1:3] for k in us))
    for label, _ in MERGE_VARIANTS:
        cells = [label]
        for streams, ctx in windows:
            one, r16 = us.get(("merge 1-row", streams, ctx, 1)), us.get((f"merge {label}", streams, ctx, 16))
            if r16 is None:
                cells += ["", math.nan]
                continue
            cells += [f"{r16[key]:.1f} ({r16.get('alone_fold', math.nan):.1f} / {r16.get('alone_merge', math.nan):.1f})",
                      r16[key] / one[key] if one else math.nan]
        body.append(cells)
    heads = ["variant"]
    for streams, ctx in windows:
        one = us.get(("merge 1-row", streams, ctx, 1))
        heads += [f"{streams} x {ctx} (1-row {one[key] if one else math.nan:.1f})", "ratio"]
    print(table(heads, body))


PARTIALS_DTYPES = ("float32", "bfloat16")  # `WindowTiles.partials` timed by window_partials


def _ratio_table(env: Env, bw: float | None, prefix: str, variants: tuple[str, ...], title: str, *,
                 fp8: bool = False) -> None:
    """The window rows tagged f"{prefix}{variant}" as one table: per variant the 1-row µs, its % of the copy
    bandwidth (the pool's bytes), its pass 1 / fold / merge split, the 16-row µs, the ratio and its split. title:
    the heading, with "{how}" for how the rows were timed."""
    if not (got := _tagged(env, prefix)):
        return
    key, us, how = got
    print("\n### " + title.format(how=how))
    body = []
    for streams, ctx in dict.fromkeys(k[1:3] for k in us):
        cells = [streams, ctx]
        for variant in variants:
            one, r16 = (us.get((f"{prefix}{variant}", streams, ctx, rows)) for rows in (1, 16))
            cells += [one[key] if one else math.nan, _pct_copy(ctx, streams, one[key], bw, fp8) if one else math.nan,
                      _by_kernel(one) if one else "", r16[key] if r16 else math.nan,
                      r16[key] / one[key] if one and r16 else math.nan, _by_kernel(r16) if r16 else ""]
        body.append(cells)
    heads = ["streams", "context"]
    for variant in variants:
        heads += [f"{variant} 1-row", "% copy", "by kernel", "16-row", "ratio", "by kernel"]
    print(table(heads, body))


def summarize_window_partials(env: Env, bw: float | None) -> None:
    _ratio_table(env, bw, "wpd ", PARTIALS_DTYPES,
                 "window_partials: bf16 pool, Mosaic GPU pass 1, µs {how} by the O partials' dtype; 16-row / 1-row "
                 f"target <= 1.3; copy {bw or math.nan:.2f} TB/s; by kernel: pass 1 / fold / merge")


# window_fp8's pass 1 variants: the shipped Triton one (f16 dots); "mgpu e4m3", the Mosaic GPU one over V
# key-major with both MMAs on the e4m3 codes (its own order), at its default K/V stages and at 4 ("deep": an e4m3
# block is half a bf16 one's bytes, so 4 stages fit two compute warpgroups, against the 3 and 2 `stages_for` gives
# one and two; the most that every window of the model fits, as `unsupported` asks; a launch choice, the same
# bits); and the Mosaic GPU one over V by rows (dequantizing).
# Session 26 last timed the Triton pass 1 with bf16 dots and FP8_SPLIT, both slower (BENCHMARKS.md).
FP8_VARIANTS = ("triton", "mgpu e4m3", "mgpu e4m3 deep", "mgpu")
FP8_VARIANT_LAYOUT = {"mgpu": "rows", "mgpu e4m3": "keys", "mgpu e4m3 deep": "keys"}  # else the model's
E4M3_DEEP_STAGES = 4  # K/V stages (`attention_window_mgpu.smem_bytes`: 5 fit one compute warpgroup, 4 two)


def summarize_window_fp8(env: Env, bw: float | None) -> None:
    _ratio_table(env, bw, "wf8 ", FP8_VARIANTS,
                 "window_fp8: fp8 pool, µs {how}, Triton pass 1 (shipped) against the Mosaic GPU one; 1-row % of "
                 f"the {bw or math.nan:.2f} TB/s copy over fp8 bytes (target 80 % at >= 32K); 16-row / 1-row "
                 "target <= 1.3", fp8=True)


# v_layout's fp8 pass 1s: (name, `KVPool.v_layout`, changes to the shipped tiles; "keys chunk max" ships since
# session 36). The chunk max's bits are not the block max's (order): `WindowTiles.fp8_v_max` "chunk", and that with
# 64-key blocks (offline sm_90: 400 SASS instructions a 32
# keys against 495 at 32-key blocks, 139 registers against 128).
V_VARIANTS = (("rows", "rows", dict(fp8_v_max="block")), ("keys", "keys", dict(fp8_v_max="block")),
              ("keys chunk max", "keys", dict(fp8_v_max="chunk")),
              ("keys chunk max bk64", "keys", dict(fp8_v_max="chunk", block_k=64)))


def summarize_v_layout(env: Env, bw: float | None) -> None:
    _ratio_table(env, bw, "vl ", tuple(name for name, _, _ in V_VARIANTS),
                 "v_layout: fp8 pool, the shipped pass 1, µs {how}: v by rows, key-major "
                 "(`KVPool.v_layout`), and key-major with V's scales relative to the chunk's max "
                 f"(`WindowTiles.fp8_v_max`; shipped); 1-row % of the {bw or math.nan:.2f} TB/s copy over fp8 bytes; "
                 "16-row / 1-row target <= 1.3", fp8=True)


# decode_sweep: the fp8 pool's 1-row decode (Triton pass 1) under candidate tiles, one stream, kernels alone, split
# pass 1 / fold / merge. "launch" rows keep the shipped bits; "order" rows would change them once.
FP8_DECODE_SWEEP = (
    ("stages 3 (launch)", dict(num_stages=3)),
    ("stages 4 (launch)", dict(num_stages=4)),
    ("stages 6 (launch)", dict(num_stages=6)),
    ("8 warps (order)", dict(num_warps=8)),
    ("block_k 64 (order)", dict(block_k=64)),
    ("chunk 1024 (order)", dict(chunk=1024)),
    ("chunk 256 (order)", dict(chunk=256)),
    ("fold 4 (order)", dict(fold=4)),
    ("fold 16 (order)", dict(fold=16)),
    ("tickets tail (order)", dict(tail="tickets")),
)


# decode_sweep's tails: (label, WindowTiles change); launch choices (the same bits).
TAIL_SWEEP = (("shipped", {}), ("fold pass + merge", dict(fold_in_merge=False)), ("fused", dict(fold_in_merge=True)))


# merge_loads: the merge's loads (same bits): the shipped rule, the loop merge, and the early merge under other
# launches (1 stream, 32K keys only: the forced early merge holds the whole table's partials in registers).
MERGE_LOADS_SWEEP = (("shipped", {}), ("loop loads", dict(merge_loads="loop")))
MERGE_EARLY_LAUNCHES = (("early, 8 warps", dict(merge_loads="early", merge_num_warps=8)),
                        ("loop, fold pass", dict(merge_loads="loop", fold_in_merge=False)),
                        ("early, fold pass", dict(merge_loads="early", fold_in_merge=False)))


def summarize_decode_sweep(env: Env, bw: float | None) -> None:
    rows = [r for r in env.results if r.get("tag", "").startswith("sweep ")]
    if not rows:
        return
    key = "alone_us" if all("alone_us" in r for r in rows) else "us"
    print(f"\n### decode_sweep: 1-row decode, µs {'of the kernels alone (trace)' if key == 'alone_us' else 'chained'}; "
          f"% of the {bw or math.nan:.2f} TB/s copy; by kernel: pass 1 / fold / merge; every device event of a "
          f"call (the XLA ops around the kernels too)")
    body = [[r["tag"].removeprefix("sweep "), r["kv"], r["streams"], r["context"], r[key],
             _pct_copy(r["context"], r["streams"], r[key], bw, r["kv"] == "fp8"), _by_kernel(r),
             r.get("traced_busy_us", math.nan)] for r in rows]
    print(table(["tiles", "kv", "streams", "context", "µs", "% copy", "by kernel", "all events"], body))


def summarize_window_mgpu(env: Env, bw: float | None) -> None:
    rows = [r for r in env.results if r.get("tag", "").startswith("window_mgpu")]
    if not rows:
        return
    alone = all("alone_us" in r for r in rows)
    us = {(r["tag"].split()[1], r["streams"], r["context"], r["rows"]): r["alone_us" if alone else "us"]
          for r in rows}
    print(f"\n### window_mgpu: bf16 windows, µs {'of the kernels alone (trace)' if alone else 'a chained call'} "
          f"(1-row: % of the {bw or math.nan:.2f} TB/s copy, target 80 % at >= 32K; 16-row / 1-row: target <= 1.3)")
    body = []
    for streams, ctx in dict.fromkeys((r["streams"], r["context"]) for r in rows):
        cells = [streams, ctx]
        for impl in ("triton", "mgpu"):
            one, sixteen = us.get((impl, streams, ctx, 1), math.nan), us.get((impl, streams, ctx, 16), math.nan)
            pct = 100 * kv_bytes(ctx * streams, False) / (one * 1e-6) / (bw * 1e12) if bw else math.nan
            cells += [one, pct, sixteen, sixteen / one]
        body.append(cells)
    print(table(["streams", "context", "triton 1-row", "% copy", "triton 16-row", "ratio", "mgpu 1-row", "% copy",
                 "mgpu 16-row", "ratio"], body))


# ---------------------------------------------------------------------------------------------------------------
# write
# ---------------------------------------------------------------------------------------------------------------

@guarded
def bench_write(env: Env, *, streams: int, rows: int, fp8: bool, v_layout: str | None = None):
    v_layout = shipped_layout(v_layout)
    ps = env.page_size
    pages = -(-rows // ps) + 1
    rng = np.random.default_rng(rows)
    tables = page_tables(rng, 1, streams, pages)[0]
    pool = make_pool(jax.random.key(3), streams * pages + 1, ps, fp8, v_layout)
    k = jax.random.normal(jax.random.key(4), (streams, rows, HKV, D), jnp.bfloat16)
    v = jax.random.normal(jax.random.key(5), (streams, rows, HKV, D), jnp.bfloat16)
    positions = jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32) + 5, (streams, rows))
    valid = jnp.ones((streams, rows), bool)
    for impl, fn in (("kernel", lambda *a: kq.write(*a, interpret=env.interpret)), ("xla", kq.write_reference)):
        step = jax.jit(fn, donate_argnums=0)
        # The pool is donated and comes back: time the in-place update the engine will see.
        state = {"pool": pool}

        def call(k, v, table, positions, valid):
            state["pool"] = step(state["pool"], k, v, table, positions, valid)
            return state["pool"].k

        us = time_us(call, [(k, v, jnp.asarray(tables), positions, valid)], warmup=2, iters=10)
        pool = state["pool"]
        record(env, section="write", tag="", impl=impl, kv=f"fp8 v {v_layout}" if fp8 else "bf16", streams=streams,
               rows=rows, us=us)


# ---------------------------------------------------------------------------------------------------------------
# compare: the shipped tiles against a few candidates, next to cuDNN and the copy bandwidth, in one short run
# ---------------------------------------------------------------------------------------------------------------

# (name, tiles). "order" candidates change a row's reduction order (chunk, fp8_dot, prompt block_k): a new default
# from them is a one-time change of bits for every model; "launch" ones (walk, block_q, warps, stages) never do.
DECODE_COMPARE = (
    # The merge as shipped until session 7: one pass folding every chunk in sequence (no table here has 1024).
    ("one-pass merge (fold 1024)", at.WindowTiles(fold=1024)),
    ("fold 16 (order)", at.WindowTiles(fold=16)),
    ("page walk (launch)", at.WindowTiles(walk="page")),
    # Twice the chunk programs at one stream; the fold pass takes the longer chunk list.
    ("chunk256 (order)", at.WindowTiles(chunk=256)),
    # Half the chunk programs: at 32K one stream has 64 chunks x 4 KV heads = 256 programs for 132 SMs.
    ("chunk1024 (order)", at.WindowTiles(chunk=1024)),
    # Fold and merge in pass 1's tail by atomic tickets: one launch instead of three (pass 1 alone was 37 of the
    # 55 µs of kernels at 32K under Nsight Compute, session 9).
    ("tickets tail (order)", at.WindowTiles(tail="tickets")),
)
DECODE_COMPARE_FP8 = (
    ("bf16 dot (order)", at.WindowTiles(fp8_dot="bfloat16")),
    ("chunk1024 (order)", at.WindowTiles(fp8_dot="float16", row_block=32, chunk=1024)),
    ("tickets tail (order)", at.WindowTiles(fp8_dot="float16", row_block=32, tail="tickets")),
    ("bf16 dot, page walk, one pass (session 6)", at.WindowTiles(fp8_dot="bfloat16", walk="page", fold=1024)),
)
PROMPT_COMPARE = (
    # The shipped prompt copies the whole table (the capacity) into contiguous K/V on every call; this reads pages.
    ("paged reads (launch)", at.PromptTiles(contiguous=False)),
    # Offline compile (Triton 3.6, sm_90): the shipped 64x64 tile on 4 warps uses 255 registers and spills 820 B;
    # these three do not spill.
    ("8 warps (launch)", at.PromptTiles(num_warps=8)),
    ("k32 8 warps 3 stages (order)", at.PromptTiles(block_k=32, num_warps=8, num_stages=3)),
    ("q32 (launch)", at.PromptTiles(block_q=32)),
)
PROMPT_COMPARE_FP8 = (
    ("f16 dot (order)", at.PromptTiles(fp8_dot="float16")),
    ("k32 8 warps 3 stages (order)", at.PromptTiles(block_k=32, num_warps=8, num_stages=3)),
)


def _rel_diff(out, ref) -> float:
    """|out - ref| / |ref| over a chain's final output: a sanity check that a candidate computes the same thing as
    the shipped tiles (rounding differences stay near 1e-3; a broken kernel shows O(1) or NaN)."""
    if ref is None:
        return math.nan
    a, b = np.asarray(out.astype(jnp.float32), np.float64), np.asarray(ref.astype(jnp.float32), np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@guarded
def compare_decode(env: Env, *, contexts, capacity: int, fp8: bool, candidates, bw: float | None):
    """1 row, 1 stream, at each live context, with the page table as wide as `capacity` (the engine's fixed
    table width: one compile per candidate, and the empty chunk programs past the context are paid as in the
    engine)."""
    ps = env.page_size
    pmax = capacity // ps
    sets = 8 if not env.interpret else 2
    rng = np.random.default_rng(5)
    pool = make_pool(jax.random.key(11), pmax + 1, ps, fp8)
    tables = [jnp.asarray(rng.permutation(pmax)[None, :] + 1, jnp.int32) for _ in range(sets)]
    keys = jax.random.split(jax.random.key(12), 3 * sets)
    qkv = [(jax.random.normal(keys[3 * i], (1, 1, HQ, D), jnp.bfloat16),
            jax.random.normal(keys[3 * i + 1], (1, 1, HKV, D), jnp.bfloat16),
            jax.random.normal(keys[3 * i + 2], (1, 1, HKV, D), jnp.bfloat16)) for i in range(sets)]
    par = jnp.full((1, 1), -1, jnp.int32)
    kv = "fp8" if fp8 else "bf16"
    shipped = candidates[0][1]

    def pass_one(pool, q, kw, vw, par, table, cache_len):
        _, _, acc = at.window_partials(q, pool, table, cache_len, scale=SCALE, tiles=shipped, interpret=env.interpret)
        return q + acc[0, 0, 0, 0, 0].astype(q.dtype)  # chunk 0, row 0: written whenever the context is non-empty

    def floor(pool, q, kw, vw, par, table, cache_len):
        return q + 1

    # (name, step, tiles, whether its output is the window's: compared with the shipped output)
    steps = [(name, (_window_interp_step if env.interpret else _window_step)(tiles), tiles, True)
             for name, tiles in candidates]
    steps += [("shipped, pass 1 only", pass_one, shipped, False), ("timing floor (q + 1)", floor, None, False)]
    shipped_out = {}
    for name, step, tiles, same_output in steps:
        if time.time() > DEADLINE:
            print(f"  skipped decode {kv} {name}: over --budget-s", flush=True)
            continue
        chain = _chain(step, env.reps)
        for ctx in contexts:
            varying = [(q, kw, vw, par, tables[i], jnp.full((1,), ctx, jnp.int32))
                       for i, (q, kw, vw) in enumerate(qkv)]
            try:
                us = time_us(chain, [((pool,), varying)], warmup=2, iters=5 if env.interpret else 10) / env.reps
                out = chain((pool,), varying)
            except Exception as e:  # noqa: BLE001 - one candidate failing must not cost the others
                print(f"  FAILED decode {kv} {name} {ctx}: {type(e).__name__}: {str(e).splitlines()[0][:300]}",
                      flush=True)
                break
            if name == "shipped":
                shipped_out[ctx] = out
            gbs = kv_bytes(ctx, fp8) / us / 1e3
            record(env, section="compare-decode", tag=name, impl="kernel", kv=kv, streams=1, rows=1, context=ctx,
                   capacity=capacity, page=ps, tiles=str(tiles), us=us, kv_gbs=gbs,
                   of_copy=gbs / (bw * 1e3) if bw else math.nan,
                   rel_diff_vs_shipped=_rel_diff(out, shipped_out.get(ctx)) if same_output else math.nan)
    del pool


@guarded
def compare_prompt(env: Env, *, rows: int, prefixes, capacity: int, fp8: bool, candidates):
    """One prompt chunk of `rows` rows after each prefix, the page table as wide as `capacity` (the engine's fixed
    width: one compile per candidate, and the contiguous copy moves the whole table, as it does in the engine)."""
    ps = env.page_size
    pmax = capacity // ps
    rng = np.random.default_rng(6)
    pool = make_pool(jax.random.key(13), pmax + 1, ps, fp8)
    tables = [jnp.asarray(rng.permutation(pmax)[None, :] + 1, jnp.int32) for _ in range(2)]
    qs = [jax.random.normal(jax.random.key(210 + i), (1, rows, HQ, D), jnp.bfloat16) for i in range(2)]
    kv = "fp8" if fp8 else "bf16"
    reps = max(2, env.reps // 4)
    shipped_out = {}
    for name, tiles in candidates:
        if time.time() > DEADLINE:
            print(f"  skipped prompt {kv} {name}: over --budget-s", flush=True)
            continue

        def step(pool, q, table, start, lengths, tiles=tiles):
            return at.prompt(q, pool, table, start, lengths, scale=SCALE, tiles=tiles, interpret=env.interpret)
        chain = _chain(step, reps)
        for prefix in prefixes:
            varying = [(qs[i], tables[i], jnp.asarray([prefix], jnp.int32), jnp.asarray([rows], jnp.int32))
                       for i in range(2)]
            try:
                us = time_us(chain, [((pool,), varying)], warmup=2, iters=5) / reps
                out = chain((pool,), varying)
            except Exception as e:  # noqa: BLE001
                print(f"  FAILED prompt {kv} {name} {prefix}: {type(e).__name__}: {str(e).splitlines()[0][:300]}",
                      flush=True)
                break
            if name == "shipped":
                shipped_out[prefix] = out
            record(env, section="compare-prompt", tag=name, impl="kernel", kv=kv, rows=rows, prefix=prefix,
                   capacity=capacity, tiles=str(tiles), us=us, tflops=prompt_flops(rows, prefix) / us / 1e6,
                   rel_diff_vs_shipped=_rel_diff(out, shipped_out.get(prefix)))
    del pool


def run_compare(env: Env, *, smoke: bool, bw: float | None) -> None:
    """The shipped tiles (window_tiles / prompt_tiles at the engine's layout) against the candidates above, 1-row
    1-stream decode at 4K/32K/128K (bf16 and fp8) and a 4K-row prompt chunk after 0 and 32K keys, next to cuDNN.
    Every case uses a page table for 128K keys (the engine's table width is its max length)."""
    contexts, capacity = ((64, 256), 256) if smoke else ((4096, 32768, 131072), 131072)
    rows, prefixes = (32, (0, 40)) if smoke else (4096, (0, 32768))
    ps = env.page_size
    for fp8 in (False, True):
        shipped = at.window_tiles(page_size=ps, max_keys=capacity, head_dim=D, fp8=fp8)
        extra = DECODE_COMPARE_FP8 if fp8 else DECODE_COMPARE
        print(f"== compare decode {'fp8' if fp8 else 'bf16'}: 1 row, 1 stream, table for {capacity} keys", flush=True)
        compare_decode(env, contexts=contexts, capacity=capacity, fp8=fp8, candidates=(("shipped", shipped),) + extra,
                       bw=bw)
    if not smoke:
        for ctx in contexts:
            bench_cudnn_decode(env, streams=1, rows=1, context=ctx)
        for prefix in prefixes:
            bench_cudnn_prompt(env, rows=rows, prefix=prefix)
    for fp8 in (False, True):
        shipped = at.prompt_tiles(page_size=ps, max_keys=capacity, head_dim=D, fp8=fp8)
        extra = PROMPT_COMPARE_FP8 if fp8 else PROMPT_COMPARE
        print(f"== compare prompt {'fp8' if fp8 else 'bf16'}: {rows} rows after {prefixes}, table for {capacity} keys",
              flush=True)
        compare_prompt(env, rows=rows, prefixes=prefixes, capacity=capacity, fp8=fp8,
                       candidates=(("shipped", shipped),) + extra)


def summarize_compare(env: Env, bw: float | None) -> None:
    rows = env.results
    dec = [r for r in rows if r.get("section") == "compare-decode"]
    cudnn = {r["context"]: r["us"] for r in rows if r.get("section") == "decode" and r.get("impl") == "cudnn"}
    if dec:
        contexts = sorted({r["context"] for r in dec})
        print(f"\n### compare: 1-row decode, 1 stream (µs; % of the {bw or math.nan:.2f} TB/s copy; target 80 %)")
        body = []
        for kv in ("bf16", "fp8"):
            for name in dict.fromkeys(r["tag"] for r in dec if r["kv"] == kv):
                cells = []
                for ctx in contexts:
                    got = [r for r in dec if r["kv"] == kv and r["tag"] == name and r["context"] == ctx]
                    cells.append(f"{got[0]['us']:.1f} ({100 * got[0]['of_copy']:.0f}%)" if got else "-")
                diffs = [r["rel_diff_vs_shipped"] for r in dec if r["kv"] == kv and r["tag"] == name]
                body.append([kv, name] + cells + [f"{max(diffs):.1e}" if diffs else "-"])
        if cudnn:
            body.append(["bf16", "cuDNN (contiguous)"] + [
                f"{cudnn[c]:.1f} ({100 * kv_bytes(c, False) / cudnn[c] / 1e3 / (bw * 1e3):.0f}%)" if c in cudnn and bw
                else "-" for c in contexts] + ["-"])
        print(table(["kv", "tiles", *map(str, contexts), "rel. diff vs shipped"], body))
    pr = [r for r in rows if r.get("section") == "compare-prompt"]
    ref = {r["prefix"]: r["us"] for r in rows if r.get("section") == "prompt" and r.get("impl") == "cudnn"}
    if pr:
        print("\n### compare: prompt chunk (µs, TFLOP/s, cuDNN time / ours: target >= 0.8)")
        body = [[r["kv"], r["tag"], r["prefix"], r["us"], r["tflops"],
                 ref[r["prefix"]] / r["us"] if r["prefix"] in ref else math.nan, f"{r['rel_diff_vs_shipped']:.1e}"]
                for r in pr]
        body += [["bf16", "cuDNN", p, us, prompt_flops(pr[0]["rows"], p) / us / 1e6, 1.0, "-"]
                 for p, us in ref.items()]
        print(table(["kv", "tiles", "prefix", "us", "TFLOP/s", "x cuDNN", "rel. diff vs shipped"], body))


# ---------------------------------------------------------------------------------------------------------------

DECODE_CANDIDATES = (  # (page size, block_k, chunk, num_warps, num_stages)
    (64, 64, 512, 4, 3), (64, 64, 512, 4, 2), (64, 64, 512, 4, 4), (64, 32, 512, 4, 3), (64, 128, 512, 8, 3),
    (64, 64, 1024, 4, 3), (256, 64, 256, 4, 3), (256, 64, 512, 4, 3), (512, 64, 512, 4, 3))
PROMPT_CANDIDATES = (  # (block_q, block_k, num_warps, num_stages, contiguous)
    (64, 64, 4, 2, True), (64, 64, 4, 2, False), (128, 64, 8, 2, True), (128, 64, 8, 3, True),
    (64, 64, 4, 3, True), (128, 32, 8, 3, True))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m pallas_kernels.bench attention")
    ap.add_argument("--sections", default="decode,prompt,window,write",
                    help="any of decode_sweep (1-row decode: the tail launch choices), merge_loads (1-row "
                         "decode: the merge's early loads against its loop), fp8_tiles_sweep (1-row fp8 "
                         "decode: candidate tiles), compare (shipped tiles vs DECODE_COMPARE/PROMPT_COMPARE and cuDNN, ~2 min), "
                         "prompt_mgpu (the Mosaic GPU prompt kernel vs the Triton one and cuDNN; prompt_mgpu_variants "
                         "adds MGPU_VARIANTS), "
                         "window_mgpu (the Mosaic GPU window pass 1 vs the Triton one), "
                         "window_mgpu_variants (its chunks, row split and ping-pong), "
                         "merge_variants (the tail's launch choices for 16-row windows), "
                         "window_partials (fp32 against bf16 O partials, 1- and 16-row windows), "
                         "window_fp8 (fp8 pools: the Triton pass 1 against the Mosaic GPU one), "
                         "v_layout (fp8 pools: v by rows against key-major, and V's scales by the chunk's max; "
                         "windows, prompt and write), "
                         "tune (sweep tiles/page sizes first, then use the winners), decode, prompt, window, window16, write, "
                         "xla (plain-XLA reference rows)")
    ap.add_argument("--json", default=None, help="write every measured row here")
    ap.add_argument("--smoke", action="store_true", help="toy sizes, interpret mode, CPU: checks the script")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip what is left after this many seconds")
    ap.add_argument("--quick-tune", action="store_true", help="sweep only the leading candidates")
    ap.add_argument("--trace", metavar="DIR", help="also time each window call's kernels alone (attn_* launches, "
                    "summed from a jax.profiler trace under DIR), as alone_us")
    args = ap.parse_args(argv)
    global DEADLINE, JSON_PATH, HQ, HKV, D, SCALE
    DEADLINE = time.time() + args.budget_s
    JSON_PATH = args.json
    sections = args.sections.split(",")
    if args.smoke:
        # (head dim 64 where the Mosaic GPU kernels run: their least)
        mgpu_sections = ("prompt_mgpu", "window_mgpu", "window_partials", "window_fp8")
        HQ, HKV, D = 4, 2, 64 if any(s.startswith(mgpu_sections) for s in sections) else 32
        SCALE = D ** -0.5
    env = Env(interpret=args.smoke, page_size=8 if args.smoke else args.page_size, reps=2 if args.smoke else 8,
              results=[], trace=args.trace)
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind}; jax {jax.__version__}", flush=True)
    bw = None if args.smoke else copy_bandwidth_tbs()
    if bw:
        print(f"copy bandwidth: {bw:.2f} TB/s (synchronised calls)", flush=True)
    if bw and args.trace:
        # With --trace the kernels are timed alone, so the copy they are held against is too: the copy kernel's own
        # duration. Until session 22 the % columns divided kernel-alone times by the synchronised copy, which read
        # 3.0-3.5 TB/s against the ~4.3 TB/s the copy kernel itself moves, and so overstated every % of copy.
        untraced, bw = bw, copy_bandwidth_tbs(trace_dir=args.trace)
        print(f"copy bandwidth, traced (the copy kernel alone): {bw:.2f} TB/s; the % columns use it", flush=True)
        env.results.append({"section": "meta", "tag": "copy", "copy_tbs_synchronised": untraced,
                            "copy_tbs_traced": bw})
    gpu = not args.smoke
    contexts = (64, 256) if args.smoke else (4096, 32768, 131072)
    xla = "xla" in sections
    if "compare" in sections:
        run_compare(env, smoke=args.smoke, bw=bw)
    if "prompt_mgpu" in sections or "prompt_mgpu_variants" in sections:
        run_prompt_mgpu(env, smoke=args.smoke, variants="prompt_mgpu_variants" in sections)
    decode_tiles, page, prompt_tiles = at.WindowTiles(), env.page_size, at.PromptTiles()

    if "tune" in sections:
        decode_tiles, page = tune_decode(env, contexts[1], args.smoke, args.quick_tune) or (decode_tiles, page)
        prompt_tiles = tune_prompt(env, 32 if args.smoke else 4096, args.quick_tune) or prompt_tiles
    env.page_size = page
    print(f"using page {page}, {decode_tiles}, {prompt_tiles}", flush=True)
    tuned = "tune" in sections

    def decode_for(fp8: bool) -> at.WindowTiles:  # the shipped tiles of each KV dtype, unless a sweep chose
        if tuned:
            return decode_tiles
        sds = jax.ShapeDtypeStruct  # pass 1 as the engine picks it, for the model's pool layout
        kv = sds((HKV, 1, page, D), kq.FP8 if fp8 else jnp.bfloat16)
        keys = fp8 and kq.FP8_V_LAYOUT == "keys"
        pool = kq.KVPool(kv, sds((HKV, 1, D, page), kq.FP8) if keys else kv, v_layout="keys" if keys else "rows")
        return at.model_window_tiles(jnp.bfloat16, pool, HQ, max_keys=contexts[-1], interpret=env.interpret)

    def window_for(fp8: bool) -> at.WindowTiles:  # 128 packed rows: 8 warps, 2 stages (shared memory)
        return dataclasses.replace(decode_for(fp8), num_warps=None, num_stages=None)

    if "decode" in sections:
        print("== decode: 1 row, 1 stream", flush=True)
        for fp8 in (False, True):
            for ctx in contexts:
                bench_window(env, streams=1, rows=1, context=ctx, fp8=fp8, tiles=decode_for(fp8),
                             impls=("kernel", "xla") if xla else ("kernel",))
        if gpu:
            for ctx in contexts:
                bench_cudnn_decode(env, streams=1, rows=1, context=ctx)
    if "prompt" in sections:
        print("== prompt chunk: 4K rows over 0 / 32K prefix", flush=True)
        rows, prefixes = ((32, (0, 40)) if args.smoke else (4096, (0, 32768)))
        if gpu:
            for prefix in prefixes:
                bench_cudnn_prompt(env, rows=rows, prefix=prefix)
        for fp8 in (False, True):
            for prefix in prefixes:
                bench_prompt(env, rows=rows, prefix=prefix, fp8=fp8, tiles=prompt_tiles,
                             impls=("kernel", "xla") if xla else ("kernel",))
    if "window" in sections:
        print("== verify window: 16 rows (binary tree) x 1/16 streams; 1-row at 16 streams for the ratio", flush=True)
        for fp8 in (False, True):
            for ctx in contexts:
                bench_window(env, streams=1, rows=16, context=ctx, fp8=fp8, tiles=window_for(fp8),
                             impls=("kernel", "xla") if xla and ctx != contexts[-1] else ("kernel",))
            for ctx in contexts[:2]:
                bench_window(env, streams=16, rows=16, context=ctx, fp8=fp8, tiles=window_for(fp8),
                             impls=("kernel", "xla") if xla and ctx == contexts[1] else ("kernel",))
                bench_window(env, streams=16, rows=1, context=ctx, fp8=fp8, tiles=decode_for(fp8), impls=("kernel",))
        if gpu:
            for ctx in contexts[:2]:
                bench_cudnn_decode(env, streams=16, rows=16, context=ctx)
    def bench_short(tag_counts, fp8s, shapes, contexts):
        # The window's shipped tiles with short contexts in short chunks (`WindowTiles.short_chunk`, order) at each
        # of `tag_counts`' chunk counts (attention.SHORT_CHUNKS, read when a call is traced; None: every context in
        # whole chunks), alternated a context at a time.
        shipped_count = at.SHORT_CHUNKS
        for fp8 in fp8s:
            for streams, rows in shapes:
                for ctx in ((64, 256) if args.smoke else contexts):
                    shipped = decode_for(fp8) if rows == 1 else window_for(fp8)
                    for tag, count in tag_counts:
                        at.SHORT_CHUNKS = count or shipped_count
                        try:
                            bench_window(env, streams=streams, rows=rows, context=ctx, fp8=fp8, impls=("kernel",),
                                         tiles=shipped if count else dataclasses.replace(shipped, short_chunk=None),
                                         tag=tag)
                        finally:
                            at.SHORT_CHUNKS = shipped_count

    if "short_chunks" in sections:
        print("== short_chunks: the shipped tiles (short contexts in short chunks) vs fixed chunks", flush=True)
        bench_short((("short", at.SHORT_CHUNKS), ("fixed", None)), (False, True), ((1, 1), (1, 16), (16, 1)),
                    (1024, 2048, 4096, 8192))
    if "short_rule" in sections:
        print("== short_rule: fixed chunks vs SHORT_CHUNKS 8 vs 4 (bf16)", flush=True)
        bench_short((("fixed", None), ("short8", 8), ("short4", 4)), (False,), ((1, 1), (16, 1), (1, 16)),
                    (1024, 2048, 4096))
    if "window16" in sections:
        # 16-row windows (128 packed rows a KV head), 1 stream: the shipped tiles against the other page walk (a
        # launch choice: same bits) and chunk programs of 64 and 32 packed rows (row_block: order; offline, the
        # 128-row program spills at 255 registers, the 64-row one on 8 warps uses 219 and does not).
        print("== window16: 16-row window, 1 stream, shipped tiles vs the other walk and row blocks", flush=True)
        for fp8 in (False, True):
            shipped = window_for(fp8)
            variants = {"shipped": shipped,
                        "other walk": dataclasses.replace(shipped, walk="page" if shipped.walk == "flat" else "flat"),
                        "row_block 64": dataclasses.replace(shipped, row_block=64),
                        "row_block 32": dataclasses.replace(shipped, row_block=32)}
            for ctx in contexts:
                for name, tiles in variants.items():
                    bench_window(env, streams=1, rows=16, context=ctx, fp8=fp8, tiles=tiles, impls=("kernel",),
                                 tag=f"window16 {name} ({tiles.walk} walk)")
    if "window_mgpu" in sections:
        # Pass 1 on Mosaic GPU (`attention_window_mgpu`) beside the Triton pass 1 (the same fold pass and merge
        # after either), bf16 pool: the 1-row decode and the 16-row tree window, 1 stream at every context and 16
        # streams at the first two.
        print("== window_mgpu: pass 1 on Mosaic GPU vs Triton, bf16, 1- and 16-row windows", flush=True)
        for streams, ctxs in ((1, contexts), (16 if gpu else 2, contexts[:2])):
            for ctx in ctxs:
                for rows in (1, 16):
                    base = decode_for(False) if rows == 1 else window_for(False)
                    for impl in ("triton", "mgpu"):
                        bench_window(env, streams=streams, rows=rows, context=ctx, fp8=False,
                                     tiles=dataclasses.replace(
                                         base, impl=impl, partials=base.partials if impl == "mgpu" else "float32"),
                                     impls=("kernel",),
                                     tag=f"window_mgpu {impl}")
    if "window_mgpu_variants" in sections:
        # The Mosaic GPU pass 1 at each chunk (order: the partials' grid) and, for 16-row windows, with each
        # warpgroup's rows in a CTA of their own (row_block 64) or the two warpgroups taking turns (PING_PONG), both
        # launch choices; bf16, tree windows. The windows the target is missed most on first, where the budget may
        # cut the run short.
        print("== window_mgpu_variants: Mosaic GPU pass 1 by chunk, row split and ping-pong, bf16", flush=True)
        base = dataclasses.replace(decode_for(False), impl="mgpu")
        many = 16 if gpu else 2
        mid, longest, shortest = contexts[len(contexts) // 2], contexts[-1], contexts[0]
        cases = dict.fromkeys(((1, mid), (many, mid), (1, longest), (1, shortest), (many, shortest)))
        for (streams, ctx), chunk in itertools.product(cases, WINDOW_MGPU_CHUNKS[:1] if args.smoke
                                                       else WINDOW_MGPU_CHUNKS):
            for rows, variant in ((1, ""), *((16, v) for v in WINDOW_MGPU_VARIANTS)):
                tiles = dataclasses.replace(base, chunk=chunk, row_block=64 if variant == " split" else None)
                bench_window_with("PING_PONG", variant == " ping-pong", env, streams=streams, rows=rows, context=ctx,
                                  fp8=False, tiles=tiles, impls=("kernel",), tag=f"wmv {chunk}{variant}")
    many = 16 if gpu else 2

    def mgpu_order_sweep(tag: str, field: str, values, cases) -> None:
        # An order field of the Mosaic GPU pass 1 at each value, bf16 pool, 1- and 16-row windows, at each (streams,
        # context) of `cases` in turn.
        for streams, ctx in dict.fromkeys(cases):
            for value in values:
                for rows in (1, 16):
                    base = decode_for(False) if rows == 1 else window_for(False)
                    bench_window(env, streams=streams, rows=rows, context=ctx, fp8=False,
                                 tiles=dataclasses.replace(base, **{"impl": "mgpu", "partials": "bfloat16",
                                                                    field: value}), impls=("kernel",),
                                 tag=f"{tag} {value}")

    if "window_partials" in sections:
        # The O partials' dtype (`WindowTiles.partials`, order: fp32, or the same sums rounded once to bf16, half
        # the bytes the fold pass and merge read back).
        print("== window_partials: the O partials' dtype, 1- and 16-row bf16 windows", flush=True)
        # 1 stream at 128K and 16 at 4K first: the windows that missed 1.3x with fp32 partials (session 17).
        mgpu_order_sweep("wpd", "partials", PARTIALS_DTYPES, ((1, contexts[-1]), (many, contexts[0]),
                                                               (1, contexts[0]), (1, contexts[1]), (many, contexts[1])))
    if "window_fp8" in sections:
        # fp8 pools: the shipped Triton pass 1 (f16 dots) and the Mosaic GPU one (over V key-major both MMAs on
        # the codes, its own bits, at two depths; over V by rows the codes dequantized to bf16 in shared memory),
        # 1- and 16-row windows, 1 stream at every context and 16 streams at the first two.
        print("== window_fp8: fp8 pools, Triton against Mosaic GPU pass 1, 1- and 16-row windows", flush=True)
        many = 16 if gpu else 2
        for streams, ctxs in ((1, contexts), (many, contexts[:2])):
            for ctx in ctxs:
                for variant in FP8_VARIANTS:
                    for rows in (1, 16):
                        base = decode_for(True) if rows == 1 else window_for(True)
                        if variant.startswith("mgpu"):
                            base = dataclasses.replace(base, impl="mgpu", chunk=awm.CHUNK, partials=awm.PARTIALS)
                        if variant.endswith("deep"):
                            base = dataclasses.replace(base, num_stages=E4M3_DEEP_STAGES)
                        bench_window(env, streams=streams, rows=rows, context=ctx, fp8=True, tiles=base,
                                     impls=("kernel",), tag=f"wf8 {variant}", v_layout=FP8_VARIANT_LAYOUT.get(variant))
    if "v_layout" in sections:
        # An fp8 pool's v by rows against key-major (`kv_quant.KVPool.v_layout` "keys"), and key-major with
        # `WindowTiles.fp8_v_max` "chunk" (order; shipped): the shipped pass 1 (Triton for fp8 pools), 1- and 16-row
        # windows, 1 stream at every context and 16 at the first two; then the prompt (the Mosaic GPU kernel over
        # the dequantized copy, whose gather moves V) and the write, by layout.
        print("== v_layout: fp8 pools, v by rows against key-major", flush=True)
        many = 16 if gpu else 2
        for streams, ctxs in ((1, contexts), (many, contexts[:2])):
            for ctx in ctxs:
                for rows in (1, 16):
                    for name, layout, change in V_VARIANTS:
                        tiles = dataclasses.replace(decode_for(True) if rows == 1 else window_for(True), **change)
                        bench_window(env, streams=streams, rows=rows, context=ctx, fp8=True, impls=("kernel",),
                                     tiles=tiles, tag=f"vl {name}", v_layout=layout)
        for prefix in (0, contexts[1]):
            for layout in kq.V_LAYOUTS:
                bench_prompt(env, rows=32 if args.smoke else 4096, prefix=prefix, fp8=True,
                             impls=("mgpu",) if gpu else ("kernel",), tag=f"vlp {layout}", v_layout=layout)
        for layout in kq.V_LAYOUTS:
            bench_write(env, streams=1, rows=32 if args.smoke else 4096, fp8=True, v_layout=layout)
            bench_write(env, streams=many, rows=1, fp8=True, v_layout=layout)
    if "fp8_tiles_sweep" in sections:
        # The fp8 pool's 1-row decode at 32K under FP8_DECODE_SWEEP's candidate tiles (session 22, 689943d).
        print("== fp8_tiles_sweep: 1-row fp8 decode, shipped tiles and candidates", flush=True)
        bench_window(env, streams=1, rows=1, context=contexts[1], fp8=True, tiles=decode_for(True),
                     impls=("kernel",), tag="sweep shipped")
        for label, change in FP8_DECODE_SWEEP[:2] if args.smoke else FP8_DECODE_SWEEP:
            bench_window(env, streams=1, rows=1, context=contexts[1], fp8=True,
                         tiles=dataclasses.replace(decode_for(True), **change), impls=("kernel",),
                         tag=f"sweep {label}")
    if "decode_sweep" in sections:
        # The 1-row decode's tail by launch choice (same bits): the shipped rule, the fold pass and merge in two
        # launches, and the merge folding the groups itself (fold_in_merge False / True); each pool, 1 stream at
        # every context; then 16 streams at 32K as shipped.
        print("== decode_sweep: 1-row decode, the tail's launch choices", flush=True)
        for ctx in (contexts[1], contexts[0], contexts[-1]):
            for fp8 in (False, True):
                for label, change in TAIL_SWEEP:
                    bench_window(env, streams=1, rows=1, context=ctx, fp8=fp8,
                                 tiles=dataclasses.replace(decode_for(fp8), **change), impls=("kernel",),
                                 tag=f"sweep {label}")
        for fp8 in (False, True):
            bench_window(env, streams=16 if gpu else 2, rows=1, context=contexts[1], fp8=fp8, tiles=decode_for(fp8),
                         impls=("kernel",), tag="sweep shipped")
    if "merge_loads" in sections:
        # The merge's loads (MERGE_LOADS_SWEEP, MERGE_EARLY_LAUNCHES: same bits), 1-row decode, each pool: 1 stream
        # at every context, 16 streams at 32K; the summary is decode_sweep's.
        print("== merge_loads: 1-row decode, the merge's loads", flush=True)
        many = 16 if gpu else 2
        for streams, ctx in ((1, contexts[1]), (1, contexts[0]), (1, contexts[-1]), (many, contexts[1])):
            for fp8 in (False, True):
                variants = MERGE_LOADS_SWEEP + (MERGE_EARLY_LAUNCHES if (streams, ctx) == (1, contexts[1]) else ())
                for label, change in variants[:2] if args.smoke else variants:
                    bench_window(env, streams=streams, rows=1, context=ctx, fp8=fp8,
                                 tiles=dataclasses.replace(decode_for(fp8), **change), impls=("kernel",),
                                 tag=f"sweep {label}")
    if "merge_variants" in sections:
        # The tail's launch choices (MERGE_VARIANTS: same bits) for 16-row bf16 windows on the shipped pass 1, the
        # windows nearest the 1.3x target first (1 stream at 32K: the merge folds the groups itself); the 1-row
        # windows first, then each variant at every window.
        print("== merge_variants: the tail's launch choices, 16-row bf16 windows", flush=True)
        many = 16 if gpu else 2
        windows = dict.fromkeys(((1, contexts[1]), (1, contexts[-1]), (many, contexts[0]), (many, contexts[1]),
                                 (1, contexts[0])))
        for streams, ctx in windows:
            bench_window(env, streams=streams, rows=1, context=ctx, fp8=False, tiles=decode_for(False),
                         impls=("kernel",), tag="merge 1-row")
        for label, change in MERGE_VARIANTS[:2] if args.smoke else MERGE_VARIANTS:  # each at every window in turn
            for streams, ctx in windows:
                bench_window(env, streams=streams, rows=16, context=ctx, fp8=False,
                             tiles=dataclasses.replace(window_for(False), **change), impls=("kernel",),
                             tag=f"merge {label}")
    if "write" in sections:
        print("== KV write (in place, donated pool)", flush=True)
        for fp8 in (False, True):
            bench_write(env, streams=1, rows=32 if args.smoke else 4096, fp8=fp8)
            bench_write(env, streams=16 if gpu else 2, rows=16, fp8=fp8)

    env.results.append({"section": "meta", "tag": "meta", "device": dev.device_kind, "jax": jax.__version__,
                        "copy_tbs": bw, "page": page, "decode_tiles": str(decode_tiles),
                        "prompt_tiles": str(prompt_tiles)})
    if JSON_PATH:
        with open(JSON_PATH, "w") as f:
            json.dump(env.results, f, indent=1)
    summarize(env, bw)
    summarize_compare(env, bw)
    summarize_prompt_mgpu(env)
    summarize_window_mgpu(env, bw)
    summarize_window_mgpu_variants(env, bw)
    summarize_window_partials(env, bw)
    summarize_window_fp8(env, bw)
    summarize_v_layout(env, bw)
    summarize_merge_variants(env)
    summarize_decode_sweep(env, bw)
    return 0


def tune_decode(env: Env, context: int, smoke: bool, quick: bool):
    """Decode tiles and page size at one context: every candidate for bf16, the best three again for fp8; the
    winner (sum of the two times) becomes the setting for every decode and window row after it."""
    print(f"== tune: decode tiles and page size at {context}", flush=True)
    cands = [(8, 16, 32, 4, 3), (8, 16, 64, 4, 2), (16, 16, 32, 4, 3)] if smoke else list(DECODE_CANDIDATES)
    if quick:
        cands = [cands[i] for i in (0, 1, 3, 7)] if not smoke else cands[:2]
    times = {}
    for ps, bk, chunk, warps, stages in cands:
        tiles = at.WindowTiles(block_k=bk, chunk=chunk, num_warps=warps, num_stages=stages)
        got = bench_window(env, streams=1, rows=1, context=context, fp8=False, impls=("kernel",), tiles=tiles,
                           page_size=ps, tag="tune")
        if got:
            times[(ps, tiles)] = got["kernel"]
    if not times:
        return None
    best = sorted(times, key=times.get)[:2 if quick else 3]
    total = {}
    for ps, tiles in best:
        got = bench_window(env, streams=1, rows=1, context=context, fp8=True, impls=("kernel",), tiles=tiles,
                           page_size=ps, tag="tune")
        if got:
            total[(ps, tiles)] = times[(ps, tiles)] + got["kernel"]
    ps, tiles = min(total or {k: times[k] for k in best}, key=(total or times).get)
    print(f"  decode winner: page {ps}, {tiles}", flush=True)
    return tiles, ps


def tune_prompt(env: Env, rows: int, quick: bool):
    print(f"== tune: prompt tiles at {rows} rows, no prefix, bf16", flush=True)
    times = {}
    for bq, bk, warps, stages, contiguous in (PROMPT_CANDIDATES[:2] + PROMPT_CANDIDATES[3:4] if quick
                                              else PROMPT_CANDIDATES):
        tiles = at.PromptTiles(block_q=bq, block_k=bk, num_warps=warps, num_stages=stages, contiguous=contiguous)
        got = bench_prompt(env, rows=rows, prefix=0, fp8=False, impls=("kernel",), tiles=tiles, tag="tune")
        if got:
            times[tiles] = got["kernel"]
    if not times:
        return None
    tiles = min(times, key=times.get)
    print(f"  prompt winner: {tiles}", flush=True)
    return tiles


def summarize(env: Env, bw: float | None) -> None:
    rows = env.results
    dec = [r for r in rows if r.get("section") in ("decode", "window") and r.get("tag") == ""]
    if dec:
        # With --trace the kernels alone (alone_us) beside the chained call: the targets read the former.
        print("\n### decode / verify window (µs per call, chained and the kernels alone; GB/s of KV bytes)")
        body = []
        for r in dec:
            frac = f"{100 * r['kv_gbs'] / (bw * 1e3):.0f}%" if bw else "-"
            alone = r.get("alone_us", math.nan)
            body.append([r["impl"], r["kv"], r["streams"], r["rows"], r["context"], r["us"], r["kv_gbs"], frac, alone,
                         _pct_copy(r["context"], r["streams"], alone, bw, r["kv"] == "fp8")])
        print(table(["impl", "kv", "streams", "rows", "context", "us", "GB/s", "of copy", "alone us", "% copy"],
                    body))
        ratios = []
        for r in dec:
            if r["impl"] == "kernel" and r["rows"] == 16:
                one = [x for x in dec if x["impl"] == "kernel" and x["rows"] == 1 and x["kv"] == r["kv"]
                       and x["streams"] == r["streams"] and x["context"] == r["context"]]
                if one:
                    a16, a1 = r.get("alone_us", math.nan), one[0].get("alone_us", math.nan)
                    ratios.append([r["kv"], r["streams"], r["context"], r["us"], one[0]["us"],
                                   r["us"] / one[0]["us"], a16, a1, a16 / a1])
        if ratios:
            print("\n### 16-row window vs 1-row (target <= 1.3x, of the kernels alone)")
            print(table(["kv", "streams", "context", "16-row us", "1-row us", "ratio", "16-row alone", "1-row alone",
                         "ratio alone"], ratios))
    pr = [r for r in rows if r.get("section") == "prompt" and r.get("tag") == ""]
    if pr:
        print("\n### prompt chunk (TFLOP/s, causal-halved count)")
        print(table(["impl", "kv", "rows", "prefix", "us", "TFLOP/s"],
                    [[r["impl"], r["kv"], r["rows"], r["prefix"], r["us"], r["tflops"]] for r in pr]))
    wr = [r for r in rows if r.get("section") == "write"]
    if wr:
        print("\n### KV write (µs, wall per call incl. dispatch)")
        print(table(["impl", "kv", "streams", "rows", "us"],
                    [[r["impl"], r["kv"], r["streams"], r["rows"], r["us"]] for r in wr]))
    wk = [r for r in rows if r.get("tag", "").startswith("window16 ")]
    if wk:
        print("\n### 16-row window, 1 stream: tile variants (µs)")
        print(table(["kv", "tiles", "context", "us"], [[r["kv"], r["tag"][9:], r["context"], r["us"]] for r in wk]))
    tn = [r for r in rows if r.get("tag") == "tune"]
    if tn:
        print("\n### tuning candidates")
        print(table(["section", "kv", "rows", "page", "tiles", "us", "GB/s | TFLOP/s"],
                    [[r["section"], r["kv"], r["rows"], r.get("page", ""), r["tiles"], r["us"],
                      r.get("kv_gbs", r.get("tflops", math.nan))] for r in tn]))
