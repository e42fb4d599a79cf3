"""Gated DeltaNet benchmark at the 27B's shape (Hk = 16, Hv = 48, dk = dv = 128), one GDN layer:
`python -m pallas_kernels.bench gdn [--t 1024,4096,16384,65536] [--no-fla] [--no-sweep] [--skip ...] [--json F]`.
The serial decode step alone (about a minute on an H200):
`python -m pallas_kernels.bench gdn --skip prompt,verify,conv --no-fla --json $OUT/gdn_step.json`.

Prompt pass: our two-launch kernel in several tile/precision settings, the jitted reference, and
flash-linear-attention's `chunk_gated_delta_rule` (if importable) on the same device arrays (shared through
DLPack). Verify: window / commit kernels, the jitted references, and fla's `fused_recurrent_gated_delta_rule`
(chain only) for 1/4/16 rows x 1/4/16 streams, in µs and GB/s of fp32 state traffic against the copy bandwidth
measured in the same run. Conv entry points (plain jnp) are timed to show they are cheap.
Serial decode step (section "step"): the fused `step` against what it replaces, a one-row `window` followed by a
one-row `commit`, and each of those alone, at S = 1, 4, 16 for a few tile variants (the window and the commit run
with the same tiles as the step, as exactness requires); every variant's bits are checked against window + commit
in the same run. Also conv_step against conv_window + conv_commit.

Timings are medians of wall time per synchronised call. Prompt passes: one call per sample (inputs rotated).
Verify, commit and step: n calls on n different state sets in one jitted program (one Python loop for fla),
time / n, so host dispatch is amortised the same way for every implementation and the state comes from HBM, not the
60 MB L2. Nothing is asserted; numbers go to stdout (tables last) and, with --json, to a file rewritten after every
row (a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time

HK, HV, DK, DV = 16, 48, 128, 128
STATE_BYTES = HV * DK * DV * 4  # per stream per layer
CONV_DIM = 2 * HK * DK + HV * DV
INTERPRET = False  # only for a dry run of this script on CPU at toy sizes
TRACE_DIR: str | None = None  # --trace: verify and commit also timed from a profiler trace (their kernels alone)


def _log(*a):
    print(*a, flush=True)


def _rows(key, s, t, dtype):
    import jax
    import jax.numpy as jnp
    kq, kk, kv, kg, kb = jax.random.split(key, 5)
    l2n = lambda x: x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)
    q = (l2n(jax.random.normal(kq, (s, t, HK, DK))) * DK ** -0.5).astype(dtype)
    k = l2n(jax.random.normal(kk, (s, t, HK, DK))).astype(dtype)
    v = jax.random.normal(kv, (s, t, HV, DV)).astype(dtype)
    g = -jax.random.uniform(kg, (s, t, HV), minval=0.005, maxval=0.3)
    beta = jax.random.uniform(kb, (s, t, HV), minval=0.05, maxval=0.95)
    return q, k, v, g, beta


def _cfg_name(cfg) -> str:
    return (f"{cfg.precision} {cfg.store_dtype[:4]} bv{cfg.block_v} w{cfg.num_warps} s{cfg.num_stages}"
            f" pw{cfg.prep_warps} ow{cfg.output_warps}{' T' if cfg.transposed else ''}"
            f"{' F' if cfg.fused_output else ''}{' split-prep' if cfg.split_prep else ''}")


def _rel(x, ref) -> float:
    import jax.numpy as jnp
    x, ref = x.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


def _time_torch_us(fn, arg_sets, warmup=3, iters=30):
    import torch
    for i in range(warmup):
        fn(*arg_sets[i % len(arg_sets)])
    torch.cuda.synchronize()
    samples = []
    for i in range(iters):
        t0 = time.perf_counter()
        fn(*arg_sets[i % len(arg_sets)])
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def _fla():
    try:
        import fla
        import torch
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        return dict(version=getattr(fla, "__version__", "?"), torch=torch, chunk=chunk_gated_delta_rule,
                    recurrent=fused_recurrent_gated_delta_rule)
    except Exception as e:  # noqa: BLE001 - report and go on without the comparison
        _log(f"fla unavailable: {type(e).__name__}: {e}")
        return None


def _to_torch(fla, x):
    return fla["torch"].from_dlpack(x)


def _parse_prompt_tiles(spec: str):
    """'precision=bf16,store_dtype=bfloat16;prep_warps=8' -> PromptTiles per ';'-separated item ('' = defaults)."""
    from pallas_kernels import gdn, replace_fields
    return [replace_fields(gdn.PromptTiles(), item, "--prompt-tiles") for item in spec.split(";")]


def bench_prompt(ts, fla, sweep, iters, given=None):
    """given: PromptTiles to time at every T, each with its three launches timed alone; None: the sweep at the
    first T and the fastest of each precision at the others (without the sweep: the tiles the model ships for
    bf16 activations, `gdn.prompt_tiles`)."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels import gdn
    from pallas_kernels.bench.common import time_us

    rows, stages = [], []
    configs = [gdn.prompt_tiles(jnp.bfloat16)]  # (the inputs below are bf16)
    if given:
        configs = list(given)
    elif sweep:
        configs = [gdn.prompt_tiles(jnp.bfloat16), gdn.PromptTiles(),
                   gdn.PromptTiles(num_stages=1),
                   gdn.PromptTiles(block_v=32, num_warps=4),
                   gdn.PromptTiles(store_dtype="bfloat16"),
                   gdn.PromptTiles(precision="tf32x3")]
    best_per_precision: dict[str, object] = {}
    pool = jax.random.normal(jax.random.key(7), (2, HV, DK, DV), jnp.float32) * 0.1
    slot, start = jnp.array([1], jnp.int32), jnp.array([0], jnp.int32)
    for ti, t in enumerate(ts):
        sets = [_rows(jax.random.key(100 * ti + i), 1, t, jnp.bfloat16) for i in range(2)]
        lengths = jnp.array([t], jnp.int32)
        ref_fn = jax.jit(gdn.prompt_reference)
        ref_o, ref_pool = ref_fn(*sets[0], pool, slot, start, lengths)
        # The whole sweep at the first T, then the fastest setting of each precision at the others.
        for cfg in (configs if ti == 0 or given else list(best_per_precision.values())):
            name = f"pallas {_cfg_name(cfg)}"
            try:
                fn = jax.jit(functools.partial(gdn.prompt, tiles=cfg))
                o, p = fn(*sets[0], pool, slot, start, lengths)
                err_o, err_s = _rel(o, ref_o), _rel(p[1], ref_pool[1])
                us = time_us(fn, [(*x, pool, slot, start, lengths) for x in sets], iters=iters)
            except Exception as e:  # noqa: BLE001 - a setting that fails to compile is reported, not fatal
                _log(f"prompt T={t} {name} failed: {type(e).__name__}: {str(e)[:400]}")
                continue
            rows.append(dict(t=t, impl=name, us=us, err_o=err_o, err_state=err_s, cfg=cfg))
            _log(f"prompt T={t} {name}: {us:.1f} us  err o {err_o:.2e} state {err_s:.2e}")
        if ti == 0:
            for r in sorted((r for r in rows if r["t"] == t), key=lambda r: r["us"]):
                best_per_precision.setdefault(r["cfg"].precision, r["cfg"])
        best = min((r for r in rows if r["t"] == t and "cfg" in r), key=lambda r: r["us"], default=None)
        if given:
            for cfg in dict.fromkeys(r["cfg"] for r in rows if r["t"] == t and "cfg" in r):
                stages.extend(_stage_times(cfg, sets, pool, slot, start, lengths, t, iters))
        elif best is not None and ti == 0:
            stages.extend(_stage_times(best["cfg"], sets, pool, slot, start, lengths, t, iters))
        if t <= 16384:
            us = time_us(ref_fn, [(*x, pool, slot, start, lengths) for x in sets], warmup=1, iters=3)
            rows.append(dict(t=t, impl="jnp reference", us=us, err_o=0.0, err_state=0.0))
            _log(f"prompt T={t} reference: {us:.1f} us")
        if fla is not None:
            torch = fla["torch"]
            tsets = [tuple(_to_torch(fla, a) for a in x) for x in sets]

            def run_fla(q, k, v, g, beta):
                return fla["chunk"](q, k, v, g, beta, scale=1.0, initial_state=None, output_final_state=True)

            try:
                fo, fstate = run_fla(*tsets[0])
                torch.cuda.synchronize()
                diff = _rel(jnp.asarray(fo.float().cpu().numpy()), ref_o)
                us = _time_torch_us(run_fla, tsets, iters=iters)
                rows.append(dict(t=t, impl=f"fla {fla['version']} chunk", us=us, err_o=diff, err_state=float("nan")))
                _log(f"prompt T={t} fla chunk: {us:.1f} us (o vs reference {diff:.2e})")
            except Exception as e:  # noqa: BLE001
                _log(f"fla chunk failed at T={t}: {type(e).__name__}: {e}")
            del tsets
        del sets
    return rows, stages


