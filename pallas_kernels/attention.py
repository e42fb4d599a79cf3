"""Paged attention for verify windows (trees and chains) and prompt chunks, over a bf16/fp32 or fp8 KV pool.

Letters: s streams, t/r query rows, h query heads, g KV heads, d head dim, l key positions.
Query head h reads KV head h // (Hq/Hkv). Softmax in fp32. Queries q [S, T, Hq, D] arrive after q-norm and RoPE.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kv_quant import KVPool, as_stored, gather_stream

_HI = jax.lax.Precision.HIGHEST


def _attend(q: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """q [T, Hq, D]; keys/values [L, Hkv, D] fp32; mask [T, L] bool -> [T, Hq, D] fp32."""
    hq, hkv = q.shape[1], keys.shape[1]
    qg = q.astype(jnp.float32).reshape(q.shape[0], hkv, hq // hkv, q.shape[2])
    logits = jnp.einsum("tgqd,lgd->tgql", qg, keys, precision=_HI) * scale
    logits = jnp.where(mask[:, None, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("tgql,lgd->tgqd", p, values, precision=_HI) / jnp.where(denom > 0, denom, 1.0)
    return out.reshape(q.shape[0], hq, q.shape[2])


def prompt_reference(q: jax.Array, pool: KVPool, page_table: jax.Array, start: jax.Array, lengths: jax.Array,
                     *, scale: float) -> jax.Array:
    """Causal attention for prompt rows over the cached prefix plus the rows themselves (already written).

    q [S, T, Hq, D]; page_table [S, Pmax]; start [S] absolute position of row 0; lengths [S] real rows
    -> o [S, T, Hq, D] in q.dtype (rows past lengths are zeros)
    """
    t = q.shape[1]

    def one(q_s, pt, st, n):
        keys, values = gather_stream(pool, pt)
        qpos = st + jnp.arange(t)
        kpos = jnp.arange(keys.shape[0])
        mask = (kpos[None, :] <= qpos[:, None]) & (jnp.arange(t) < n)[:, None]
        return _attend(q_s, keys, values, mask, scale)

    return jax.vmap(one)(q, page_table, start, lengths).astype(q.dtype)


def ancestors(parents: jax.Array) -> jax.Array:
    """parents [R] (-1 = root's parent; parents[r] < r) -> [R, R] bool: j is r itself or an ancestor of r."""
    r = parents.shape[0]
    anc = jnp.eye(r, dtype=bool)
    for i in range(r):  # rows in order: a node's ancestor set is its parent's plus itself
        par = parents[i]
        inherited = jnp.where(par >= 0, anc[jnp.maximum(par, 0)], False)
        anc = anc.at[i].set(anc[i] | inherited)
    return anc


def window_reference(q: jax.Array, k_win: jax.Array, v_win: jax.Array, parents: jax.Array, pool: KVPool,
                     page_table: jax.Array, cache_len: jax.Array, *, scale: float) -> jax.Array:
    """Each window row attends to its stream's committed keys (positions < cache_len) plus its own
    root-to-node path in the window. The window's own rows are used as the pool will store them (fp8: quantized
    then dequantized), so a drafted row sees exactly what a serial step would.

    q [S, R, Hq, D]; k_win, v_win [S, R, Hkv, D]; parents [S, R]; page_table [S, Pmax]; cache_len [S]
    -> o [S, R, Hq, D] in q.dtype
    """
    def one(q_s, kw, vw, par, pt, n):
        keys, values = gather_stream(pool, pt)
        mask_c = jnp.broadcast_to(jnp.arange(keys.shape[0])[None, :] < n, (q_s.shape[0], keys.shape[0]))
        mask_w = ancestors(par)
        keys = jnp.concatenate([keys, as_stored(kw, pool)], axis=0)
        values = jnp.concatenate([values, as_stored(vw, pool)], axis=0)
        return _attend(q_s, keys, values, jnp.concatenate([mask_c, mask_w], axis=1), scale)

    return jax.vmap(one)(q, k_win, v_win, parents, page_table, cache_len).astype(q.dtype)
