"""Which computation makes a stream's decode bits depend on how many streams share the call?

`pytest -m gpu tests/test_engine_gpu.py` found (2026-11-30, H200) that a request decoded alone (stream bucket 1)
and among others (bucket 16) gives different logprobs from its second token on, while the same check passes on
CPU with the kernels in interpret mode. This probe narrows it down in one device call:
  1. whole model on captures/tiny-mlx-4bit: stream 0's logits from `step` and its per-layer residuals from
     `verify` (taps) with S = 1 vs S = 16 live streams, bit for bit -> the first layer that differs;
  2. each op of a layer alone, row 0 of a [1, ...] call vs row 0 of a [16, ...] call of the same jitted function;
  3. the norms at the 27B's shapes, XLA's jnp forms vs the pallas_kernels.rownorm kernels, each stream alone vs
     among 16 (does XLA's row reduction depend on the row count?).

    PYTHONPATH=$PWD python3 tools/gpu/rowinv_probe.py            # on the device
    python tools/gpu/rowinv_probe.py --interpret                # CPU smoke run (kernels in interpret mode)
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import qmm, qmm_mgpu, rownorm
from qwen_jax import model as M
from qwen_jax import sampling
from qwen_jax.checkpoint import load_checkpoint
from qwen_jax.model import attention as attn_mixer
from qwen_jax.model import gdn as gdn_mixer
from qwen_jax.model import ops
from qwen_jax.model.layers import mlp

S, PAGES, PAGE = 16, 10, 16


def _same(a, b) -> str:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if np.array_equal(a, b, equal_nan=True):
        return "same"
    return f"DIFF max|d|={np.nanmax(np.abs(a - b)):.3g} at {np.argwhere(a != b)[0].tolist()}"


def whole_model(cfg, params, backend, dtype) -> None:
    t = cfg.text
    prefill = jax.jit(lambda p, s, b: M.prefill(p, s, b, cfg, backend)[:2])
    taps = tuple(range(t.num_layers))
    verify = jax.jit(lambda p, s, w: M.verify(p, s, w, cfg, backend, taps=taps))
    step = jax.jit(lambda p, s, w: M.step(p, s, w, cfg, backend))
    state = M.init_state(t, num_slots=S + 1, num_pages=S * PAGES + 1, page_size=PAGE, dtype=dtype)
    tables = np.arange(1, S * PAGES + 1, dtype=np.int32).reshape(S, PAGES)
    lens = [20 + 5 * i for i in range(S)]
    rng = np.random.default_rng(0)
    for i, n in enumerate(lens):  # every prompt alone, so the states are the same whatever the decode bucket
        toks = rng.integers(0, t.vocab_size, size=n)
        state = prefill(params, state, M.make_prefill_batch(toks[None], [0], [n], [i + 1], tables[i:i + 1]))[1]
    nxt = rng.integers(0, t.vocab_size, size=S)

    def window(s):
        return M.make_window(nxt[:s, None], [[-1]] * s, lens[:s], list(range(1, s + 1)), tables[:s])

    l1, _, taps1 = verify(params, state, window(1))
    l16, _, taps16 = verify(params, state, window(S))
    print(f"verify logits, stream 0, S=1 vs S={S}: {_same(l1[0], l16[0])}")
    first = next((i for i in range(t.num_layers) if not np.array_equal(np.asarray(taps1[0, :, i]),
                                                                        np.asarray(taps16[0, :, i]))), None)
    print(f"verify residual taps: first differing layer = {first}"
          + ("" if first is None else f" ({t.layer_types[first]})"))
    s1, _ = step(params, jax.tree.map(jnp.copy, state), window(1))
    s16, _ = step(params, jax.tree.map(jnp.copy, state), window(S))
    print(f"step logits, stream 0, S=1 vs S={S}: {_same(s1[0], s16[0])}")
    again = [np.array_equal(np.asarray(verify(params, state, window(S))[0]), np.asarray(l16)) for _ in range(10)]
    print(f"verify logits, S={S}, repeated: same {sum(again)}/10")


def ops_alone(cfg, params, backend, dtype) -> None:
    norms_at_27b_widths(backend, dtype)  # first: they need nothing from the checkpoint
    t = cfg.text
    rng = np.random.default_rng(1)
    h = t.hidden_size
    x = jnp.asarray(rng.standard_normal((S, 1, h)), dtype)
    gi = t.layer_types.index("linear_attention") if "linear_attention" in t.layer_types else None
    ai = t.layer_types.index("full_attention") if "full_attention" in t.layer_types else None
    lay = params["layers"]
    cases = {
        "rms_norm (model)": lambda x: ops.rms_norm(backend, x, lay[0]["input_norm"], t.rms_norm_eps),
        "mlp": lambda x: ops.materialize(backend, mlp(x, lay[0]["mlp"], backend, prompt=False)),
        "lm_head": lambda x: ops.linear(x, params["embed"] if params["lm_head"] is None else params["lm_head"],
                                        backend, prompt=False),
        "log_softmax+logprobs": lambda x: sampling.logprobs(
            ops.linear(x[:, 0], params["embed"] if params["lm_head"] is None else params["lm_head"], backend,
                       prompt=False).astype(jnp.float32), jnp.zeros((x.shape[0],), jnp.int32), 3)[0],
    }
    for name, w in (lay[0]["mlp"].items()):
        w = ops.parts(w)[0]  # a fused projection's one weight
        k = w.in_features if hasattr(w, "in_features") else w.shape[1]
        cases[f"linear mlp.{name}"] = (lambda w, k: lambda x: ops.linear(
            jnp.tile(x, (1, 1, -(-k // h)))[..., :k], w, backend, prompt=False))(w, k)
    if gi is not None:
        pg = lay[gi]["gdn"]
        cases["gdn.project (m)"] = lambda x: gdn_mixer.project(x, pg, backend, prompt=False)[0]
        cases["gdn.project (g)"] = lambda x: gdn_mixer.project(x, pg, backend, prompt=False)[3]
        cases["gdn.split_qkv (q)"] = lambda x: gdn_mixer.split_qkv(
            gdn_mixer.project(x, pg, backend, prompt=False)[0], t, backend)[0]
        zdim = t.value_dim
        cases["gated_rms_norm (model)"] = lambda x: ops.gated_rms_norm(backend,
            jnp.tile(x, (1, 1, -(-zdim // h)))[..., :zdim].reshape(x.shape[0], 1, t.linear_num_value_heads, -1),
            jnp.tile(x, (1, 1, -(-zdim // h)))[..., :zdim].reshape(x.shape[0], 1, t.linear_num_value_heads, -1),
            pg["norm"], t.rms_norm_eps)
    if ai is not None:
        pa = lay[ai]["attn"]
        pos = lambda x: M.forward.text_rope_positions(jnp.full((x.shape[0], 1), 37, jnp.int32))
        cases["attn.project (q)"] = lambda x: attn_mixer.project(x, pa, pos(x), t, backend, prompt=False)[0]
        cases["attn.project (k)"] = lambda x: attn_mixer.project(x, pa, pos(x), t, backend, prompt=False)[2]
    # Beside S=1 vs S=16: the same call twice (a race shows as a repeat that differs) and S=16 with the other rows
    # non-finite or huge (padding streams of a program may carry anything).
    odd = x.at[1::3].set(jnp.nan).at[2::3].set(jnp.inf).at[3::3].set(3e38)
    for name, f in cases.items():
        f = jax.jit(f)
        try:
            alone, full = f(x[:1])[0], f(x)[0]
            again = [np.array_equal(np.asarray(f(x)), np.asarray(f(x)), equal_nan=True) for _ in range(20)]
            print(f"{name:24s} row 0, S=1 vs S={S}: {_same(alone, full)}; repeats same {sum(again)}/20; "
                  f"others non-finite: {_same(alone, f(odd)[0])}")
        except Exception as e:  # keep probing the rest
            print(f"{name:24s} failed: {type(e).__name__}: {str(e)[:200]}")


def norms_at_27b_widths(backend, dtype) -> None:
    """The norms alone at the 27B's shapes, XLA's jnp forms (the references: the model's reference path, the
    suspects) beside the pallas_kernels.rownorm kernels (row order fixed by the width): every stream of S=1 calls vs the same streams
    of one S=16 call, for decode (T=1) and a verify window (T=16). An XLA line that differs where the kernel
    line is the same convicts XLA's row reduction of the norm; fused into the model's program XLA may choose
    otherwise, so whole_model's taps remain the final word."""
    rng = np.random.default_rng(2)
    eps = 1e-6
    shapes = {  # name: (heads or None, width)
        "hidden": (None, 5120), "attn q": (24, 256), "attn k": (4, 256), "gdn q/k": (16, 128), "gdn out": (48, 128)}
    for t in (1, 16):
        for where, (heads, d) in shapes.items():
            lead = (S, t) if heads is None else (S, t, heads)
            x = jnp.asarray(rng.standard_normal((*lead, d)) * 3.0, dtype)
            gate = jnp.asarray(rng.standard_normal((*lead, d)), dtype)
            weight = jnp.asarray(1.0 + 0.1 * rng.standard_normal(d), jnp.float32)
            if where == "gdn q/k":
                pair = {"xla l2norm": lambda x, g: rownorm.l2norm_reference(x),
                        "kernel l2norm": lambda x, g: rownorm.l2norm(x, interpret=backend.interpret)}
            elif where == "gdn out":
                pair = {"xla gated_rms_norm": lambda x, g: rownorm.gated_rms_norm_reference(x, g, weight, eps),
                        "kernel gated_rms_norm": lambda x, g: rownorm.gated_rms_norm(
                            x, g, weight, eps, interpret=backend.interpret)}
            else:
                pair = {"xla rms_norm": lambda x, g: rownorm.rms_norm_reference(x, weight, eps),
                        "kernel rms_norm": lambda x, g: rownorm.rms_norm(x, weight, eps, interpret=backend.interpret)}
            for impl, f in pair.items():
                f = jax.jit(f)
                label = f"{impl} {where} {list(x.shape[2:])} T={t}"
                try:
                    alone = jnp.concatenate([f(x[i:i + 1], gate[i:i + 1]) for i in range(S)])
                    print(f"{label:44s} each stream S=1 vs S={S}: {_same(alone, f(x, gate))}")
                except Exception as e:  # keep probing the rest
                    print(f"{label:44s} failed: {type(e).__name__}: {str(e)[:200]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="captures/tiny-mlx-4bit")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--interpret", action="store_true", help="kernels in interpret mode (CPU smoke run)")
    ap.add_argument("--qmm-decode-impl", choices=qmm.DECODE_IMPLS, default=qmm.DECODE_IMPL,
                    help="the decode qmm (qmm.DECODE_IMPL); mgpu also holds scales and biases transposed")
    ap.add_argument("--only", default=None, metavar="KxN",
                    help="with mgpu: the Mosaic GPU kernel takes only weights of this shape (e.g. 128x512)")
    args = ap.parse_args(argv)
    qmm.DECODE_IMPL = args.qmm_decode_impl
    if args.only:
        k_only, n_only = (int(v) for v in args.only.split("x"))
        takes = qmm_mgpu.supports
        qmm_mgpu.supports = lambda x, w: (w.in_features, w.out_features) == (k_only, n_only) and takes(x, w)
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    backend = M.Backend(kernels=True, interpret=args.interpret)
    ck = load_checkpoint(args.model, dtype=dtype, progress=False)
    params = qmm.decode_layout(ck.params)
    print(f"backend {jax.default_backend()}, {backend}, {args.model} {args.dtype}, qmm decode {qmm.DECODE_IMPL}"
          + (f" (only {args.only})" if args.only else ""))
    whole_model(ck.config, params, backend, dtype)
    ops_alone(ck.config, params, backend, dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