def _stage_times(cfg, sets, pool, slot, start, lengths, t, iters):
    """µs of each of the prompt pass's three launches, for the notes on where the time goes."""
    import jax
    from pallas_kernels import gdn
    from pallas_kernels.bench.common import time_us

    fused = cfg.fused_output  # two launches: prep (with P), then the state pass that writes the outputs
    prep = jax.jit(lambda q, *a: gdn.prompt_prep(*a, tiles=cfg, interpret=INTERPRET, q=q if fused else None))
    prep_args = [(x[0], x[1], x[2], x[3], x[4], start, lengths) for x in sets]
    inter = [prep(*a) for a in prep_args]
    if fused:
        state_out = jax.jit(functools.partial(gdn.prompt_state_output, out_dtype=sets[0][2].dtype, tiles=cfg,
                                              interpret=INTERPRET))
        stages = (("prep", prep, prep_args),
                  ("state", state_out, [(x[0], x[1], *i, start, lengths, slot, pool) for x, i in zip(sets, inter)]))
    else:
        state = jax.jit(functools.partial(gdn.prompt_state, tiles=cfg, interpret=INTERPRET))
        output = jax.jit(functools.partial(gdn.prompt_output, out_dtype=sets[0][2].dtype, tiles=cfg,
                                           interpret=INTERPRET))
        states = [state(x[1], *i, start, lengths, slot, pool) for x, i in zip(sets, inter)]
        stages = (("prep", prep, prep_args),
                  ("state", state, [(x[1], *i, start, lengths, slot, pool) for x, i in zip(sets, inter)]),
                  ("output", output, [(x[0], x[1], i[2], st[0], st[1], start, lengths)
                                      for x, i, st in zip(sets, inter, states)]))
    out = []
    for name, fn, args in stages:
        out.append(dict(t=t, stage=name, us=time_us(fn, args, iters=iters), cfg=cfg))
        _log(f"prompt T={t} stage {name}{' (with the outputs)' if fused and name == 'state' else ''}: "
             f"{out[-1]['us']:.1f} us")
    if fused:
        out.append(dict(t=t, stage="output", us=float("nan"), cfg=cfg))
    return out


