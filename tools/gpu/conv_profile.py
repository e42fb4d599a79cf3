"""Where the GDN prompt conv's time goes on the device: `gdn.conv_prompt` at T = 4K and the 27B conv width,
traced with JAX's profiler; prints every device kernel's time. (Session 8 traced three forms with it: the
concatenation of history and rows cost 198 µs at 4K in each, the taps 82-148 µs; see gdn._conv_prompt.)

    python3 tools/gpu/conv_profile.py --trace /tmp/conv_trace
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # decode_profile beside this file


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--t", type=int, default=4096)
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    from pallas_kernels import gdn
    from decode_profile import summarize_trace

    c = 10240
    m = jax.random.normal(jax.random.key(0), (1, args.t, c), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (c, 4), jnp.bfloat16)
    pool = jnp.zeros((2, 3, c), jnp.bfloat16)
    call = (m, pool, jnp.array([1]), w, jnp.array([0]), jnp.array([args.t]))
    for name, fn in (("conv_prompt", jax.jit(gdn.conv_prompt)),):
        jax.block_until_ready(fn(*call))
        with jax.profiler.trace(f"{args.trace}/{name}", create_perfetto_trace=True):
            for _ in range(2):
                jax.block_until_ready(fn(*call))
        print(f"== {name}")
        summarize_trace(f"{args.trace}/{name}", 2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
