"""Pass 1 of the verify/decode window (`attention.window`) on Mosaic GPU: the chunk partials of the committed keys,
with wgmma for S = Q K^T and P V and a TMA pipeline over the pages.

Letters as in `attention`: s streams, r window rows, h query heads, g KV heads, d head dim, m packed rows.

Why: the Triton pass 1 holds a chunk program's packed rows (6 query heads x the window's rows, 96 for a 16-row
window) as one register tile; at 128 packed rows it spilled and ran at 1.8-2.2x the 1-row time at 32K / 128K keys
on the H200 (issue #5 asks for <= 1.3x). Here a CTA owns one (stream, KV head, chunk of `chunk` committed keys):
its packed rows in one or two compute warpgroups of 64 rows (the wgmma M), and a memory warpgroup that walks the
chunk's pages through the page table, one 64-key block a step, K and V by TMA into `stages` shared-memory slots on
barriers of their own. Per block a compute warpgroup runs S = Q K^T into a fresh fp32 accumulator, the online
softmax in fp32 registers (exp2 of logits scaled by scale log2 e), P rounded to bf16 as the register A operand of
P V, accumulated into the running fp32 O. At the chunk's end each warpgroup writes its rows' partial (m, l, O, O
relative to m) over the K/V slots it no longer reads (with bf16 partials, `PARTIALS`, O rounded once to bf16 over
the warpgroup's query tile instead), and one warpgroup stores the CTA's real rows rounded up to 8 (96 of a 16-row
window's 128); `attention.window`'s fold pass and merge then combine the partials in chunk order and add the
window's own keys, as for the Triton pass 1.

Launch choices (`WindowMgpuTiles`, none changes a row's bits): `split_rows` runs a two-warpgroup window's halves in
CTAs of their own, side by side in the grid (twice the CTAs where few chunks are live; the second read of a chunk's
keys mostly from L2); `ping_pong` lets the two compute warpgroups of a CTA take turns, so one's softmax overlaps the
other's MMAs. `attention.window_partials` splits the rows of calls whose grid is small (`SPLIT_MAX_CTAS`);
ping-pong stays off: on the H200 it measured the same as the shipped schedule (session 17).

A chunk's keys split over a cluster of CTAs that fold their partials through distributed shared memory
(session 17, 8343094) gave the right bits on the H200 and was slower everywhere (16-row windows 1.7-2.3x the
1-row time against 1.19-1.34x); it was removed (docs/kernels/attention.md, run 12).

Output contract (that of `attention.window_partials`): m, l [S, Hkv, NC, M] fp32 and acc [S, Hkv, NC, M, D] fp32
or bf16 (`partials`), m in
natural-log units (the partial is exp(s scale - m) summed), for the chunks below each stream's context; other
chunks are left unwritten, and so are rows past R G rounded up to 8 (rows written past R G hold the padding rows'
values; the merge reads only real rows).

Exactness: key block b of chunk c always covers absolute keys [c C + b 64, c C + (b + 1) 64), C the stream's chunk
(`chunk`, or for a short context a shorter one its context picks: `attention.stream_chunking`), every block
runs the same operations (keys at or past the context masked to -inf on the raw S), and a row's S, max, sum and
P V are computed from that row alone (wgmma reduces over d per row, the softmax reductions are per row), so a row's
partial depends only on its own query, its stream's keys and the chunk grid: not on the other rows of the window
(the 1-row decode and a row of a 16-row window get the same bits), on the other streams, on how many pages the
table holds, on the compute warpgroup it lands in or on `stages`. The bits differ from the Triton pass 1's (another
reduction order inside the MMAs, 64-key blocks); a model uses one pass 1 (`attention.WINDOW_IMPL`).

Floors (H200, 27B: Hkv 4, G 6, d 256, bf16 pool): the keys' bytes, 4 KiB a key (K and V of 4 heads), 134 MB at 32K
keys, ~31 µs at 4.3 TB/s; a 16-row window's 96 packed rows add 4 heads x 96 x 32K x 256 x 4 FLOPs (S and P V),
12.9 GFLOP, ~16 µs at 790 TFLOP/s: under the bytes. Shared memory (227 KiB): Q 64 rows x d bf16 per compute
warpgroup (32 KiB at d 256) plus `stages` x 64 KiB of K and V slots (reused for the fp32 O partials, 64 KiB a
warpgroup), so 3 stages with one compute warpgroup, 2 with two.

fp8 pools (e4m3 codes, one fp32 scale a key and KV head): the memory warpgroup brings each block's codes and its
keys' scales by TMA (one barrier), and the compute warpgroup dequantizes them to bf16(code x scale), correctly
rounded, into two swizzled bf16 tiles before its MMAs (then releases the slot); one compute warpgroup a CTA (a
two-warpgroup window runs as split_rows). Elementwise per key, so the exactness above holds, and the partials are
bit for bit the bf16 pass 1's over a pool holding the dequantized values. On the H200 (session 20) it ran 16-row
windows 1.4-1.5x faster than the Triton pass 1 and the 1-row decode 1.6-2.5x slower (the dequantization is the
bottleneck), so `FP8` keeps it off "auto"; explicit impl="mgpu" runs it. Two compute warpgroups a CTA sharing
each block's dequantization (the second on padding queries for a 1-row decode) gave the same bits and ran that decode
at 1.49-2.35x the Triton pass 1's (H200, session 26); it was removed in session 37 (docs/kernels/attention.md, run 19).

fp8 pools with V key-major (`KVPool.v_layout` "keys", pages of a multiple of 64 keys; session 36, prepared, not
yet run on a GPU): no dequantization. An 8-bit wgmma needs both operands K-major: Q [rows, d] and a K block
[keys, d] are, and a key-major V page [d, keys] is V^T with the keys (P V's contraction) contiguous, so the slots
hold the codes as stored and both MMAs read them. q comes in two e4m3 parts (`split_queries`: a power-of-two row
scale, hi, lo), S = (q_hi + q_lo) K^T in fp32 (two MMAs into one accumulator; e4m3 products are exact), times the
keys' scales and the row's 1 / scale. V's scales go into P: P' = P vs 256 / vm in [0, 256], vm the largest V scale
among the chunk's keys so far (masked keys count 0; O is rescaled by vm / vm_new with the softmax's alpha), split
into two e4m3 parts through shared memory (8 KB a block; a register e4m3 A operand fails Mosaic GPU's layout
inference on jax 0.11.2) and two MMAs with V^T; the partial is O vm / 256. Its own order: a row's bits depend on its
query, its stream's keys and the chunk grid alone, as above. The arithmetic error, modelled in numpy
(`tools/offline/fp8_mma_numerics.py`), is the bf16 pool's (~1e-3 of a row's largest output), far below what fp8
storage itself moves. A 16-row window's two warpgroups share a CTA's slots as for bf16 pools (split_rows, a launch
choice, as there; no ping-pong). "auto" keeps fp8 pools on the Triton pass 1 (`FP8`) until the H200 times it.
fp8 pools with V by rows stay on the Triton pass 1 under "auto" either way.

Interpret mode (CPU, `plgpu.InterpretGPUParams`): as `attention_mgpu`, P goes through shared memory for the P V
wgmma and P V lands in a fresh accumulator added to O.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention import SMEM_BYTES, _padded_rows, mgpu_operands, stream_chunking
from pallas_kernels.attention_mgpu import (COMPUTE_REGISTERS, MEMORY_REGISTERS, WG_ROWS, _div, _transforms, accumulate,
                                           add_pv,
                                           feed_slots, online_softmax, online_start)
from pallas_kernels.kv_quant import KVPool
from pallas_kernels.mgpu_lowering import CachedKernel

BLOCK_K = 64  # keys a step (P V contracts over them: a multiple of 64 for V's 128-byte swizzled rows)
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class WindowMgpuTiles:
    """Launch choices of the Mosaic GPU pass 1; none changes a row's bits. stages: K/V blocks in flight (None: 3 with
    one compute warpgroup, 2 with two, what shared memory holds at d 256). split_rows: a window of more than 64
    packed rows runs each warpgroup's 64 rows in a CTA of its own (a chunk's CTAs side by side in the grid, so the
    second read of the chunk's keys mostly hits L2): twice the CTAs, each with one compute warpgroup and 3 stages."""
    stages: int | None = None
    split_rows: bool = False
    # Two compute warpgroups in a CTA take turns (a schedule barrier, as `attention_mgpu`'s ping-pong): one's softmax
    # runs while the other's MMAs are in flight. Same operations on every row.
    ping_pong: bool = False
    # fp8 pools: the register layout the codes are dequantized in (same values, so same bits). "wgmma": the MMA's
    # layout, 64 columns a step, codes loaded two bytes at a time; "wgmma_8bit": the 8-bit MMA operand layout, 128
    # columns a step, four bytes a load (10-19 % faster on the H200, session 21: `DEQUANT`).
    dequant: str = "wgmma"


