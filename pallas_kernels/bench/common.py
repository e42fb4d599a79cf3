"""Timing helpers shared by the kernel benchmarks (GPU; medians after warm-up, inputs rotated)."""

from __future__ import annotations

import glob
import gzip
import json
import math
import os
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence

import jax


def time_us(fn: Callable[..., object], arg_sets: Sequence[tuple], *, warmup: int = 3, iters: int = 30) -> float:
    """Median wall time in µs of fn(*args), cycling through arg_sets (rotating inputs defeats the L2 cache),
    each call synchronised with block_until_ready."""
    for i in range(warmup):
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
    samples = []
    for i in range(iters):
        args = arg_sets[i % len(arg_sets)]
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def copy_bandwidth_tbs(nbytes: int = 2 << 30, trace_dir: str | None = None) -> float:
    """Device-to-device copy bandwidth (bytes read + written) measured now, in TB/s: from synchronised calls, or
    with trace_dir from the copy kernel's own duration in a profiler trace (`traced_us`)."""
    import jax.numpy as jnp
    n = nbytes // 4
    # two sources to alternate between for the synchronised calls; the traced copy reads one
    xs = [jax.random.normal(jax.random.key(i), (n,), jnp.float32) for i in range(1 if trace_dir else 2)]
    copy = jax.jit(lambda x: x + 1.0)
    if trace_dir:
        us = traced_us(lambda: copy(xs[0]), trace_dir)[0]
    else:
        us = time_us(copy, [(x,) for x in xs], warmup=3, iters=20)
    return 2 * nbytes / (us * 1e-6) / 1e12


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(map(str, headers))] + [[f"{c:.2f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [" | ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def device_events(trace_dir: str) -> list[dict] | None:
    """The device's complete ("X") events of the last perfetto trace jax.profiler wrote under trace_dir (processes
    named like a GPU), or None when there is no trace."""
    files = sorted(glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True))
    if not files:
        return None
    with gzip.open(files[-1], "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["pid"]: e["args"].get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {pid for pid, n in names.items() if "GPU" in n or "gpu" in n or "/device:" in n}
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in device_pids and "dur" in e]


def traced_us(run: Callable[[], object], trace_dir: str, *, per: int = 1, prefix: str = "",
              whole: dict | None = None) -> tuple[float, dict[str, float]]:
    """The device's busy µs of one `run()` (its device events whose names start with `prefix`, summed from a
    jax.profiler trace under trace_dir: the kernels alone, no launch gaps), divided by `per` (the calls a run
    makes); and the same by kernel name (trailing numbers dropped). NaN and {} when the trace has no device events.
    run() is called once untraced first (compilation and warm-up stay out of the trace). whole: a dict given gets
    "busy_us" (every device event of the run, whatever its name) and "span_us" (first start to last end, gaps
    included), each divided by `per`."""
    jax.block_until_ready(run())
    os.makedirs(trace_dir, exist_ok=True)
    where = tempfile.mkdtemp(dir=trace_dir)
    with jax.profiler.trace(where, create_perfetto_trace=True):
        jax.block_until_ready(run())
    every = device_events(where) or []
    events = [e for e in every if e["name"].startswith(prefix)]
    shutil.rmtree(where, ignore_errors=True)
    if whole is not None and every:
        whole["busy_us"] = sum(float(e["dur"]) for e in every) / per
        whole["span_us"] = (max(float(e["ts"]) + float(e["dur"]) for e in every)
                            - min(float(e["ts"]) for e in every)) / per
    by_name: dict[str, float] = {}
    for e in events:
        name = re.sub(r"[_.]?\d+$", "", e["name"])
        by_name[name] = by_name.get(name, 0.0) + float(e["dur"]) / per
    return (sum(by_name.values()) if events else math.nan), by_name
