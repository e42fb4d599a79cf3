"""How far an fp8 pool's window attention would move if both MMAs read e4m3 operands as stored (no conversion of
the codes to bf16/f16), against what ships (f16 dots over the codes widened, V's scales relative to the chunk's
max). A numpy model of the arithmetic, run on the CPU: no kernel, no device.

The e4m3 way (docs/kernels/attention.md, session 36): q of a row is scaled by a power of two so its largest entry
is at most 448, then split into two e4m3 parts (hi = e4m3(q), lo = e4m3(q - hi)); S = (hi + lo) . codes in fp32
(each e4m3 x e4m3 product is exact in fp32), times the key's scale. P' = P x vs / max(vs) lies in [0, 1]; it is
scaled by 2^8 and split the same way (or kept as one part: "P one part"), O = P' . codes / 2^8 x max(vs) / l.

Each figure is the largest |o - o64| over a row's outputs divided by the row's largest |o64|, the worst row of
the draw, where o64 is float64 attention over the same stored values (codes x scales). "storage" is the float64
attention over the stored values against the float64 attention over the unquantized keys and values: what fp8
storage itself costs, which the arithmetic should stay well below. bf16 ships next to it as a yardstick: bf16 q,
keys and values, fp32 softmax, bf16 dots (the bf16 pool's window), against float64 over those bf16 values.

    python tools/offline/fp8_mma_numerics.py [--contexts 512,4096,32768] [--draws 3]
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn
E4M3_MAX = 448.0
D = 256
ROWS = 6  # one KV head's query heads in a 1-row window
SCALE = D ** -0.5


def e4m3(x: np.ndarray) -> np.ndarray:
    """x rounded to e4m3 (nearest even), as float32; |x| must not pass 448."""
    assert np.all(np.abs(x) <= E4M3_MAX), float(np.abs(x).max())
    return x.astype(np.float32).astype(E4M3).astype(np.float32)


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of x -> (e4m3 codes as float32, fp32 scale = amax / 448), as the pool stores them."""
    scale = (np.abs(x).max(-1) / np.float32(E4M3_MAX)).astype(np.float32)
    safe = np.where(scale > 0, scale, 1).astype(np.float32)
    return e4m3(np.clip(x / safe[:, None], -E4M3_MAX, E4M3_MAX)), scale


def split(x: np.ndarray, parts: int) -> list[np.ndarray]:
    """x (already within e4m3's range) as `parts` e4m3 values summing to about x."""
    out, rest = [], x.astype(np.float32)
    for _ in range(parts):
        p = e4m3(rest)
        out.append(p)
        rest = (rest - p).astype(np.float32)
    return out


def pow2_row_scale(x: np.ndarray, top: float) -> np.ndarray:
    """Per row the power of two that brings the row's largest |x| to at most `top` (as large as it can)."""
    amax = np.maximum(np.abs(x).max(-1), np.finfo(np.float32).tiny)
    return np.exp2(np.floor(np.log2(top / amax))).astype(np.float32)


def softmax64(q, k, v):
    s = (q.astype(np.float64) @ k.astype(np.float64).T) * SCALE
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p @ v.astype(np.float64)) / p.sum(-1, keepdims=True)


def shipped_fp8(q, kc, ks, vc, vs):
    """The shipped fp8 window: f16 dots over the codes, fp32 sums; V's scales relative to the context's max."""
    f16 = lambda a: a.astype(np.float16).astype(np.float32)
    s = (f16(q) @ kc.T) * ks[None, :] * np.float32(SCALE)
    p = np.exp(s - s.max(-1, keepdims=True)).astype(np.float32)
    vmax = vs.max()
    o = f16(p * (vs / vmax)[None, :]) @ vc
    return o * vmax / p.sum(-1, keepdims=True)


def e4m3_mma(q, kc, ks, vc, vs, *, q_parts: int, p_parts: int):
    """Both MMAs on e4m3 operands: q and P' split into parts (module docstring)."""
    qs = pow2_row_scale(q, E4M3_MAX)
    s = sum(part @ kc.T for part in split(q * qs[:, None], q_parts)) / qs[:, None]
    s = s * ks[None, :] * np.float32(SCALE)
    p = np.exp(s - s.max(-1, keepdims=True)).astype(np.float32)
    vmax = vs.max()
    pv = p * (vs / vmax)[None, :] * np.float32(256)
    o = sum(part @ vc for part in split(pv, p_parts)) / np.float32(256)
    return o * vmax / p.sum(-1, keepdims=True)


def bf16_window(q, k, v):
    b = lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32)
    s = (b(q) @ b(k).T) * np.float32(SCALE)
    p = np.exp(s - s.max(-1, keepdims=True)).astype(np.float32)
    return (b(p) @ b(v)) / p.sum(-1, keepdims=True)


def worst_rel(got: np.ndarray, want: np.ndarray) -> float:
    return float((np.abs(got - want).max(-1) / np.abs(want).max(-1)).max())


def draw(rng, n: int, kind: str):
    """q [ROWS, D], keys and values [n, D]. "normal": unit normals. "outliers": a few channels 20x larger in the
    keys, values whose magnitude varies 1000x across keys, and q sharp enough that a handful of keys dominate."""
    q = rng.standard_normal((ROWS, D)).astype(np.float32)
    k = rng.standard_normal((n, D)).astype(np.float32)
    v = rng.standard_normal((n, D)).astype(np.float32)
    if kind == "outliers":
        k[:, rng.choice(D, 4, replace=False)] *= 20
        v *= np.exp(rng.uniform(np.log(1e-3), 0, (n, 1))).astype(np.float32)
        q *= 3
    q = q.astype(ml_dtypes.bfloat16).astype(np.float32)  # the model's q is bf16
    return q, k, v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="512,4096,32768")
    ap.add_argument("--draws", type=int, default=3)
    args = ap.parse_args()
    ways = (("shipped (f16 dots)", lambda *a: shipped_fp8(*a)),
            ("e4m3, q 2 parts, P 2 parts", lambda *a: e4m3_mma(*a, q_parts=2, p_parts=2)),
            ("e4m3, q 2 parts, P one part", lambda *a: e4m3_mma(*a, q_parts=2, p_parts=1)),
            ("e4m3, q one part, P one part", lambda *a: e4m3_mma(*a, q_parts=1, p_parts=1)))
    print("worst row's max |o - o64| / max |o64| over the draws (o64: float64 over the stored fp8 values)")
    head = ["kind", "context", "storage", "bf16 pool"] + [name for name, _ in ways]
    print(" | ".join(head))
    for kind in ("normal", "outliers"):
        for n in [int(c) for c in args.contexts.split(",")]:
            worst = np.zeros(len(head) - 2)
            for i in range(args.draws):
                rng = np.random.default_rng(1000 * i + n)
                q, k, v = draw(rng, n, kind)
                (kc, ks), (vc, vs) = quantize(k), quantize(v)
                want = softmax64(q, kc * ks[:, None], vc * vs[:, None])
                row = [worst_rel(want, softmax64(q, k, v)),
                       worst_rel(bf16_window(q, k, v),
                                 softmax64(q, *(a.astype(ml_dtypes.bfloat16).astype(np.float32) for a in (k, v))))]
                row += [worst_rel(fn(q, kc, ks, vc, vs), want) for _, fn in ways]
                worst = np.maximum(worst, row)
            print(" | ".join([kind, str(n)] + [f"{x:.2e}" for x in worst]), flush=True)


if __name__ == "__main__":
    main()
