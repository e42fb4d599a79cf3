"""The paged KV pool and its fp8 (e4m3) quantize-on-write.

Pool layout per attention layer (Hkv KV heads, P pages of `page_size` rows, head dim D):
    k, v        [Hkv, P, page_size, D]   bf16/fp32, or float8_e4m3fn
    k_scale, v_scale [Hkv, P, page_size] fp32 (fp8 pools only): one scale per (position, KV head) = amax / 448
An fp8 pool may hold v key-major instead (`KVPool.v_layout` "keys": v [Hkv, P, D, page_size], a head dimension's
keys contiguous in a page). P V contracts over the keys, and an 8-bit MMA operand needs its contraction dimension
contiguous: Hopper's ldmatrix has no 8-bit transpose, so over the row layout the Triton pass 1 reads V's codes a
byte at a time (`FP8_V_LAYOUT`). The stored values are the same in either layout.
A stream's page table [Pmax] int32 maps its logical page i (positions i*page_size ...) to a physical page.
Page 0 is the engine's dummy page: nothing reads it as a real key. Rows marked invalid, or whose position falls
outside the page table, are not written at all (an earlier version sent them all to page 0 row 0, a scatter with
duplicate indices whose winner XLA leaves unspecified).
A key's stored bits depend only on that key, never on the window, drafts or batching.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.calls import pallas_call

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0


V_LAYOUTS = ("rows", "keys")
# The layout `empty_pool` gives an fp8 pool's v: "keys" since session 36 (H100, run.sh hundred-forty-third: its gpu
# tests and the engine's fp8 gates pass; with attention.FP8_V_MAX "chunk" the pass 1 is 1.5-29 % faster than "rows",
# the engine's fp8 decode the same, 120.7 / 90.3 forwards/s at 1 / 16 streams against 120.6 / 89.9). The offline sm_90
# compile of the fp8 pass 1 at 32K (`tools/offline/triton_sm90.py --fp8 --v-layout rows|keys`, pip Triton 3.6,
# a lead, not XLA's Triton): a 1-row window's 32-key step is 720 SASS instructions with "rows", 64 of them
# single-byte shared loads of V, at 168 registers; 625 with "keys", no byte loads, at 140 registers. A 16-row
# window's (32-row programs): 1131 at 213 registers against 1034 at 173.
FP8_V_LAYOUT = "keys"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPool:
    k: jax.Array  # [Hkv, P, page_size, D]
    v: jax.Array  # [Hkv, P, page_size, D]; v_layout "keys": [Hkv, P, D, page_size]
    k_scale: jax.Array | None = None  # [Hkv, P, page_size] fp32 when fp8
    v_scale: jax.Array | None = None
    v_layout: str = dataclasses.field(default="rows", metadata=dict(static=True))  # V_LAYOUTS

    @property
    def fp8(self) -> bool:
        return self.k.dtype == FP8

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def keys_major(self) -> bool:
        return self.v_layout == "keys"

    def v_pages(self, pages: jax.Array) -> jax.Array:
        """The pages `pages` (an int array of any shape) of v as rows, [Hkv, *pages.shape, page_size, D], whatever
        its layout: gathered first, so a key-major pool moves only those pages."""
        v = self.v[:, pages]
        return jnp.swapaxes(v, -1, -2) if self.keys_major else v

    def with_arrays(self, k, v, k_scale=None, v_scale=None) -> "KVPool":
        """The same kind of pool (layout kept) over new arrays."""
        return KVPool(k, v, k_scale, v_scale, self.v_layout)


def _check_layout(layout: str, fp8: bool) -> None:
    """ValueError unless `layout` is one of V_LAYOUTS that a pool of this kind may hold."""
    if layout not in V_LAYOUTS:
        raise ValueError(f"v_layout must be one of {V_LAYOUTS}; got {layout!r}")
    if layout == "keys" and not fp8:
        raise ValueError("v_layout 'keys' is for fp8 pools (their 8-bit V codes); bf16 and fp32 pools keep 'rows'")


def _v_shape(k_shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """v's shape in `layout` beside k [Hkv, P, page, D]."""
    return k_shape[:2] + k_shape[:1:-1] if layout == "keys" else k_shape


def with_v_layout(pool: KVPool, layout: str) -> KVPool:
    """pool with v in `layout` (V_LAYOUTS; "keys" for fp8 pools only): the same stored values, moved."""
    _check_layout(layout, pool.fp8)
    if layout == pool.v_layout:
        return pool
    return KVPool(pool.k, jnp.swapaxes(pool.v, 2, 3), pool.k_scale, pool.v_scale, layout)