def _chain(s, r):
    import jax.numpy as jnp
    return jnp.broadcast_to(jnp.arange(r, dtype=jnp.int32) - 1, (s, r))


def _fork(s, r):
    import jax.numpy as jnp
    par = [-1] + [max(i - 1 - (i % 3 == 0), -1) for i in range(1, r)]  # a chain with side branches
    return jnp.broadcast_to(jnp.asarray(par, jnp.int32), (s, r))


def _batched(fn, n):
    """One jitted program of n calls of fn, the i-th on pool slots [i*S, (i+1)*S): per-call time = wall / n, so
    the host's dispatch cost is spread over n calls instead of added to each, and the n state sets (more than the
    60 MB L2 together) come from HBM. The tree schedule, equal across the calls, is computed once (CSE)."""
    import jax
    import jax.numpy as jnp

    def run(q, k, v, g, beta, parents, pool):
        s = q.shape[0]
        outs = []
        for i in range(n):
            outs.append(fn(q, k, v, g, beta, parents, pool, jnp.arange(s, dtype=jnp.int32) + i * s))
        return outs
    return jax.jit(run)


def _batched_commit(fn, n):
    import jax
    import jax.numpy as jnp

    def run(k, v, g, beta, path, plen, pool):
        s = k.shape[0]
        for i in range(n):
            pool = fn(k, v, g, beta, path, plen, pool, jnp.arange(s, dtype=jnp.int32) + i * s)
        return pool
    return jax.jit(run, donate_argnums=6)


