"""The paged KV pool and its fp8 (e4m3) quantize-on-write.

Pool layout per attention layer (Hkv KV heads, P pages of `page_size` rows, head dim D):
    k, v        [Hkv, P, page_size, D]   bf16/fp32, or float8_e4m3fn
    k_scale, v_scale [Hkv, P, page_size] fp32 (fp8 pools only): one scale per (position, KV head) = amax / 448
A stream's page table [Pmax] int32 maps its logical page i (positions i*page_size ...) to a physical page.
Page 0 is the engine's dummy page: padding rows write there and nothing reads it as a real key.
A key's stored bits depend only on that key, never on the window, drafts or batching.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPool:
    k: jax.Array  # [Hkv, P, page_size, D]
    v: jax.Array  # [Hkv, P, page_size, D]
    k_scale: jax.Array | None = None  # [Hkv, P, page_size] fp32 when fp8
    v_scale: jax.Array | None = None

    @property
    def fp8(self) -> bool:
        return self.k.dtype == FP8

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]


def empty_pool(num_kv_heads: int, num_pages: int, page_size: int, head_dim: int, dtype) -> KVPool:
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    if jnp.dtype(dtype) == jnp.dtype(FP8):
        z = jnp.zeros(shape[:3], jnp.float32)
        return KVPool(jnp.zeros(shape, FP8), jnp.zeros(shape, FP8), z, z)
    return KVPool(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def quantize_reference(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (e4m3 codes [..., D], fp32 scale [...]) with scale = amax / 448 (x / scale, round to
    nearest even; an all-zero row gets scale 0 and zero codes)."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scale = amax / FP8_MAX
    safe = jnp.where(scale > 0, scale, 1.0)
    codes = jnp.where(scale[..., None] > 0, xf / safe[..., None], 0.0).astype(FP8)
    return codes, scale


def dequantize_reference(codes: jax.Array, scale: jax.Array) -> jax.Array:
    return codes.astype(jnp.float32) * scale[..., None]


def as_stored(x: jax.Array, pool: KVPool) -> jax.Array:
    """The values a key/value row will have once written to `pool`, in fp32 (quantize-dequantize for fp8)."""
    if pool.fp8:
        return dequantize_reference(*quantize_reference(x))
    return x.astype(pool.k.dtype).astype(jnp.float32)


def _slots(page_table: jax.Array, positions: jax.Array, valid: jax.Array, page_size: int
           ) -> tuple[jax.Array, jax.Array]:
    """(physical page, row in page) per position; invalid rows go to page 0, row 0 (the dummy page)."""
    logical = positions // page_size
    page = jnp.take_along_axis(page_table, jnp.clip(logical, 0, page_table.shape[1] - 1), axis=1)
    page = jnp.where(valid, page, 0)
    row = jnp.where(valid, positions % page_size, 0)
    return page, row


def write_reference(pool: KVPool, k_new: jax.Array, v_new: jax.Array, page_table: jax.Array,
                    positions: jax.Array, valid: jax.Array) -> KVPool:
    """Write rows in place at their absolute positions.

    k_new, v_new [S, T, Hkv, D]; page_table [S, Pmax] int32; positions [S, T] int32; valid [S, T] bool
    -> pool with those rows stored (fp8 pools: quantized, scales written beside them)
    """
    page, row = _slots(page_table, positions, valid, pool.page_size)
    p, r = page.reshape(-1), row.reshape(-1)
    hkv, d = k_new.shape[2], k_new.shape[3]
    # Invalid rows all land on the dummy page's row 0; their values are irrelevant.
    kf = jnp.moveaxis(k_new.reshape(-1, hkv, d), 1, 0)  # [Hkv, S*T, D]
    vf = jnp.moveaxis(v_new.reshape(-1, hkv, d), 1, 0)
    if pool.fp8:
        kc, ks = quantize_reference(kf)
        vc, vs = quantize_reference(vf)
        return KVPool(pool.k.at[:, p, r].set(kc), pool.v.at[:, p, r].set(vc),
                      pool.k_scale.at[:, p, r].set(ks), pool.v_scale.at[:, p, r].set(vs))
    return KVPool(pool.k.at[:, p, r].set(kf.astype(pool.k.dtype)), pool.v.at[:, p, r].set(vf.astype(pool.v.dtype)))


def write(pool: KVPool, k_new: jax.Array, v_new: jax.Array, page_table: jax.Array, positions: jax.Array,
          valid: jax.Array, *, interpret: bool = False) -> KVPool:
    del interpret
    return write_reference(pool, k_new, v_new, page_table, positions, valid)


def gather_stream(pool: KVPool, page_table: jax.Array) -> tuple[jax.Array, jax.Array]:
    """All of a stream's pages in logical order, fp32: page_table [Pmax] -> (k, v) [Pmax*page, Hkv, D]."""
    def one(x, scale):
        rows = x[:, page_table]  # [Hkv, Pmax, page, D]
        rows = rows.astype(jnp.float32)
        if scale is not None:
            rows = rows * scale[:, page_table][..., None]
        hkv, pm, ps, d = rows.shape
        return jnp.moveaxis(rows.reshape(hkv, pm * ps, d), 0, 1)
    return one(pool.k, pool.k_scale), one(pool.v, pool.v_scale)