def empty_pool(num_kv_heads: int, num_pages: int, page_size: int, head_dim: int, dtype,
               v_layout: str | None = None) -> KVPool:
    """Zeroed pool; v_layout (fp8 pools; None: FP8_V_LAYOUT) as `with_v_layout`."""
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    fp8 = jnp.dtype(dtype) == jnp.dtype(FP8)
    layout = (FP8_V_LAYOUT if fp8 else "rows") if v_layout is None else v_layout
    _check_layout(layout, fp8)
    if fp8:
        # Separate buffers for every leaf: programs donate the pool, and one buffer can't be donated twice.
        return KVPool(jnp.zeros(shape, FP8), jnp.zeros(_v_shape(shape, layout), FP8),
                      jnp.zeros(shape[:3], jnp.float32), jnp.zeros(shape[:3], jnp.float32), layout)
    return KVPool(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def _ieee_div(a: jax.Array, b) -> jax.Array:
    """a / b rounded to nearest, as numpy does. XLA rewrites a division by a constant or a broadcast into a
    multiply by the rounded reciprocal, which is an ulp off for about half of all inputs; the barrier hides the
    divisor from that rewrite, and a plain elementwise division is IEEE on XLA's CPU and GPU backends."""
    return a / jax.lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(b, a.dtype), a.shape))