def bench_verify(streams, rows_list, fla, sweep, iters):
    import jax
    import jax.numpy as jnp
    from pallas_kernels import gdn
    from pallas_kernels.bench.common import time_us

    out = []
    tile_set = [gdn.WindowTiles()]
    if sweep:
        tile_set = [gdn.WindowTiles(block_v=bv, num_warps=nw) for bv, nw in ((16, 1), (32, 1), (16, 2), (32, 4))]
    chosen = tile_set[0]
    for s in streams:
        n = min(32, max(8, math.ceil(120e6 / (s * STATE_BYTES))))
        pool = jax.random.normal(jax.random.key(1000 + s), (n * s, HV, DK, DV), jnp.float32) * 0.1
        for r in rows_list:
            q, k, v, g, beta = _rows(jax.random.key(s * 100 + r), s, r, jnp.bfloat16)
            chain = _chain(s, r)
            slot0 = jnp.arange(s, dtype=jnp.int32)
            ref_o = jax.jit(gdn.window_reference)(q, k, v, g, beta, chain, pool, slot0)
            # the tile sweep where it decides (the largest window of the most streams), then the winner
            swept = tile_set if (s, r) == (streams[0], rows_list[0]) else [chosen]
            best = None
            for tiles in swept:
                name = f"window bv{tiles.block_v} w{tiles.num_warps}"
                fn = functools.partial(gdn.window, tiles=tiles)
                try:
                    err = _rel(jax.jit(fn)(q, k, v, g, beta, chain, pool, slot0), ref_o)
                    batched = _batched(fn, n)
                    us = time_us(batched, [(q, k, v, g, beta, chain, pool)], iters=iters) / n
                    alone = _alone(lambda: batched(q, k, v, g, beta, chain, pool), n, "gdn_window")
                except Exception as e:  # noqa: BLE001
                    _log(f"verify S={s} R={r} {name} failed: {type(e).__name__}: {str(e)[:400]}")
                    continue
                out.append(dict(s=s, r=r, impl=name, us=us, alone_us=alone, bytes=s * STATE_BYTES, err=err))
                _log(f"verify S={s} R={r} {name}: {us:.1f} us ({alone:.1f} alone) err {err:.1e}")
                if best is None or us < best[0]:
                    best = (us, tiles)
            if best is None:
                continue
            chosen = best[1]
            fn = functools.partial(gdn.window, tiles=chosen)
            if r == max(rows_list):
                batched, fork = _batched(fn, n), _fork(s, r)
                us = time_us(batched, [(q, k, v, g, beta, fork, pool)], iters=iters) / n
                alone = _alone(lambda: batched(q, k, v, g, beta, fork, pool), n, "gdn_window")
                out.append(dict(s=s, r=r, impl=f"window tree bv{chosen.block_v} w{chosen.num_warps}", us=us,
                                alone_us=alone, bytes=s * STATE_BYTES, err=float("nan")))
            path, plen = chain + 1, jnp.full((s,), r, jnp.int32)
            fn = functools.partial(gdn.commit, tiles=chosen)
            ref_c = jax.jit(gdn.commit_reference)(k, v, g, beta, path, plen, pool, slot0)
            err = _rel(jax.jit(fn)(k, v, g, beta, path, plen, pool, slot0)[:s], ref_c[:s])
            commit_n = _batched_commit(fn, n)
            pools = [pool + 0.0 for _ in range(2)]  # donated each call: fresh buffers to rotate through
            us = _time_donated(commit_n, (k, v, g, beta, path, plen), pools, iters) / n

            def commit_once():
                pools[0] = commit_n(k, v, g, beta, path, plen, pools[0])
                return pools[0]
            alone = _alone(commit_once, n, "gdn_commit")
            out.append(dict(s=s, r=r, impl=f"commit bv{chosen.block_v} w{chosen.num_warps}", us=us, alone_us=alone,
                            bytes=2 * s * STATE_BYTES, err=err))
            _log(f"verify S={s} R={r} commit: {us:.1f} us ({alone:.1f} alone) err {err:.1e}")
            del pools
            if s == max(streams) and r in (min(rows_list), max(rows_list)):
                ref_w = functools.partial(gdn.window_reference)
                us = time_us(_batched(ref_w, n), [(q, k, v, g, beta, chain, pool)], warmup=1, iters=5) / n
                out.append(dict(s=s, r=r, impl="window jnp reference", us=us, bytes=s * STATE_BYTES, err=0.0))
            if fla is not None:
                torch = fla["torch"]
                tq, tk, tv, tg, tb = (_to_torch(fla, a) for a in (q, k, v, g, beta))
                tpools = [_to_torch(fla, pool[i * s:(i + 1) * s]) for i in range(n)]

                def run_fla(i):
                    return fla["recurrent"](tq, tk, tv, g=tg, beta=tb, scale=1.0, initial_state=tpools[i],
                                            output_final_state=False)

                def run_all():
                    for i in range(n):
                        run_fla(i)

                try:
                    fo, _ = run_fla(0)
                    err = _rel(jnp.asarray(fo.float().cpu().numpy()), ref_o)
                    us = _time_torch_us(run_all, [()], iters=iters) / n
                    out.append(dict(s=s, r=r, impl=f"fla {fla['version']} fused_recurrent", us=us,
                                    bytes=s * STATE_BYTES, err=err))
                    _log(f"verify S={s} R={r} fla: {us:.1f} us err {err:.1e}")
                except Exception as e:  # noqa: BLE001
                    _log(f"fla recurrent failed at S={s} R={r}: {type(e).__name__}: {e}")
                del tpools
                torch.cuda.empty_cache()
        del pool
    return out


