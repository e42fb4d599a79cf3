"""Group-quantized matmul (MLX affine, 4/8-bit): y[M, N] = x[M, K] @ dequantize(w)[N, K]^T.

Letters: m rows of x (tokens), n output features, k input features, g groups along k.
`reference()` is the plain-jnp definition every kernel here must match; it dequantizes the whole weight (fine for
tests and tiny models, slow at the 27B's shapes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.qweight import QuantizedWeight, dequantize, dequantize_rows


def _validate(x: jax.Array, w: QuantizedWeight) -> None:
    w.validate()
    if x.ndim != 2:
        raise ValueError(f"qmm: x must be [M, K], got shape {x.shape}")
    if x.shape[1] != w.in_features:
        raise ValueError(f"qmm: x has K={x.shape[1]} but the weight takes K={w.in_features}")
    if x.dtype not in (jnp.bfloat16, jnp.float32, jnp.float16):
        raise ValueError(f"qmm: x dtype {x.dtype} not supported (bfloat16, float16 or float32)")


def reference(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x [M, K] (bf16/fp16/fp32), w packed [N, K] -> y [M, N] in x.dtype, fp32 accumulation."""
    _validate(x, w)
    deq = dequantize(w, jnp.float32)
    y = jnp.dot(x.astype(jnp.float32), deq.T, precision=jax.lax.Precision.HIGHEST,
                preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def qmm(x: jax.Array, w: QuantizedWeight, *, interpret: bool = False) -> jax.Array:
    """The public entry point: x [M, K] -> y [M, N]. Until the Pallas kernel lands this is the reference."""
    del interpret
    return reference(x, w)


def embed_reference(w: QuantizedWeight, ids: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Quantized embedding gather: ids int [...] -> [..., K] rows of the dequantized table."""
    return dequantize_rows(w, ids, dtype)


def embed(w: QuantizedWeight, ids: jax.Array, dtype=jnp.float32, *, interpret: bool = False) -> jax.Array:
    del interpret
    return embed_reference(w, ids, dtype)
