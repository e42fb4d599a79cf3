"""Which merge launch choices keep a 16-row window's bits, compiled? A probe, not a test.

For pools and pass 1s (bf16 over the Mosaic GPU pass 1 or the Triton one, fp8 with f16 or bf16 dots) it runs a
16-row tree window at the 27B shape (4 streams, contexts 0 / 100 / 1537 / 2560, and 1 stream at 19000 keys of a 32K
table) with the merge's rows whole and its loads in a loop (the reference), then with each of the merge's other
launch choices (rows a program, early or loop loads, head-dim columns), and prints how many output elements differ
from the reference.

`--sums` (session 26) instead runs 16-row tree windows at 4 streams over three draws of the inputs, for bf16 over
the Mosaic GPU pass 1 and fp8 with f16 or bf16 dots, with the merge's window-key sum in key order (shipped,
`attention._window_key_sum`) and as a plain sum over the columns (its order the register layout's, as before
session 26), and prints the changed outputs of each of the merge's row and column splits against its rows whole.

    python tools/gpu/merge_rows_probe.py [--sums]
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import attention as at
from pallas_kernels import kv_quant as kq
from tests.test_attention import BIG, TREE, window_case

VARIANTS = [(128, "early", None), (64, "loop", None), (32, "loop", None), (32, "early", None), (16, "early", None),
            (128, "loop", 64), (32, "loop", 64)]


def main() -> None:
    rng = np.random.default_rng(37)
    tree16 = TREE + list(range(6, 15))
    cases = {
        "4 streams": dict(s=4, pmax=40, num_pages=200, cache_lens=[0, 100, 1537, 2560], parents=[tree16] * 4),
        "1 stream 19000": dict(s=1, pmax=512, num_pages=520, cache_lens=[19000], parents=[tree16]),
    }
    configs = {"bf16 mgpu": (jnp.bfloat16, "bfloat16", True), "fp8 f16 dots": (kq.FP8, "float16", False),
               "fp8 bf16 dots": (kq.FP8, "bfloat16", False), "bf16 triton": (jnp.bfloat16, "bfloat16", False)}
    for name, label in (("4 streams", "fp8 bf16 dots"), ("4 streams", "bf16 mgpu"), ("1 stream 19000", "bf16 mgpu"),
                        ("1 stream 19000", "fp8 f16 dots"), ("4 streams", "fp8 f16 dots"),
                        ("4 streams", "bf16 triton")):
        shape = cases[name]
        dtype, fp8_dot, mgpu = configs[label]
        case = window_case(rng, r=16, dtype=dtype, **dict(BIG, **shape))
        pool = case[4]
        max_keys = shape["pmax"] * 64
        tiles = (at.model_window_tiles(jnp.bfloat16, pool, 24, max_keys=max_keys, interpret=False) if mgpu
                 else dataclasses.replace(at.window_tiles(page_size=64, max_keys=max_keys, head_dim=256,
                                                          fp8=pool.fp8), fp8_dot=fp8_dot))

        def run(**change):
            fn = jax.jit(functools.partial(at.window, scale=1 / 16, interpret=False,
                                           tiles=dataclasses.replace(tiles, **change)))
            return np.asarray(fn(*case)).view(np.uint16)

        want = run(merge_block_rows=128, merge_loads="loop")
        cells = []
        for rows, loads, bd in VARIANTS:
            try:
                got = run(merge_block_rows=rows, merge_loads=loads, merge_block_d=bd)
                cells.append(f"{rows}/{loads}/{bd or 'rule'}: {int((got != want).sum())}")
            except Exception as e:  # noqa: BLE001 - a probe reports and goes on
                cells.append(f"{rows}/{loads}/{bd or 'rule'}: {type(e).__name__}")
        print(f"{name}, {label}: " + "; ".join(cells), flush=True)


def lane_sum(p, r):
    """The merge's window-key sum before session 26: a sum over the columns, in the register layout's order."""
    del r
    return jnp.sum(p, axis=1)


def sums() -> None:
    tree16 = TREE + list(range(6, 15))
    configs = {"bf16 mgpu": (jnp.bfloat16, "bfloat16", True), "fp8 f16 dots": (kq.FP8, "float16", False),
               "fp8 bf16 dots": (kq.FP8, "bfloat16", False)}
    splits = [dict(merge_block_rows=16), dict(merge_block_rows=32), dict(merge_block_d=64),
              dict(merge_block_rows=32, merge_block_d=32)]
    ordered = at._window_key_sum
    for label, (dtype, fp8_dot, mgpu) in configs.items():
        rng = np.random.default_rng(41)
        cases = [window_case(rng, r=16, dtype=dtype, **dict(BIG, s=4, pmax=40, num_pages=200,
                                                            cache_lens=[0, 100, 1537, 2560],
                                                            parents=[tree16, list(range(-1, 15))] * 2))
                 for _ in range(3)]
        pool = cases[0][4]
        tiles = (at.model_window_tiles(jnp.bfloat16, pool, 24, max_keys=40 * 64, interpret=False) if mgpu
                 else dataclasses.replace(at.window_tiles(page_size=64, max_keys=40 * 64, head_dim=256,
                                                          fp8=pool.fp8), fp8_dot=fp8_dot))
        for sum_name, fn in (("key order", ordered), ("lanes", lane_sum)):
            at._window_key_sum = fn  # read at tracing: each run traces anew

            def run(**change):
                call = jax.jit(functools.partial(at.window, scale=1 / 16, interpret=False,
                                                 tiles=dataclasses.replace(tiles, **change)))
                return [np.asarray(call(*case)).view(np.uint16) for case in cases]

            want = run(merge_block_rows=128)
            cells = []
            for change in splits:
                got = run(**change)
                changed = sum(int((g != w).sum()) for g, w in zip(got, want))
                cells.append(f"{change}: {changed}")
            print(f"{label}, sum in {sum_name}, {3 * want[0].size} outputs: " + "; ".join(cells), flush=True)
        at._window_key_sum = ordered


if __name__ == "__main__":
    sums() if "--sums" in sys.argv[1:] else main()