def _alone(run, n: int, prefix: str) -> float:
    """--trace: µs of one call's kernels named `prefix`... alone, from a profiler trace of run() (n calls); NaN
    without --trace."""
    if not TRACE_DIR:
        return math.nan
    from pallas_kernels.bench.common import traced_us
    return traced_us(run, TRACE_DIR, per=n, prefix=prefix)[0]


def _time_donated(fn, args, pools, iters):
    """Median µs of fn(*args, pool) where the pool is donated and the result becomes the next call's pool."""
    import jax
    for _ in range(2):
        pools[0] = jax.block_until_ready(fn(*args, pools[0]))
    samples = []
    for i in range(iters):
        t0 = time.perf_counter()
        pools[i % 2] = jax.block_until_ready(fn(*args, pools[i % 2]))
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def bench_conv(iters):
    import jax
    import jax.numpy as jnp
    from pallas_kernels import gdn
    from pallas_kernels.bench.common import time_us

    out = []
    w = jax.random.normal(jax.random.key(3), (CONV_DIM, 4), jnp.bfloat16)
    for t in (4096, 16384):
        m = [jax.random.normal(jax.random.key(i), (1, t, CONV_DIM), jnp.bfloat16) for i in range(2)]
        pool = jnp.zeros((2, 3, CONV_DIM), jnp.bfloat16)
        fn = jax.jit(gdn.conv_prompt)
        us = time_us(fn, [(x, pool, jnp.array([1]), w, jnp.array([0]), jnp.array([t])) for x in m], iters=iters)
        out.append(dict(op=f"conv_prompt T={t}", us=us, bytes=2 * t * CONV_DIM * 2))
    for s, r in ((16, 16), (16, 4)):
        m = [jax.random.normal(jax.random.key(i), (s, r, CONV_DIM), jnp.bfloat16) for i in range(2)]
        pool = jax.random.normal(jax.random.key(9), (s, 3, CONV_DIM), jnp.bfloat16)
        slot = jnp.arange(s, dtype=jnp.int32)
        fn = jax.jit(gdn.conv_window)
        us = time_us(fn, [(x, _chain(s, r), pool, slot, w) for x in m], iters=iters)
        out.append(dict(op=f"conv_window S={s} R={r}", us=us, bytes=2 * s * r * CONV_DIM * 2))
        fn = jax.jit(gdn.conv_commit)
        us = time_us(fn, [(x, _chain(s, r) + 1, jnp.full((s,), r), pool, slot) for x in m], iters=iters)
        out.append(dict(op=f"conv_commit S={s} R={r}", us=us, bytes=s * 3 * CONV_DIM * 2 * 2))
    return out


def _step_calls(s: int, calls: int) -> int:
    """Calls per timed program: enough slot sets for ~120 MB of state (twice the L2), at least 8, at most 32."""
    return calls or min(32, max(8, math.ceil(120e6 / (s * STATE_BYTES))))


def _chained(body, n):
    """One jitted program of n calls body(rows, pool, slot) -> (out or None, pool), the i-th on slots
    [i*S, (i+1)*S), the pool donated and threaded through, as the decode program threads it through its layers."""
    import jax
    import jax.numpy as jnp

    def run(rows, pool):
        s = rows[0].shape[0]
        outs = []
        for i in range(n):
            out, pool = body(rows, pool, jnp.arange(s, dtype=jnp.int32) + i * s)
            if out is not None:
                outs.append(out)
        return outs, pool
    return jax.jit(run, donate_argnums=1)


def _then(out, pool, update):
    """(out, update(pool)) with the update ordered after `out` is computed, as in the decode program, where the
    commit waits for the accept decision that reads the window's output: without the order XLA may copy the whole
    pool so that the window can still read it after the in-place commit."""
    import jax
    out, pool = jax.lax.optimization_barrier((out, pool))
    return out, update(pool)


def _time_chained(fn, rows, pool, iters):
    """Median µs of fn(rows, pool) with the donated pool of one call fed to the next."""
    import jax
    for _ in range(2):
        pool = jax.block_until_ready(fn(rows, pool))[1]
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        pool = jax.block_until_ready(fn(rows, pool))[1]
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def _parse_tiles(spec: str):
    from pallas_kernels import gdn
    out = []
    for item in filter(None, spec.split(",")):
        bv, nw = item.split("x")
        out.append(gdn.WindowTiles(block_v=int(bv), num_warps=int(nw)))
    return out