def quantize_reference(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (e4m3 codes [..., D], fp32 scale [...]) with scale = amax / 448 and codes = x / scale, both
    divisions correctly rounded, the codes rounded to nearest even; an all-zero row gets scale 0 and zero codes."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scale = _ieee_div(amax, FP8_MAX)
    safe = jnp.where(scale > 0, scale, 1.0)
    codes = jnp.where(scale[..., None] > 0, _ieee_div(xf, safe[..., None]), 0.0).astype(FP8)
    return codes, scale


def dequantize_reference(codes: jax.Array, scale: jax.Array) -> jax.Array:
    return codes.astype(jnp.float32) * scale[..., None]


def as_stored(x: jax.Array, pool: KVPool) -> jax.Array:
    """The values a key/value row will have once written to `pool`, in fp32 (quantize-dequantize for fp8)."""
    if pool.fp8:
        return dequantize_reference(*quantize_reference(x))
    return x.astype(pool.k.dtype).astype(jnp.float32)


def _slots(page_table: jax.Array, positions: jax.Array, valid: jax.Array, page_size: int, num_pages: int
           ) -> tuple[jax.Array, jax.Array]:
    """(physical page, row in page) per position. Rows that are invalid or fall outside the page table get page
    index num_pages, out of bounds, so a scatter with mode="drop" skips them."""
    logical = positions // page_size
    inside = valid & (positions >= 0) & (logical < page_table.shape[1])
    page = jnp.take_along_axis(page_table, jnp.clip(logical, 0, page_table.shape[1] - 1), axis=1)
    page = jnp.where(inside, page, num_pages)
    row = jnp.where(inside, positions % page_size, 0)
    return page, row


def write_reference(pool: KVPool, k_new: jax.Array, v_new: jax.Array, page_table: jax.Array,
                    positions: jax.Array, valid: jax.Array,
                    prefix: tuple[jax.Array, jax.Array, jax.Array] | None = None, *, share: int = 1) -> KVPool:
    """Write rows in place at their absolute positions.

    k_new, v_new [S, T, Hkv, D]; page_table [S, Pmax] int32; positions [S, T] int32; valid [S, T] bool
    -> pool with those rows stored (fp8 pools: quantized, scales written beside them); invalid rows are skipped.
    prefix (src, dst, rows [S]): first, for each stream, the first `rows` rows of page src copied into page dst,
    codes and scales as stored (a tree window's scratch page takes its stream's committed keys so).
    share: k_new, v_new are [S / share, T, Hkv, D] and stream i writes the rows of k_new[i // share] (a tree
    window's rows each write their ancestors' K/V through a table of their own: the window's rows, not copies).
    """
    if share != 1:
        if not isinstance(share, int) or share < 1 or k_new.shape[0] * share != page_table.shape[0]:
            raise ValueError(f"share={share!r}: k_new holds {k_new.shape[0]} streams, page_table "
                             f"{page_table.shape[0]}")
        k_new, v_new = (jnp.repeat(a, share, axis=0) for a in (k_new, v_new))
    if prefix is not None:
        pool = _copy_prefix_reference(pool, *prefix)
    page, row = _slots(page_table, positions, valid, pool.page_size, pool.num_pages)
    p, r = page.reshape(-1), row.reshape(-1)
    hkv, d = k_new.shape[2], k_new.shape[3]
    kf = jnp.moveaxis(k_new.reshape(-1, hkv, d), 1, 0)  # [Hkv, S*T, D]
    vf = jnp.moveaxis(v_new.reshape(-1, hkv, d), 1, 0)

    def put(dst, val):
        return dst.at[:, p, r].set(val.astype(dst.dtype), mode="drop")

    if pool.fp8:
        kc, ks = quantize_reference(kf)
        vc, vs = quantize_reference(vf)
        # key-major: slot (p, r) is v[:, p, :, r], whose indexed shape puts the rows first
        v = (pool.v.at[:, p, :, r].set(jnp.moveaxis(vc, 1, 0), mode="drop") if pool.keys_major
             else put(pool.v, vc))
        return pool.with_arrays(put(pool.k, kc), v, put(pool.k_scale, ks), put(pool.v_scale, vs))
    return pool.with_arrays(put(pool.k, kf), put(pool.v, vf))


def _copy_prefix_reference(pool: KVPool, src, dst, rows) -> KVPool:
    src, dst = (jnp.clip(jnp.asarray(a, jnp.int32), 0, pool.num_pages - 1) for a in (src, dst))
    keep = jnp.arange(pool.page_size)[None, :] < jnp.asarray(rows, jnp.int32)[:, None]  # [S, page]

    def copy(a, axis):  # the page's rows along `axis` of a [Hkv, P, ...] array
        shape = [1] * a.ndim
        shape[1], shape[axis] = keep.shape
        return a.at[:, dst].set(jnp.where(keep.reshape(shape), a[:, src], a[:, dst]))

    if pool.fp8:
        return pool.with_arrays(copy(pool.k, 2), copy(pool.v, 3 if pool.keys_major else 2), copy(pool.k_scale, 2),
                                copy(pool.v_scale, 2))
    return pool.with_arrays(copy(pool.k, 2), copy(pool.v, 2))


# ----------------------------------------------------------------------------------------------------------------
# Quantize-on-write kernel
# ----------------------------------------------------------------------------------------------------------------

def _kernel_div(a: jax.Array, b: jax.Array, interpret: bool) -> jax.Array:
    """Correctly rounded a / b inside a kernel (same shapes). Triton lowers `/` on f32 to div.full.f32, up to
    two ulps off, so the compiled kernel asks for div.rn.f32; the interpreter runs XLA, where _ieee_div holds."""
    if interpret:
        return _ieee_div(a, b)
    [out] = plgpu.elementwise_inline_asm("div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=r,r,r", pack=1,
                                         result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
    return out


def quantize_in_kernel(x: jax.Array, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """quantize_reference's arithmetic on a value inside a kernel: x [N, D] fp32 -> (codes [N, D] e4m3,
    scale [N] fp32). Every kernel that stores or compares fp8 keys quantizes through here."""
    amax = jnp.max(jnp.abs(x), axis=1)
    scale = _kernel_div(amax, jnp.full_like(amax, FP8_MAX), interpret)
    safe = jnp.where(scale > 0, scale, 1.0)
    codes = jnp.where(scale[:, None] > 0, _kernel_div(x, jnp.broadcast_to(safe[:, None], x.shape), interpret), 0.0)
    return codes.astype(FP8), scale


def _quantize_kernel(x_ref, codes_ref, scale_ref, *, interpret: bool):
    # x_ref [BN, D]; codes_ref [BN, D] e4m3; scale_ref [BN] fp32
    codes, scale = quantize_in_kernel(x_ref[...].astype(jnp.float32), interpret)
    codes_ref[...] = codes
    scale_ref[...] = scale


def quantize(x: jax.Array, *, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Kernel form of quantize_reference, bit for bit: x [..., D] -> (codes [..., D] e4m3, scale [...] fp32).
    For rows that are compared with stored keys before they are written (a verify window's own keys)."""
    lead, d = x.shape[:-1], x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"head dim {d} must be a power of two for the kernel")
    rows = x.reshape(-1, d)
    n = rows.shape[0]
    bn = 16
    n_pad = -(-n // bn) * bn
    rows = jnp.pad(rows, ((0, n_pad - n), (0, 0)))
    codes, scale = pallas_call(
        functools.partial(_quantize_kernel, interpret=interpret),
        grid=(n_pad // bn,),
        in_specs=[pl.BlockSpec((bn, d), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((bn, d), lambda i: (i, 0)), pl.BlockSpec((bn,), lambda i: (i,))],
        out_shape=[jax.ShapeDtypeStruct((n_pad, d), FP8), jax.ShapeDtypeStruct((n_pad,), jnp.float32)],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        name="kv_quantize",
    )(rows)
    return codes[:n].reshape(*lead, d), scale[:n].reshape(lead)


def _write_kernel(page_table_ref, positions_ref, valid_ref, k_new_ref, v_new_ref, *refs,
                  page_size: int, num_pages: int, fp8: bool, keys_major: bool, interpret: bool, prefix: bool):
    # page_table_ref [Pmax] (this stream); positions_ref, valid_ref [T] (this stream); k_new_ref, v_new_ref [D]
    # (this row and KV head); with prefix, then copy_ref [3] (this stream: src page, dst page, rows). refs: the
    # aliased pool inputs (unread), then the outputs, all [Hkv, P, page(, D)] (keys_major: v's [Hkv, P, D, page];
    # the row is a column of its page).
    if prefix:
        copy_ref, *refs = refs
    outs = refs[len(refs) // 2:]
    t, g = pl.program_id(1), pl.program_id(2)
    rows_t = positions_ref.shape[0]
    if prefix:
        # The program past the rows copies the first `rows` rows of page src into page dst (its other rows are
        # the rows' slots, which the other programs write: no slot is written twice).
        @pl.when(t == rows_t)
        def _():
            src, dst = (jnp.clip(copy_ref[i], 0, num_pages - 1) for i in (0, 1))
            keep = jnp.arange(page_size) < copy_ref[2]
            for ref, column in zip(outs, (False, keys_major, False, False)):
                if ref.ndim == 3:  # scales [Hkv, P, page]
                    plgpu.store(ref.at[g, dst, :], ref[g, src, :], mask=keep)
                elif column:
                    plgpu.store(ref.at[g, dst, :, :], ref[g, src, :, :], mask=keep[None, :])
                else:
                    plgpu.store(ref.at[g, dst, :, :], ref[g, src, :, :], mask=keep[:, None])

    tc = jnp.minimum(t, rows_t - 1)
    pos = positions_ref[tc]
    logical = pos // page_size
    inside = (t < rows_t) & (valid_ref[tc] != 0) & (pos >= 0) & (logical < page_table_ref.shape[0])

    @pl.when(inside)
    def _():
        page = page_table_ref[jnp.clip(logical, 0, page_table_ref.shape[0] - 1)]
        row = pos % page_size
        # A corrupt page table must not turn into a write outside the pool.
        page = jnp.clip(page, 0, num_pages - 1)
        for x_ref, dst, scale_dst, column in ((k_new_ref, outs[0], outs[2] if fp8 else None, False),
                                              (v_new_ref, outs[1], outs[3] if fp8 else None, keys_major)):
            x = x_ref[...].astype(jnp.float32)
            if fp8:
                codes, scale = quantize_in_kernel(x[None, :], interpret)
                if column:
                    dst[g, page, :, pl.ds(row, 1)] = codes[0][:, None]
                else:
                    dst[g, page, row, :] = codes[0]
                scale_dst[g, page, pl.ds(row, 1)] = scale
            else:
                dst[g, page, row, :] = x.astype(dst.dtype)


def write(pool: KVPool, k_new: jax.Array, v_new: jax.Array, page_table: jax.Array, positions: jax.Array,
          valid: jax.Array, prefix: tuple[jax.Array, jax.Array, jax.Array] | None = None, *, share: int = 1,
          interpret: bool = False) -> KVPool:
    """Same contract as write_reference, as one Pallas kernel that quantizes (fp8) and stores each row in place.

    The pool arrays are aliased to the outputs: under jit with the pool donated, nothing but the written rows
    moves. Two valid rows aimed at the same slot race; the engine never issues that. prefix: as
    `write_reference`'s, in the same launch (the copied rows and the written slots must not meet). share: as
    `write_reference`'s; stream i's programs read their rows from k_new[i // share] (no broadcast copy).
    """
    s, t, hkv, d = _check_write(pool, k_new, v_new, page_table, positions, valid, share)
    fp8 = pool.fp8
    pool_arrays = [pool.k, pool.v] + ([pool.k_scale, pool.v_scale] if fp8 else [])
    kernel = functools.partial(_write_kernel, page_size=pool.page_size, num_pages=pool.num_pages, fp8=fp8,
                               keys_major=pool.keys_major, interpret=interpret, prefix=prefix is not None)
    whole = [pl.BlockSpec(a.shape, lambda i, j, g, n=a.ndim: (0,) * n) for a in pool_arrays]
    last = t - 1  # the copy program's row blocks: any row's (it reads none of them)
    row_spec = pl.BlockSpec((None, None, None, d), lambda i, j, g: (i // share, jnp.minimum(j, last), g, 0))
    stream_spec = lambda width: pl.BlockSpec((None, width), lambda i, j, g: (i, 0))  # noqa: E731
    copy = []
    if prefix is not None:
        copy = [jnp.stack([jnp.asarray(a, jnp.int32).reshape(s) for a in prefix], axis=1)]  # [S, 3]
    n_in = 5 + len(copy)
    outs = pallas_call(
        kernel,
        grid=(s, t + len(copy), hkv),
        in_specs=([stream_spec(page_table.shape[1]), stream_spec(t), stream_spec(t), row_spec, row_spec]
                  + [stream_spec(3)] * len(copy) + whole),
        out_specs=whole,
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in pool_arrays],
        input_output_aliases={n_in + i: i for i in range(len(pool_arrays))},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        name="kv_write_fp8" if fp8 else "kv_write",
    )(page_table.astype(jnp.int32), positions.astype(jnp.int32), valid.astype(jnp.int32), k_new, v_new, *copy,
      *pool_arrays)
    return pool.with_arrays(*outs)


def _check_write(pool: KVPool, k_new, v_new, page_table, positions, valid, share: int = 1
                 ) -> tuple[int, int, int, int]:
    """-> (S, T, Hkv, D), S page_table's streams (k_new, v_new hold S / share of them)."""
    if k_new.ndim != 4 or k_new.shape != v_new.shape:
        raise ValueError(f"k_new and v_new must both be [S, T, Hkv, D]; got {k_new.shape} and {v_new.shape}")
    if not isinstance(share, int) or share < 1:
        raise ValueError(f"share must be a positive int; got {share!r}")
    s, t, hkv, d = k_new.shape
    s *= share
    if (hkv, d) != (pool.k.shape[0], pool.k.shape[3]):
        raise ValueError(f"rows have Hkv={hkv}, D={d} but the pool holds Hkv={pool.k.shape[0]}, "
                         f"D={pool.k.shape[3]}")
    if d & (d - 1):
        raise ValueError(f"head dim {d} must be a power of two for the kernel")
    if page_table.ndim != 2 or page_table.shape[0] != s:
        raise ValueError(f"page_table must be [S={s}, Pmax] (k_new's {s // share} streams x share {share}); got "
                         f"{page_table.shape}")
    if positions.shape != (s, t) or valid.shape != (s, t):
        raise ValueError(f"positions and valid must be [S, T] = {(s, t)}; got {positions.shape}, {valid.shape}")
    if pool.fp8 and (pool.k_scale is None or pool.v_scale is None):
        raise ValueError("an fp8 pool needs k_scale and v_scale (build it with empty_pool)")
    check_v_layout(pool)
    return s, t, hkv, d


def check_v_layout(pool: KVPool) -> None:
    """ValueError unless pool.v has the shape its layout says (beside k [Hkv, P, page, D])."""
    _check_layout(pool.v_layout, pool.fp8)
    if pool.k.ndim != 4 or pool.v.shape != _v_shape(pool.k.shape, pool.v_layout):
        lay = "[Hkv, P, D, page]" if pool.keys_major else "[Hkv, P, page, D]"
        raise ValueError(f"pool.k must be [Hkv, P, page, D] and pool.v (v_layout {pool.v_layout!r}) {lay}; got "
                         f"{pool.k.shape}, {pool.v.shape}")


def gather_stream(pool: KVPool, page_table: jax.Array) -> tuple[jax.Array, jax.Array]:
    """All of a stream's pages in logical order, fp32: page_table [Pmax] -> (k, v) [Pmax*page, Hkv, D]."""
    def one(rows, scale):  # rows [Hkv, Pmax, page, D]
        rows = rows.astype(jnp.float32)
        if scale is not None:
            rows = rows * scale[:, page_table][..., None]
        hkv, pm, ps, d = rows.shape
        return jnp.moveaxis(rows.reshape(hkv, pm * ps, d), 0, 1)
    return one(pool.k[:, page_table], pool.k_scale), one(pool.v_pages(page_table), pool.v_scale)
