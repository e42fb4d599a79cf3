"""Does the fused decode step (`model.step`) give the bits of a one-row verify + commit, position after position?

On the tiny 4-bit checkpoint with the Pallas kernels (interpreted on a CPU, compiled on a GPU): a prompt of random
tokens (seeded), then --steps positions, each run both ways from the same state; prints per position whether the
logits and the live slot's state agree. Session 38 found, on the CPU, position 74 of seed 3's 70-token prompt
(tests/test_drafts.py's second prompt, the reply of its seeded request) differing at layer 0: the GDN step's output
against the window's, for the same inputs and state. Called eagerly, the two kernels agree on that input with
XLA_FLAGS=--xla_cpu_max_isa=AVX (no FMA) and not with the machine's AVX2 + FMA; inside the model's programs they
differ either way (XLA:CPU compiles interpreted kernels with the program around them).

    python tools/step_probe.py [--prompt-seed 3] [--steps 8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qwen_jax import model as M  # noqa: E402
from qwen_jax.checkpoint import load_checkpoint  # noqa: E402

# The reply tests/test_drafts.py's seeded request (seed 11) gets after seed 3's prompt, on the CPU.
REPLY = [478, 401, 204, 26, 98, 390, 44, 449, 410, 118, 141, 294]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-seed", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    ck = load_checkpoint(ROOT / "captures" / "tiny-mlx-4bit", dtype=jnp.bfloat16, progress=False)
    cfg, params = ck.config, ck.params
    be = M.Backend(kernels=True, interpret=jax.default_backend() != "gpu")
    prefill = jax.jit(lambda p, s, b: M.prefill(p, s, b, cfg, be)[:2])
    step = jax.jit(lambda p, s, w: M.step(p, s, w, cfg, be))
    verify = jax.jit(lambda p, s, w: M.verify(p, s, w, cfg, be)[:2])
    commit = jax.jit(lambda s, k, w, pa, n: M.commit(s, k, w, pa, n, cfg, be))
    rng = np.random.default_rng(args.prompt_seed)
    rng.integers(0, 500, size=12)  # tests/test_drafts.py's first prompt's draw
    prompt = rng.integers(0, 500, size=70)
    extra = rng.integers(0, 500, size=max(0, args.steps - len(REPLY)))
    toks = np.concatenate([prompt, REPLY, extra])
    table = np.array([[1, 2, 3], [0, 0, 0]], np.int32)
    state = M.init_state(cfg.text, num_slots=3, num_pages=4, page_size=64, dtype=jnp.bfloat16)
    _, state = prefill(params, state, M.make_prefill_batch(toks[None, :64], [0], [64], [1], table[:1]))
    rest = np.concatenate([toks[None, 64:70], np.zeros((1, 58), np.int64)], axis=1)
    _, state = prefill(params, state, M.make_prefill_batch(rest, [64], [6], [1], table[:1]))
    fused = unfused = state
    for j in range(args.steps):
        pos = 70 + j
        w = M.make_window(np.array([[toks[pos]], [0]]), [[-1], [-1]], [pos, 0], [1, 0], table)
        a, fused = step(params, fused, w)
        b, kept = verify(params, unfused, w)
        unfused = commit(unfused, kept, w, jnp.zeros((2, 1), jnp.int32), jnp.asarray([1, 0]))
        same_state = all(np.array_equal(np.asarray(x[1]), np.asarray(y[1]))
                         for x, y in zip(fused.rec + fused.conv, unfused.rec + unfused.conv))
        print(f"position {pos}: logits {'same' if np.array_equal(np.asarray(a[0]), np.asarray(b[0])) else 'DIFFER'}, "
              f"GDN slot state {'same' if same_state else 'DIFFERS'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