def compute_warpgroups(packed_rows: int) -> int:
    """Compute warpgroups of a CTA for `packed_rows` packed rows (R G): 64 rows each."""
    return -(-packed_rows // WG_ROWS)


def stages_for(tiles: WindowMgpuTiles, wgs: int) -> int:
    return tiles.stages or (3 if wgs == 1 else 2)


def smem_bytes(*, wgs: int, stages: int, head_dim: int, interpret: bool = False, fp8: bool = False,
               e4m3: bool = False) -> int:
    """Shared memory a CTA asks for with fp32 partials (bf16 ones need no more): the Q tiles, the K/V slots (which
    the O partials and their m and l reuse), interpret mode's P tiles, and for fp8 pools the slots' scales and the
    block's K and V dequantized to bf16 (barriers aside: the lowering found 112 more bytes than this). e4m3 (an fp8
    pool with v key-major): q's two e4m3 parts and row scales, the slots' codes and scales, an O tile, P's two e4m3
    parts."""
    ml = 2 * wgs * WG_ROWS * 4
    out = wgs * WG_ROWS * head_dim * 4
    if e4m3:
        q = wgs * WG_ROWS * (2 * head_dim + 4)
        kv = stages * 2 * BLOCK_K * (head_dim + 4)
        return q + max(kv, out + ml) + 2 * wgs * WG_ROWS * BLOCK_K
    q = wgs * WG_ROWS * head_dim * 2
    kv = stages * 2 * BLOCK_K * (head_dim + 4 if fp8 else head_dim * 2)
    p = wgs * WG_ROWS * BLOCK_K * 2 if interpret else 0
    dequantized = 2 * BLOCK_K * head_dim * 2 if fp8 else 0
    return q + max(kv, out + ml) + p + dequantized


def packed_rows(q_shape: tuple[int, ...], hkv: int) -> int:
    """The rows of `pack_queries`' output for queries of shape [S, R, Hq, D]."""
    _, r, hq, _ = q_shape
    return compute_warpgroups(r * (hq // hkv)) * WG_ROWS


def check_packed(q_packed: jax.Array, q: jax.Array, hkv: int) -> jax.Array:
    """q_packed as `pack_queries(q, hkv)` lays it out (shape and dtype; its values are the caller's word)."""
    s, _, _, d = q.shape
    want = (s, hkv, packed_rows(q.shape, hkv), d)
    if q_packed.shape != want or q_packed.dtype != q.dtype:
        raise ValueError(f"q_packed must be pack_queries(q)'s {want} {q.dtype}; got {q_packed.shape} "
                         f"{q_packed.dtype}")
    return q_packed


def split_queries(qp: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Packed queries [..., D] bf16 -> (hi, lo) e4m3 [..., D] and 1 / row scale [...] fp32 for the e4m3 pass 1:
    each row times the power of two 2^e that brings its largest |value| to at most 448 (e in [-126, 126]; 0 for a
    zero row), hi = e4m3(row 2^e), lo = e4m3(row 2^e - hi). Exact scalings; a row's parts follow from that row."""
    x = qp.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    # amax = f 2^k, f in [0.5, 1) (exactly): 448 = 0.875 2^9, so f 2^(k + e) <= 448 at most for e = 9 - k where
    # f <= 0.875, else 8 - k
    f, k = jnp.frexp(amax)
    e = jnp.where(amax > 0, jnp.clip(jnp.where(f <= 0.875, 9 - k, 8 - k), -126, 126), 0)
    y = x * jnp.ldexp(jnp.float32(1), e)[..., None]
    hi = y.astype(jnp.float8_e4m3fn)
    return hi, (y - hi.astype(jnp.float32)).astype(jnp.float8_e4m3fn), jnp.ldexp(jnp.float32(1), -e)


def pack_queries(q: jax.Array, hkv: int) -> jax.Array:
    """q [S, R, Hq, D] -> [S, Hkv, W * 64, D]: KV head g's packed rows m = r G + h (query head g G + h of window row
    r, as `attention._packed_rows`), zeros past R G up to the compute warpgroups' rows."""
    s, r, hq, d = q.shape
    group = hq // hkv
    packed = jnp.moveaxis(q.reshape(s, r, hkv, group, d), 2, 1).reshape(s, hkv, r * group, d)
    rows = packed_rows(q.shape, hkv)
    return jnp.pad(packed, ((0, 0), (0, 0), (0, rows - r * group), (0, 0)))


def _kernel_call(cache_len: jax.Array, page_table: jax.Array, qp: jax.Array, k: jax.Array, v: jax.Array,
                 *scales: jax.Array, scale: float, chunk: int, short_chunk: int | None, n_chunks: int,
                 nc_pad: int, real_rows: int,
                 mrows: int, max_keys: int, stages: int, parts: int, ping_pong: bool, partials: str = "float32",
                 dequant: str = "wgmma", sized: bool = False, interpret: bool | plgpu.InterpretGPUParams = False
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """qp [S, Hkv, W 64, D] bf16 (`pack_queries`: real_rows = R G of them real); k, v [Hkv, P, page, D] bf16, or
    e4m3 codes with scales = (k_scale, v_scale) [Hkv, P, page] fp32 (one compute warpgroup a CTA: parts = W);
    page_table [S, Pmax'] int32 covering n_chunks chunks; cache_len [S] int32 (sized: [2 S], the key counts, then
    the counts that set the chunk size, already capped) -> m, l [S, Hkv, nc_pad, mrows], acc
    [S, Hkv, nc_pad, mrows, D] in `partials` (fp32 or bf16; rows past R G rounded up to 8 unwritten). Grid (chunk x
    part, KV head, stream): parts 1, a CTA runs all W warpgroups' rows; parts W, a CTA runs warpgroup `part`'s 64
    rows.
    dequant "e4m3" (fp8 pools with v key-major: v [Hkv, P, D, page], pages of a multiple of 64 keys): no
    dequantization, both MMAs read e4m3 operands; qp is then q's high e4m3 part and scales = (k_scale, v_scale, q's
    low part [S, Hkv, W 64, D] e4m3, 1 / q's row scale [S, Hkv, W 64] fp32) (`split_queries`).
    """
    bf16_out = partials == "bfloat16"
    fp8 = bool(scales)
    e4m3 = dequant == "e4m3"
    s_count, hkv, qrows, d = qp.shape
    assert parts in (1, qrows // WG_ROWS), (parts, qrows)
    assert not scales or (len(scales) == (4 if e4m3 else 2) and (e4m3 or parts == qrows // WG_ROWS)), (
        len(scales), parts, qrows)
    wgs = qrows // WG_ROWS // parts  # compute warpgroups a CTA
    ps = k.shape[2]
    bk = BLOCK_K
    span = min(bk, ps)  # keys one copy moves: a page, or a block's part of one
    copies = bk // span  # copies a block (pages shorter than a block)
    assert not e4m3 or (fp8 and copies == 1 and v.shape[2] == d), (ps, v.shape)
    # Rows a CTA stores: its real rows rounded up to 8 (a 1-row window stores 8 rows of partials, not 64; a 16-row
    # window at 6 heads a KV head 96, not 128). Static per CTA kind: with parts, every part but the last stores 64.
    round8 = lambda n: -(-n // 8) * 8
    cta_rows = wgs * WG_ROWS
    last_rows = round8(real_rows - (parts - 1) * cta_rows)
    ping_pong = ping_pong and wgs == 2 and not e4m3  # (the e4m3 step takes no turns)
    assert 0 < last_rows <= cta_rows and (parts - 1) * cta_rows + last_rows <= mrows, (real_rows, mrows, parts)
    c_log2 = scale * _LOG2E

    def kernel(len_gmem, pt_gmem, q_gmem, k_gmem, v_gmem, *refs):
        qlo_smem = qinv_smem = plo_smem = None
        if e4m3:
            (ks_gmem, vs_gmem, qlo_gmem, qinv_gmem, m_gmem, l_gmem, acc_gmem, q_smem, qlo_smem, qinv_smem, union,
             p_smem, plo_smem, *bars) = refs
            (k_smem, v_smem, ks_smem, vs_smem), (out_smem, ml_smem) = union
            kb_smem = vb_smem = None
        elif fp8:
            ks_gmem, vs_gmem, m_gmem, l_gmem, acc_gmem, q_smem, union, p_smem, kb_smem, vb_smem, *bars = refs
            (k_smem, v_smem, ks_smem, vs_smem), outs = union
            out_smem, ml_smem = (None, *outs) if bf16_out else outs
        else:
            m_gmem, l_gmem, acc_gmem, q_smem, union, p_smem, *bars = refs
            (k_smem, v_smem), (out_smem, ml_smem) = union
            ks_gmem = vs_gmem = ks_smem = vs_smem = kb_smem = vb_smem = None
        k_ready, v_ready, k_free, v_free, q_ready, drained, written, schedule = bars
        # len_gmem [S] the streams' key counts (sized: [2 S], then the counts that set their chunk size);
        # pt_gmem [S, Pmax']; q_gmem [S, Hkv, W 64, D]; k_gmem, v_gmem [Hkv, P, page, D]; outputs
        # m_gmem, l_gmem [S, Hkv, NC, M], acc_gmem [S, Hkv, NC, M, D]. q_smem [wgs, 64, D]; union: the K / V slots
        # [stages, 64, D] bf16, later the CTA's O partials [wgs 64, D] and their (m, l) [2, wgs 64] fp32;
        # interpret: p_smem [wgs, 64, 64] bf16. fp8: ks_gmem, vs_gmem [Hkv, P, page] the scales; the slots hold
        # e4m3 codes [stages, 64, D] and their scales [stages, 64]; kb_smem, vb_smem [64, D] bf16 the block's K and V
        # dequantized (the wgmma operands).
        cp = lax.axis_index("chunks")
        c, part = (_div(cp, parts), lax.rem(cp, parts)) if parts > 1 else (cp, 0)
        g = lax.axis_index("heads")
        s = lax.axis_index("streams")
        wg = lax.axis_index("wg")
        row0 = part * cta_rows  # the CTA's first packed row
        n_keys = lax.min(len_gmem[s], jnp.int32(max_keys))
        # the stream's chunk (`attention.stream_chunking`) from the count that sets it: sized, the second half of
        # len_gmem (`attention.window_partials`' size_len), else its keys' count
        size = stream_chunking(len_gmem[s_count + s] if sized else n_keys, chunk, short_chunk)[0]
        first = c * size
        n_blocks = lax.clamp(0, _div(lax.max(n_keys - first, 0) + bk - 1, bk), _div(size, bk))

        def store(rows: int):
            # The CTA's first `rows` rows of partials, one TMA each for O (bf16: one a warpgroup's tile it touches),
            # m and l (one warpgroup issues them).
            if bf16_out and not e4m3:  # (a warpgroup's 64 rows in its query tile)
                for w in range(-(-rows // WG_ROWS)):
                    n = min(WG_ROWS, rows - w * WG_ROWS)
                    plgpu.copy_smem_to_gmem(q_smem.at[w, pl.ds(0, n)],
                                            acc_gmem.at[s, g, c, pl.ds(row0 + w * WG_ROWS, n)])
            else:
                plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, rows)], acc_gmem.at[s, g, c, pl.ds(row0, rows)])
            plgpu.copy_smem_to_gmem(ml_smem.at[0, pl.ds(0, rows)], m_gmem.at[s, g, c, pl.ds(row0, rows)])
            plgpu.copy_smem_to_gmem(ml_smem.at[1, pl.ds(0, rows)], l_gmem.at[s, g, c, pl.ds(row0, rows)])
            plgpu.wait_smem_to_gmem(0)

        def finish(mine, m, l):
            # A compute warpgroup's m and l (rows `mine` of the CTA) beside its O partial, already in shared
            # memory; then one warpgroup stores the CTA's rows: one TMA each for O, m and l, of one static size.
            # (Session 15's store of a size of its own per warpgroup hung Mosaic GPU's interpreter on a 2-core
            # machine, likely the CPU pool starvation tests/conftest.py now avoids; it was not retried.)
            ml_smem[0, mine] = m * _LN2  # natural-log units, as the merge weighs partials
            ml_smem[1, mine] = l
            plgpu.commit_smem()
            if wgs == 2:
                plgpu.barrier_arrive(written)

            @pl.when(wg == 0)
            def _():
                if wgs == 2:
                    plgpu.barrier_wait(written)
                if parts == 1 or last_rows == cta_rows:
                    store(last_rows)
                else:
                    pl.when(part < parts - 1)(functools.partial(store, cta_rows))
                    pl.when(part == parts - 1)(functools.partial(store, last_rows))

        eight_bit = dequant == "wgmma_8bit" and d % 128 == 0  # (64-column steps where 128 would not divide d)
        layout, step = (plgpu.Layout.WGMMA_8BIT, 128) if eight_bit else (plgpu.Layout.WGMMA, 64)

        def dequantize(codes, scales_row, into):
            # A block's e4m3 codes [64, D] times their keys' scales [64] -> bf16 [64, D] in `into`, `step` columns
            # at a time in `dequant`'s register layout (a key a row): each value the correctly rounded bf16 of
            # code x scale, from that key alone, whatever the layout.
            row_scale = lax.broadcast_in_dim(plgpu.load(scales_row, layout=layout.reduce(1)), (bk, step), [0])
            for j in range(d // step):
                cols = pl.ds(j * step, step)
                x = plgpu.load(codes.at[:, cols], layout=layout)
                into[:, cols] = (x.astype(jnp.float32) * row_scale).astype(jnp.bfloat16)
            plgpu.commit_smem()  # (a warpgroup barrier too: every lane has read the codes)

        def take_turn():
            # With ping_pong the k-th turn of one compute warpgroup meets the k-th of the other; warpgroup 1 takes
            # one turn before its loop and warpgroup 0 one after, so their MMAs and softmaxes alternate.
            if ping_pong:
                plgpu.barrier_arrive(schedule)
                plgpu.barrier_wait(schedule)

        def start():
            # A compute warpgroup's registers, its queries in its tile (-> the tile), the first K block.
            if wgs == 2:
                plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
            qt = q_smem.at[wg]
            mine = pl.ds(row0 + wg * WG_ROWS, WG_ROWS)
            plgpu.copy_gmem_to_smem(q_gmem.at[s, g, mine], qt, q_ready.at[wg])
            if e4m3:  # q's low part and its rows' scale beside the high part
                plgpu.copy_gmem_to_smem(qlo_gmem.at[s, g, mine], qlo_smem.at[wg], q_ready.at[wg])
                plgpu.copy_gmem_to_smem(qinv_gmem.at[s, g, mine], qinv_smem.at[wg], q_ready.at[wg])
            plgpu.barrier_wait(q_ready.at[wg])
            plgpu.barrier_wait(k_ready.at[0])
            return qt

        def live_keys(b):
            # [64, bk]: which of block b's keys lie before the context's end (the rest take -inf in S, and in the
            # e4m3 step a V scale of 0), the same select in every block
            col = plgpu.broadcasted_iota(jnp.int32, (WG_ROWS, bk), 1, layout=plgpu.Layout.WGMMA)
            return col < n_keys - (first + b * bk)

        def wait_next_keys(b):
            # Block b + 1's K slot filled (issued behind block b's P V MMAs, before they are waited on)
            @pl.when(b + 1 < n_blocks)
            def _():
                plgpu.barrier_wait(k_ready.at[lax.rem(b + 1, stages)])

        def _compute():
            qt = start()

            def step(b, carry):
                acc, m, l = carry
                slot = lax.rem(b, stages)
                if fp8:  # the codes -> bf16 operands; the slot is free again once they are read
                    dequantize(k_smem.at[slot], ks_smem.at[slot], kb_smem)
                    plgpu.barrier_arrive(k_free.at[slot])
                k_tile = kb_smem if fp8 else k_smem.at[slot]

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, qt, k_tile.T)
                    take_turn()
                    return acc_ref[...]

                logits = pl.run_scoped(qk, plgpu.ACC((WG_ROWS, bk), jnp.float32))
                if not fp8:
                    plgpu.barrier_arrive(k_free.at[slot])
                # Every block takes the same select on the raw S (keys at or past the context: -inf), so a
                # visible logit meets the same operations in every block.
                logits = jnp.where(live_keys(b), logits, -jnp.inf)
                acc, m_new, l, p16 = online_softmax(logits, acc, m, l, c_log2)
                if ping_pong:
                    plgpu.barrier_arrive(schedule)
                plgpu.barrier_wait(v_ready.at[slot])
                if ping_pong:
                    plgpu.barrier_wait(schedule)
                if fp8:
                    dequantize(v_smem.at[slot], vs_smem.at[slot], vb_smem)
                    plgpu.barrier_arrive(v_free.at[slot])

                acc = add_pv(acc, p16, vb_smem if fp8 else v_smem.at[slot], p_smem.at[wg] if interpret else None,
                             then=functools.partial(wait_next_keys, b))
                if not fp8:
                    plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l

            def step_e4m3(b, carry):
                # Both MMAs on e4m3 operands as stored. S = (q_hi + q_lo) K^T over the codes (each product exact
                # in fp32), times the keys' scales and the row's 1 / q scale. V's scales enter P: the running vm
                # is the largest V scale among the chunk's keys so far (masked keys count 0), O is kept in units
                # of vm / 256 (rescaled with the max when vm grows), and P' = P vs 256 / vm, in [0, 256], goes
                # through shared memory in two e4m3 parts, each an MMA with V^T's key-major codes.
                acc, m, l, vm = carry
                slot = lax.rem(b, stages)
                live = live_keys(b)
                cols = lambda ref: lax.broadcast_in_dim(plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(0)),
                                                        (WG_ROWS, bk), [1])
                k_scale = cols(ks_smem.at[slot])

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, qt, k_smem.at[slot].T)
                    plgpu.wgmma(acc_ref, qlo_smem.at[wg], k_smem.at[slot].T)
                    return acc_ref[...]

                raw = pl.run_scoped(qk, plgpu.ACC((WG_ROWS, bk), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                logits = jnp.where(live, raw * k_scale * lax.broadcast_in_dim(q_inv, (WG_ROWS, bk), [0]), -jnp.inf)
                plgpu.barrier_wait(v_ready.at[slot])
                v_scale = jnp.where(live, cols(vs_smem.at[slot]), 0.0)
                vm_new = jnp.maximum(vm, v_scale.max(axis=1))
                ratio = jnp.where(vm_new > 0, vm / vm_new, 1.0)
                acc, m_new, l, p = online_softmax(logits, acc, m, l, c_log2, rescale=ratio, p_dtype=jnp.float32)
                p = p * v_scale * lax.broadcast_in_dim(jnp.where(vm_new > 0, 256.0 / vm_new, 0.0), (WG_ROWS, bk),
                                                       [0])
                p_hi = p.astype(v.dtype)
                p_smem[wg] = p_hi
                plo_smem[wg] = (p - p_hi.astype(jnp.float32)).astype(v.dtype)
                plgpu.commit_smem()

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_smem.at[wg], v_smem.at[slot].T)
                    plgpu.wgmma(acc_ref, plo_smem.at[wg], v_smem.at[slot].T)
                    wait_next_keys(b)

                acc = accumulate(acc, pv, fresh=bool(interpret))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l, vm_new

            if ping_pong:
                pl.when(wg == 1)(take_turn)
            if e4m3:
                q_inv = plgpu.load(qinv_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
                vm0 = plgpu.layout_cast(jnp.full((WG_ROWS,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
                acc, m, l, vm = lax.fori_loop(0, n_blocks, step_e4m3, (*online_start(d), vm0))
                acc = acc * lax.broadcast_in_dim(vm * (1 / 256), acc.shape, [0])
            else:
                acc, m, l = lax.fori_loop(0, n_blocks, step, online_start(d))
            if ping_pong:
                pl.when(wg == 0)(take_turn)
            # The O partials go over the K/V slots: every compute warpgroup has read its last block first (the
            # memory warpgroup fetched only the blocks the compute warpgroups waited for, so no copy is in flight).
            if wgs == 2:
                plgpu.barrier_arrive(drained)
                plgpu.barrier_wait(drained)
            mine = pl.ds(wg * WG_ROWS, WG_ROWS)
            if bf16_out and not e4m3:
                qt[...] = acc.astype(jnp.bfloat16)  # over the warpgroup's queries: its last S = Q K^T has been read
            else:
                out_smem[mine] = acc.astype(out_smem.dtype)
            finish(mine, m, l)

        pl.when((n_blocks > 0) & (wg < wgs))(_compute)

        @pl.when((n_blocks > 0) & (wg == wgs))
        def _memory():
            if wgs == 2:
                plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")
            kv = ((k_gmem, k_smem, ks_gmem, ks_smem, k_ready, k_free),
                  (v_gmem, v_smem, vs_gmem, vs_smem, v_ready, v_free))
            last_page = _div(n_keys - 1, ps)

            def fetch(b, reuse: bool):
                # Block b's keys into its slot through the page table; reuse: first wait until every compute
                # warpgroup released the slot's last block (K and V apart).
                slot = lax.rem(b, stages)
                key0 = first + b * bk
                for src, dst, src_scale, dst_scale, ready, free in kv:
                    if reuse:
                        plgpu.barrier_wait(free.at[slot])
                    for j in range(copies):
                        pos = key0 + j * span
                        # A page of the block wholly past the context is replaced by the last live one (its keys
                        # are masked either way): only pages holding the stream's keys are ever read, as in the
                        # Triton pass 1, whose blocks never outrun a page.
                        logical = lax.min(_div(pos, ps), last_page) if copies > 1 else _div(pos, ps)
                        page = pt_gmem[s, logical]
                        within = slice(None) if span == ps else pl.ds(pos - logical * ps, span)
                        part = slice(None) if copies == 1 else pl.ds(j * span, span)
                        # (e4m3: V key-major, [D, page] a page; its keys the minor dimension)
                        at = (g, page, slice(None), within) if e4m3 and src is v_gmem else (g, page, within)
                        plgpu.copy_gmem_to_smem(src.at[at], dst.at[slot, part], ready.at[slot])
                        if fp8:  # the keys' scales on the same barrier
                            plgpu.copy_gmem_to_smem(src_scale.at[g, page, within], dst_scale.at[slot, part],
                                                    ready.at[slot])

            feed_slots(fetch, n_blocks, stages, [free for *_, free in kv])

    qd = _transforms(d)
    if e4m3:  # codes and scales as stored, read by the MMAs (V^T key-major); q's two parts, P's two parts
        f8 = k.dtype
        kv_slots = (plgpu.SMEM((stages, bk, d), f8, transforms=_transforms(d, 8)),
                    plgpu.SMEM((stages, d, bk), f8, transforms=_transforms(bk, 8)),
                    plgpu.SMEM((stages, bk), jnp.float32), plgpu.SMEM((stages, bk), jnp.float32))
        outs = (plgpu.SMEM((cta_rows, d), jnp.dtype(partials)), plgpu.SMEM((2, cta_rows), jnp.float32))
        p_tiles = (plgpu.SMEM((wgs, WG_ROWS, bk), f8, transforms=_transforms(bk, 8)),) * 2
        smem = (plgpu.SMEM((wgs, WG_ROWS, d), f8, transforms=_transforms(d, 8)),
                plgpu.SMEM((wgs, WG_ROWS, d), f8, transforms=_transforms(d, 8)),
                plgpu.SMEM((wgs, WG_ROWS), jnp.float32), plgpu.RefUnion(kv_slots, outs), *p_tiles)
    elif fp8:  # codes and scales as stored (read into registers, not by the MMA), and the two dequantized tiles
        kv_slots = (plgpu.SMEM((stages, bk, d), k.dtype),
                    plgpu.SMEM((stages, bk, d), v.dtype),
                    plgpu.SMEM((stages, bk), jnp.float32), plgpu.SMEM((stages, bk), jnp.float32))
        dequantized = (plgpu.SMEM((bk, d), jnp.bfloat16, transforms=qd),) * 2
    else:
        kv_slots = (plgpu.SMEM((stages, bk, d), jnp.bfloat16, transforms=qd),
                    plgpu.SMEM((stages, bk, d), jnp.bfloat16, transforms=qd))
        dequantized = ()
    if not e4m3:
        q_tile = plgpu.SMEM((wgs, WG_ROWS, d), jnp.bfloat16, transforms=qd)
        p_tile = plgpu.SMEM((wgs, WG_ROWS, bk), jnp.bfloat16, transforms=_transforms(bk)) if interpret else None
        outs = (plgpu.SMEM((2, cta_rows), jnp.float32),)  # m and l; and the fp32 O tile but for fp8 bf16 partials
        if not (fp8 and bf16_out):
            outs = (plgpu.SMEM((cta_rows, d), jnp.float32), *outs)
        smem = (q_tile, plgpu.RefUnion(kv_slots, outs), p_tile, *dequantized)
    f32 = jnp.float32
    call = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((s_count, hkv, nc_pad, mrows), f32),
                  jax.ShapeDtypeStruct((s_count, hkv, nc_pad, mrows), f32),
                  jax.ShapeDtypeStruct((s_count, hkv, nc_pad, mrows, d), jnp.dtype(partials))),
        grid=(n_chunks * parts, hkv, s_count), grid_names=("chunks", "heads", "streams"),
        num_threads=wgs + 1, thread_name="wg", kernel_name="attn_window_chunks_mgpu",
        scratch_types=(*smem,
                       plgpu.Barrier(num_arrivals=copies * (2 if fp8 else 1), num_barriers=stages),
                       plgpu.Barrier(num_arrivals=copies * (2 if fp8 else 1), num_barriers=stages),
                       plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
                       plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
                       plgpu.Barrier(num_arrivals=3 if e4m3 else 1, num_barriers=wgs),
                       plgpu.Barrier(num_arrivals=wgs),
                       plgpu.Barrier(num_arrivals=wgs),
                       plgpu.Barrier(num_arrivals=wgs)),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=(interpret if isinstance(interpret, plgpu.InterpretGPUParams)
                   else plgpu.InterpretGPUParams() if interpret else None))
    return call(cache_len, page_table, qp, k, v, *scales)


# Lowered once a process per shapes and static parameters (`mgpu_lowering`): 16 attention layers a decode program.
_PARTIALS = CachedKernel(
    "attn_window_mgpu_partials", _kernel_call,
    lambda _, __, qp, *___, nc_pad, mrows, partials="float32", **____: [
        jax.core.ShapedArray((*qp.shape[:2], nc_pad, mrows), jnp.float32)] * 2
    + [jax.core.ShapedArray((*qp.shape[:2], nc_pad, mrows, qp.shape[3]), jnp.dtype(partials))])

MAX_WINDOW_ROWS = 16  # as attention.window
# Committed keys a CTA's partial covers (order) in a model's window calls (`attention.model_window_tiles`): the
# partials' bytes a key fall with it, and so does the parallelism over short contexts (docs/kernels/attention.md,
# runs 9 and 10). Session 17 (`bench attention --sections window_mgpu_variants`, kernels alone, 1 stream): 1024
# against 512 decoded 32K keys in 45.4 against 50.1 µs and 128K in 144.7 against 151.1, a 16-row window over 32K
# in 56.4 against 70.1 (1.24x the 1-row time, against 1.40x), at 16 streams 1.28x against 1.50x; it costs the
# 1-row decode of 4K keys at 1 stream (24.9 against 17.0 µs: 4 chunks a KV head keep 16 SMs busy). 2048 met
# 1.3x everywhere but took 41.9 µs for that 4K decode.
CHUNK = 1024
# A window of two compute warpgroups runs them in CTAs of their own (`WindowMgpuTiles.split_rows`) when the call's
# grid (streams x KV heads x the table's chunks) holds at most this many CTAs: under half the H200's 132 SMs the
# second read of a chunk's keys costs less than the idle SMs (session 17, window_mgpu_variants, 16-row windows:
# 1 stream at 4K 29.7 against 37.9 µs at chunk 1024, 22.3 against 27.2 at 512; 32K over 2048-key chunks 53.7
# against 68.5; at 128 CTAs and more, 1.2-1.6x slower). From static shapes, so a launch choice: same bits.
SPLIT_MAX_CTAS = 64
# `WindowMgpuTiles.ping_pong` for the calls `attention.window` makes (a launch choice). Off: session 17's
# window_mgpu_variants timed it within 1 % of the shipped schedule in 13 of 15 windows (2048-key chunks at 32K:
# 66.9 against 68.5 µs; 1024 at 16 streams: 688 against 681).
PING_PONG = False
# `WindowMgpuTiles.dequant` for the calls `attention.window` makes (a launch choice: same bits). The 8-bit layout
# since session 21: `bench attention --sections window_fp8 --trace` (session 20's code, run at 99e6c09, kernels
# alone) timed it faster at every point, 1-row decode 48.3 / 51.7 / 174.6 µs at 4K / 32K / 128K against 54.1 / 59.4 /
# 200.5 in the MMA layout, 16-row windows 51.8 / 103.2 / 357.3 against 60.6 / 122.7 / 430.3.
DEQUANT = "wgmma_8bit"
# Whether "auto" (`attention.WINDOW_IMPL`) gives fp8 pools with V key-major this pass 1 (both MMAs on the e4m3
# codes); explicit impl="mgpu" runs it either way. Off until the H200 times it (`tools/gpu/run.sh
# hundred-fifty-first`). fp8 pools with V by rows never take it under "auto": there this pass 1 dequantizes the codes
# to bf16 in shared memory a block at a time, and session 20 (`bench attention --sections window_fp8 --trace`,
# kernels alone) timed its 1-row decode at 54.2 / 60.0 / 200.6 µs at 4K / 32K / 128K against the Triton pass 1's
# 22.1 / 37.3 / 111.8 (its 16-row windows 1.4-1.5x faster).
FP8 = False
# The dtype of the O partials in a model's window calls (`attention.WindowTiles.partials`, order): bf16, the fp32
# sums rounded once, half the bytes pass 1 writes and the fold pass or merge reads back. Session 20
# (`bench attention --sections window_partials --trace`, kernels alone, fp32 -> bf16 partials): the 16-row window
# 189.8 -> 174.5 µs at 1 stream and 128K keys (1.31x -> 1.22x the 1-row time), 101.2 -> 93.7 at 16 streams and 4K
# (1.33x -> 1.25x), 680.8 -> 626.6 at 16 streams and 32K; 1-row decodes level (145.0 / 142.5 at 128K).
PARTIALS = "bfloat16"


def _dequantizes(pool: KVPool) -> bool:
    """Whether the pass 1 dequantizes this pool's blocks (fp8, V by rows): then one compute warpgroup a CTA (parts =
    warpgroups). e4m3 pools split rows as bf16 ones do."""
    return pool.fp8 and not pool.keys_major


def unsupported(q_dtype, pool: KVPool, group: int, *, chunk: int, stages: int | None = None,
                interpret: bool = False, short_chunk: int | None = None) -> str | None:
    """Why a model's window calls cannot run the Mosaic GPU pass 1 (None: they can), from the model and cache
    layout alone: a window of up to MAX_WINDOW_ROWS rows must fit, so that every call of the model (a serial step
    or a drafted window) runs the same pass 1."""
    d = pool.k.shape[-1]
    if not mgpu_operands(q_dtype, pool):
        return f"bf16 queries over a bf16 or fp8 pool only; got q {jnp.dtype(q_dtype)}, pool {pool.k.dtype}"
    if d % 64 or d > 256:
        return f"a head dim that is a multiple of 64, at most 256; got {d}"
    ps = pool.page_size
    if pool.keys_major and ps % BLOCK_K:
        return f"pages of a multiple of {BLOCK_K} keys for an fp8 pool with v key-major; got {ps}"
    if ps % BLOCK_K and (BLOCK_K % ps or ps < 8):
        return f"pages of a multiple of {BLOCK_K} keys, or of 8..{BLOCK_K} keys dividing it; got {ps}"
    if chunk % BLOCK_K:
        return f"a chunk that is a multiple of {BLOCK_K} keys; got {chunk}"
    if short_chunk is not None and short_chunk % BLOCK_K:
        return f"a short chunk that is a multiple of {BLOCK_K} keys; got {short_chunk}"
    if compute_warpgroups(MAX_WINDOW_ROWS * group) > 2:
        return (f"at most {2 * WG_ROWS} packed rows ({MAX_WINDOW_ROWS} window rows x {group} query heads a KV head "
                f"is {MAX_WINDOW_ROWS * group})")
    for wgs in (1,) if _dequantizes(pool) else range(1, compute_warpgroups(MAX_WINDOW_ROWS * group) + 1):
        n = stages or stages_for(WindowMgpuTiles(), wgs)
        need = smem_bytes(wgs=wgs, stages=n, head_dim=d, interpret=interpret, fp8=pool.fp8, e4m3=pool.keys_major)
        if n < 1 or need > SMEM_BYTES:
            return f"{n} K/V stages with {wgs} compute warpgroups at head dim {d} need {need} bytes of shared memory"
    return None


@functools.partial(jax.jit, static_argnames=("scale", "chunk", "short_chunk", "n_chunks", "nc_pad", "max_keys",
                                             "tiles", "partials", "interpret"))
def window_partials_mgpu(q: jax.Array, pool: KVPool, page_table: jax.Array, cache_len: jax.Array, *, scale: float,
                         chunk: int, n_chunks: int, nc_pad: int, max_keys: int, tiles: WindowMgpuTiles,
                         short_chunk: int | None = None, q_packed: jax.Array | None = None,
                         partials: str = "float32", size_len: jax.Array | None = None,
                         interpret: bool | plgpu.InterpretGPUParams = False):
    """`attention.window_partials` on Mosaic GPU (the caller checked the model with `unsupported`): q [S, R, Hq, D]
    bf16; page_table [S, Pmax'] covering n_chunks chunks of `chunk` keys; cache_len [S] -> m, l [S, Hkv, nc_pad, M]
    fp32, acc [S, Hkv, nc_pad, M, D] in `partials` ("float32" or "bfloat16"), M = attention._padded_rows(R G).
    q_packed: `pack_queries(q, Hkv)` made by the caller (`attn_prep` writes it), read in its place. size_len [S]:
    the counts that set the streams' chunk size (None: min(cache_len, max_keys), the keys' own)."""
    _, r, hq, _ = q.shape
    hkv = pool.k.shape[0]
    qp = pack_queries(q, hkv) if q_packed is None else check_packed(q_packed, q, hkv)
    lens = cache_len.astype(jnp.int32)
    if size_len is not None:
        lens = jnp.concatenate([lens, size_len.astype(jnp.int32)])
    operands = (lens, page_table.astype(jnp.int32), qp, pool.k, pool.v)  # the kernel's order
    if pool.fp8:
        operands += (pool.k_scale, pool.v_scale)
    e4m3 = pool.keys_major  # V key-major: both MMAs on the codes (`_kernel_call`'s dequant "e4m3")
    if e4m3:
        q_hi, q_lo, q_inv = split_queries(qp)
        operands = operands[:2] + (q_hi,) + operands[3:] + (q_lo, q_inv)
    warpgroups = qp.shape[2] // WG_ROWS
    real_rows = r * (hq // hkv)
    parts = warpgroups if tiles.split_rows or _dequantizes(pool) else 1
    static = dict(scale=scale, chunk=chunk, short_chunk=short_chunk, n_chunks=n_chunks, nc_pad=nc_pad,
                  real_rows=real_rows,
                  mrows=_padded_rows(real_rows), max_keys=max_keys,
                  stages=stages_for(tiles, warpgroups // parts), parts=parts, ping_pong=tiles.ping_pong,
                  partials=partials, dequant="e4m3" if e4m3 else tiles.dequant, sized=size_len is not None)
    with jax.named_scope("attn_window_chunks_mgpu"):
        if interpret:
            return _kernel_call(*operands, interpret=interpret, **static)
        return tuple(_PARTIALS(*operands, **static))
