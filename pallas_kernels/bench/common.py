"""Timing helpers shared by the kernel benchmarks (GPU; medians after warm-up, inputs rotated)."""

from __future__ import annotations

import statistics
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


def copy_bandwidth_tbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written) measured now, in TB/s."""
    import jax.numpy as jnp
    n = nbytes // 4
    xs = [jax.random.normal(jax.random.key(i), (n,), jnp.float32) for i in range(2)]
    copy = jax.jit(lambda x: x + 1.0)
    us = time_us(copy, [(x,) for x in xs], warmup=3, iters=20)
    return 2 * nbytes / (us * 1e-6) / 1e12


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(map(str, headers))] + [[f"{c:.2f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [" | ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)