def _same_bits(a, b) -> bool:
    import jax
    import numpy as np
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def bench_step(streams, tile_set, calls, iters, record, deadline):
    """step vs one-row window + commit (and each alone) per tiles and S, the first tiles (the default) first; then
    conv_step vs conv_window + conv_commit. Stops starting new measurements once time.monotonic() > deadline."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels import gdn

    out = []
    state_bytes = {"step": 2, "window R=1": 1, "commit R=1": 2, "window+commit": 3}
    for tiles in tile_set:
        kw = dict(tiles=tiles, interpret=INTERPRET)
        tag = f"bv{tiles.block_v} w{tiles.num_warps}"
        for s in streams:
            n = _step_calls(s, calls)
            pool = jax.random.normal(jax.random.key(2000 + s), (n * s, HV, DK, DV), jnp.float32) * 0.1
            rows = _rows(jax.random.key(3000 + s), s, 1, jnp.bfloat16)
            root = jnp.full((s, 1), -1, jnp.int32)
            one_path, one_len = jnp.zeros((s, 1), jnp.int32), jnp.ones((s,), jnp.int32)
            ref_o, ref_pool = jax.jit(gdn.step_reference)(*rows, pool, jnp.arange(s, dtype=jnp.int32))
            bodies = {
                "step": lambda r, p, sl: gdn.step(*r, p, sl, **kw),
                "window R=1": lambda r, p, sl: (gdn.window(*r, root, p, sl, **kw), p),
                "commit R=1": lambda r, p, sl: (None, gdn.commit(*r[1:], one_path, one_len, p, sl, **kw)),
                "window+commit": lambda r, p, sl: _then(
                    gdn.window(*r, root, p, sl, **kw), p,
                    lambda p2: gdn.commit(*r[1:], one_path, one_len, p2, sl, **kw)),
            }
            results = {}
            for name, body in bodies.items():
                if time.monotonic() > deadline:
                    _log(f"step S={s} {tag} {name}: skipped, past the time budget")
                    continue
                try:
                    fn = _chained(body, n)
                    results[name] = jax.block_until_ready(fn(rows, pool + 0.0))  # fresh copy: the pool is donated
                    us = _time_chained(fn, rows, pool + 0.0, iters) / n
                except Exception as e:  # noqa: BLE001 - a setting that fails to compile is reported, not fatal
                    _log(f"step S={s} {tag} {name} failed: {type(e).__name__}: {str(e)[:400]}")
                    continue
                row = dict(section="step", s=s, tiles=tag, impl=name, us=us, calls=n,
                           bytes=state_bytes[name] * s * STATE_BYTES)
                if name == "step":
                    o, new = results[name][0][0], results[name][1]
                    row.update(err_o=_rel(o, ref_o), err_state=_rel(new[:s], ref_pool[:s]))
                out.append(row)
                record(row)
                _log(f"step S={s} {tag} {name}: {us:.2f} us")
            if "step" in results and "window+commit" in results:
                exact = _same_bits(results["step"], results["window+commit"])
                alone = ("window R=1" in results and "commit R=1" in results
                         and _same_bits(results["step"][0], results["window R=1"][0])
                         and _same_bits(results["step"][1], results["commit R=1"][1]))
                for row in out:
                    if row["s"] == s and row["tiles"] == tag and row["impl"] == "step":
                        row.update(bits_equal=exact, bits_equal_separate=alone)
                        record(row)
                _log(f"step S={s} {tag}: bits equal to window+commit: {exact}, to window / commit alone: {alone}")
            del results, pool, ref_pool
    for s in streams:
        if time.monotonic() > deadline:
            _log(f"conv step S={s}: skipped, past the time budget")
            continue
        out.extend(_bench_conv_step(s, calls, iters, record))
    return out


def _bench_conv_step(s, calls, iters, record):
    import jax
    import jax.numpy as jnp
    from pallas_kernels import gdn

    n = _step_calls(s, calls)
    w = jax.random.normal(jax.random.key(4), (CONV_DIM, 4), jnp.bfloat16)
    pool = jax.random.normal(jax.random.key(5), (n * s, 3, CONV_DIM), jnp.bfloat16)
    m = (jax.random.normal(jax.random.key(6), (s, 1, CONV_DIM), jnp.bfloat16),)
    root = jnp.full((s, 1), -1, jnp.int32)
    one_path, one_len = jnp.zeros((s, 1), jnp.int32), jnp.ones((s,), jnp.int32)
    bodies = {
        "conv_step": lambda r, p, sl: gdn.conv_step(r[0], p, sl, w),
        "conv_window+conv_commit": lambda r, p, sl: _then(
            gdn.conv_window(r[0], root, p, sl, w), p, lambda p2: gdn.conv_commit(r[0], one_path, one_len, p2, sl)),
    }
    out, results = [], {}
    for name, body in bodies.items():
        fn = _chained(body, n)
        results[name] = jax.block_until_ready(fn(m, pool + 0))
        us = _time_chained(fn, m, pool + 0, iters) / n
        row = dict(section="conv_step", s=s, tiles="-", impl=name, us=us, calls=n)
        out.append(row)
        _log(f"conv step S={s} {name}: {us:.2f} us")
    exact = _same_bits(results["conv_step"], results["conv_window+conv_commit"])
    for row in out:
        row.update(bits_equal=exact)
        record(row)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m pallas_kernels.bench gdn")
    ap.add_argument("--t", default="16384,1024,4096,65536", help="prompt lengths, comma-separated; the first "
                    "one runs the tile/precision sweep")
    ap.add_argument("--streams", default="16,4,1", help="the first, with the first --rows, runs the tile sweep")
    ap.add_argument("--rows", default="16,4,1")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--no-sweep", action="store_true",
                    help="time only the shipped tiles (the prompt pass: gdn.prompt_tiles for bf16)")
    ap.add_argument("--prompt-tiles", default=None, help="PromptTiles to time at every T instead of the sweep, "
                    "';'-separated, each 'field=value,...' ('' = the defaults), e.g. ';precision=bf16,"
                    "store_dtype=bfloat16'")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: prompt,verify,conv,step")
    ap.add_argument("--step-streams", default="1,4,16")
    ap.add_argument("--step-tiles", default="16x1,32x2,64x4",
                    help="block_v x num_warps variants of step (and of the window/commit it is compared with)")
    ap.add_argument("--calls", type=int, default=0, help="calls per timed step program; 0 = ~120 MB of state")
    ap.add_argument("--trace", metavar="DIR", default=None,
                    help="also time verify windows and commits from a profiler trace under DIR (the kernels alone, "
                         "no launch gaps), and the copy the floors use")
    ap.add_argument("--json", default=None, help="write the step section's rows here (rewritten after every row)")
    ap.add_argument("--step-budget-s", type=float, default=80.0, help="start no new step measurement after this "
                    "many seconds from the start (compiles dominate: ~1 s per timed program)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    skip = set(filter(None, args.skip.split(",")))

    import jax
    from pallas_kernels.bench.common import copy_bandwidth_tbs, table

    if jax.default_backend() != "gpu" and not INTERPRET:
        # pallas_kernels/bench/__init__.py defaults JAX_PLATFORMS to cpu unless an argument says gpu
        print("gdn bench needs the GPU: run it as `JAX_PLATFORMS=cuda python -m pallas_kernels.bench gdn`",
              file=sys.stderr)
        return 2
    _log(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
    fla = None if args.no_fla else _fla()
    if fla is not None:
        _log(f"fla {fla['version']}, torch {fla['torch'].__version__}")
    global TRACE_DIR
    TRACE_DIR = args.trace
    bw = copy_bandwidth_tbs()
    _log(f"copy bandwidth {bw:.2f} TB/s (synchronised calls)")
    if TRACE_DIR:  # the floors of the kernels-alone column: the copy timed the same way
        bw_alone = copy_bandwidth_tbs(1 << 30, trace_dir=TRACE_DIR)
        _log(f"copy bandwidth {bw_alone:.2f} TB/s (kernel alone, traced)")
    sweep = not args.no_sweep
    recorded: list[dict] = []

    def record(row):
        if row not in recorded:
            recorded.append(row)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(device=jax.devices()[0].device_kind, copy_tbs=bw, rows=recorded), f, indent=1)

    step_rows = [] if "step" in skip else bench_step(
        [int(x) for x in args.step_streams.split(",")], _parse_tiles(args.step_tiles), args.calls, args.iters,
        record, t0 + args.step_budget_s)
    prompt_rows, stage_rows = ([], []) if "prompt" in skip else bench_prompt(
        [int(x) for x in args.t.split(",")], fla, sweep, args.iters,
        None if args.prompt_tiles is None else _parse_prompt_tiles(args.prompt_tiles))
    verify_rows = [] if "verify" in skip else bench_verify(
        [int(x) for x in args.streams.split(",")], [int(x) for x in args.rows.split(",")], fla, sweep, args.iters)
    for row in verify_rows:
        record(row)
    conv_rows = [] if "conv" in skip else bench_conv(args.iters)

    if prompt_rows:
        fla_us = {r["t"]: r["us"] for r in prompt_rows if r["impl"].startswith("fla")}
        _log("\nPrompt pass, one stream, one GDN layer (ratio = fla time / this time; > 1 is faster than fla)")
        _log(table(["T", "impl", "µs", "Mtok/s", "ratio vs fla", "rel err o", "rel err state"],
                   [[r["t"], r["impl"], r["us"], r["t"] / r["us"], (fla_us[r["t"]] / r["us"]) if r["t"] in fla_us
                     else "-", f"{r['err_o']:.1e}", f"{r['err_state']:.1e}"] for r in prompt_rows]))
    if stage_rows:
        _log("\nPrompt pass by launch (each launch timed alone)")
        _log(table(["T", "setting", "prep µs", "state µs", "output µs"],
                   [[t, _cfg_name(cfg)]
                    + [next(r["us"] for r in stage_rows if (r["t"], r["cfg"]) == (t, cfg) and r["stage"] == st)
                       for st in ("prep", "state", "output")]
                    for t, cfg in dict.fromkeys((r["t"], r["cfg"]) for r in stage_rows)]))
    if verify_rows:
        _log(f"\nVerify window (chain unless 'tree') and commit; state traffic = S x 3.1 MB (window), x2 (commit);"
             f" floor at {bw:.2f} TB/s")
        _log(table(["S", "R", "impl", "µs", "GB/s", "x floor", "rel err"],
                   [[r["s"], r["r"], r["impl"], r["us"], r["bytes"] / r["us"] / 1e3,
                     r["us"] / (r["bytes"] / (bw * 1e12) * 1e6), f"{r['err']:.1e}"] for r in verify_rows]))
        alone = [r for r in verify_rows if not math.isnan(r.get("alone_us", math.nan))]
        if alone:
            _log(f"\nThe same, kernels alone (profiler trace); floor at the traced copy, {bw_alone:.2f} TB/s")
            _log(table(["S", "R", "impl", "µs alone", "GB/s", "x floor"],
                       [[r["s"], r["r"], r["impl"], r["alone_us"], r["bytes"] / r["alone_us"] / 1e3,
                         r["alone_us"] / (r["bytes"] / (bw_alone * 1e12) * 1e6)] for r in alone]))
    if step_rows:
        gdn_rows = [r for r in step_rows if r["section"] == "step"]
        _log(f"\nSerial decode step, one GDN layer: state traffic = S x 3.1 MB x (1 window, 2 commit or step, 3 "
             f"window+commit); floor of each row at {bw:.2f} TB/s; bits = step's output and pool equal to "
             f"window+commit's")
        _log(table(["S", "tiles", "impl", "calls", "µs", "GB/s", "x floor", "bits", "rel err o / state"],
                   [[r["s"], r["tiles"], r["impl"], r["calls"], r["us"], r["bytes"] / r["us"] / 1e3,
                     r["us"] / (r["bytes"] / (bw * 1e12) * 1e6), r.get("bits_equal", "-"),
                     f"{r['err_o']:.1e} / {r['err_state']:.1e}" if "err_o" in r else "-"] for r in gdn_rows]))
        summary = []
        for key in dict.fromkeys((r["s"], r["tiles"]) for r in gdn_rows):
            by = {r["impl"]: r["us"] for r in gdn_rows if (r["s"], r["tiles"]) == key}
            if "step" in by and "window+commit" in by:
                floor = 2 * key[0] * STATE_BYTES / (bw * 1e12) * 1e6
                summary.append([*key, by["step"], by["window+commit"], by["window+commit"] / by["step"],
                                by["step"] / floor])
        _log("\nStep vs window+commit (per layer; x 48 GDN layers per decode step of the 27B)")
        _log(table(["S", "tiles", "step µs", "window+commit µs", "speedup", "step x floor"], summary))
        conv = [r for r in step_rows if r["section"] == "conv_step"]
        _log(f"\nConv step (plain jnp), conv_dim = {CONV_DIM}, bf16 history")
        _log(table(["S", "impl", "calls", "µs", "bits"], [[r["s"], r["impl"], r["calls"], r["us"],
                                                          r["bits_equal"]] for r in conv]))
    if conv_rows:
        _log("\nConv entry points (plain jnp through XLA), 27B conv_dim = 10240, bf16")
        _log(table(["op", "µs", "GB/s"], [[r["op"], r["us"], r["bytes"] / r["us"] / 1e3] for r in conv_rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
