"""Paged attention for verify windows (trees and chains) and prompt chunks, over a bf16/fp32 or fp8 KV pool.

Letters: s streams, t/r query rows, h query heads, g KV heads, d head dim, l key positions.
Query head h reads KV head h // (Hq/Hkv). Softmax in fp32. Queries q [S, T, Hq, D] arrive after q-norm and RoPE.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.calls import pallas_call
from pallas_kernels import kv_quant
from pallas_kernels.kv_quant import KVPool, as_stored, check_v_layout, gather_stream

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


# ================================================================================================================
# Kernels (Pallas, Triton lowering). Shared conventions:
#   * K/V are read page-wise from the pool through the stream's page table; key block b of a stream always covers
#     absolute positions [b*block_k, (b+1)*block_k), so which keys share a block never depends on the call.
#   * Logits and the softmax run in fp32. Dots take bf16 operands (fp8 codes are widened to bf16 exactly, their
#     scales applied to logit columns and to P's columns; or f16 with fp8_dot="float16", see WindowTiles) unless q
#     or the pool is fp32, then fp32 at IEEE precision.
#   * Masked logits are -inf; a fully masked block is an exact no-op of the online update (alpha = 1, p = 0), so
#     visiting extra blocks never changes a row's bits.
# ================================================================================================================

_LOG2E = math.log2(math.e)
SMEM_BYTES = 227 * 1024  # shared memory a program may use on the H100/H200 (sm_90)
# The most chunks a stream's committed keys make where they are cut shorter than `WindowTiles.chunk`
# (`WindowTiles.short_chunk`): 8, one group of the fold (`WindowTiles.fold`), so a short context never needs it.
SHORT_CHUNKS = 8
# `WindowTiles.short_chunk` in the shipped tiles (`window_tiles`): two of the Mosaic GPU pass 1's 64-key blocks.
SHORT_CHUNK = 128


def stream_chunking(n_keys, chunk: int, short_chunk: int | None):
    """(keys a chunk, chunks) of a stream with n_keys committed keys (an int32 scalar >= 0, traced inside a kernel
    or not): chunks of `chunk`, or with short_chunk the least of short_chunk, 2 short_chunk, ... chunk that cuts
    n_keys into at most SHORT_CHUNKS (else `chunk`). Only min / max / multiply / divide on scalars, so the Triton and
    Mosaic GPU kernels and XLA all compute it alike."""
    size = chunk
    if short_chunk is not None and short_chunk < chunk:
        size, step = short_chunk, short_chunk
        while step < chunk:  # thresholds rise, so once a factor is 1 every later one is too
            size = size * (1 + lax.clamp(0, n_keys - SHORT_CHUNKS * step, 1))
            step *= 2
    size = jnp.asarray(size, jnp.int32)
    return size, lax.div(n_keys + size - 1, size)


def table_chunks(max_keys: int, chunk: int, short_chunk: int | None) -> int:
    """The most chunks any stream of a table of max_keys keys makes (`stream_chunking`): the chunk programs of a
    call and the partials a merge may add."""
    n = -(-max_keys // chunk)
    if short_chunk is None or short_chunk >= chunk:
        return n
    return max(n, min(SHORT_CHUNKS, -(-max_keys // short_chunk)))


@dataclasses.dataclass(frozen=True)
class WindowTiles:
    """Tiles of the verify/decode kernel. `block_k`, `chunk` and `fp8_dot` fix a row's reduction order; keep them
    constant for a model and cache layout (window_tiles() picks them from shapes that are). Everything else is a
    launch choice that never changes a row's bits: the number of chunk programs (more pages in the table means more
    programs, never a different order), the page walk, warps, stages, how the merge is split and unrolled, and
    whether it folds the chunk groups itself."""
    # block_k 32 on 64-key pages: each page's index is read once and its two blocks are plain loads; on the H200
    # that decoded 32K bf16 in 126 µs against 151 µs for 64-key blocks gathered through the table
    # (docs/kernels/attention.md).
    block_k: int = 32  # keys per online-softmax step
    chunk: int = 512  # keys per partial (m, l, acc); partials are folded one at a time in chunk order
    # Short contexts (order): None, every stream's keys in chunks of `chunk`; else a stream of n committed keys cuts
    # them into chunks of the least power-of-two multiple of short_chunk, up to `chunk`, that leaves at most
    # SHORT_CHUNKS of them (`stream_chunking`). A function of the stream's own context, so a row's bits still follow
    # only its stream; what it buys is programs: a 1K-key context at chunk 1024 is one program a KV head, four on
    # the whole GPU at one stream, each walking its keys alone.
    short_chunk: int | None = None
    # "bfloat16": fp8 codes widened to bf16 (exact), P·vs rounded to bf16. "float16": codes widened to f16 (exact,
    # and a native conversion on sm_90, where e4m3 -> bf16 is not), q rounded to f16 (exact for bf16 queries of
    # magnitude 2^-14 .. 65504, which RMS-normed queries are), P·(vs / block max of vs) rounded to f16 (3 more
    # mantissa bits than bf16; the block max is applied to the fp32 product). Only fp8 pools read this.
    fp8_dot: str = "bfloat16"
    # fp8 pools with f16 dots (order): what V's scales are taken relative to. "block": each row's max over the
    # block's keys it sees, which multiplies the block's P V product before it joins the running O (`_pv`). "chunk":
    # the largest scale among the chunk's committed keys, read once before the walk (`_chunk_v_max`); each block's
    # P V then accumulates into the running O inside the MMA, and that max multiplies the chunk's partial once. A
    # function of the stream's committed keys alone, like the block's. The Triton pass 1 only (the prompt kernel
    # keeps "block"). Offline sm_90 (pip Triton 3.6, V key-major): the 1-row step 625 -> 495 SASS instructions,
    # 140 -> 128 registers (tools/offline/triton_sm90.py --fp8 --v-layout keys --tiles fp8_v_max=chunk).
    fp8_v_max: str = "block"
    # block_k < page: "page" walks a page's blocks in an inner loop after reading its index once; "flat" runs one
    # loop over blocks and reads the page index per block (one loop for Triton to pipeline). Same bits.
    walk: str = "flat"  # flat since session 7: 1-row decode 48.9 / 81.6 / 193.5 µs at 4K / 32K / 128K vs 57.5 / 80.6 / 201.2
    num_warps: int | None = None  # None: 4 for up to 32 packed rows, else 8
    # None: 3 for up to 32 packed rows, else 2 (2 more for the flat walk), lowered until pass_one_smem_bytes fits
    # SMEM_BYTES. Three stages of 64-key bf16 K/V blocks beside a 128x256 query tile asked for 256 KiB (the H200
    # has 227 KiB).
    num_stages: int | None = None
    # Chunk partials folded into one group partial (order). A table of more than `fold` chunks gets a fold pass
    # between the two: every run of `fold` chunks, on the absolute chunk grid, is folded in chunk order by its own
    # programs, and the merge adds the group partials in group order. A table of at most `fold` chunks skips the
    # pass; a stream's bits are the same either way (its one group's partial, added to zeros, is itself), so they
    # never depend on the table width. On the H200 the single merge cost ~0.4 µs a chunk in sequence: 100 µs of
    # the 287 µs 1-row decode at 128K (bench attention --sections compare, session 7).
    fold: int = 8  # 8: 183.8 µs at 128K against 201.2 for 16 and 298.7 for one pass; level at 32K
    fold_block_d: int | None = None  # head-dim columns per fold program (None: enough programs to fill the GPU)
    # Tables of more than `fold` chunks: True runs no fold pass; each merge program folds every group of `fold`
    # chunk partials itself (chunk order inside a group, from zeros, weighted against the committed max) and adds
    # each group's sum to its running total in group order: the fold pass's operations and the merge's, in their
    # order, so the same bits, in one launch instead of two. False: the fold pass. None: `fold_in_merge`'s rule on
    # the call's static shape (few (stream, KV head) pairs and a short table: fused). At 1 stream on the H200 a
    # 1-row decode of 32K keys over a bf16 pool took 41.0 µs fused against 44.8 (kernels alone, session 22).
    fold_in_merge: bool | None = None
    # Packed rows per chunk program (None: all; a power of two >= 16). A 16-row window packs 128 rows per KV head;
    # in 64-row programs each chunk's keys are read twice but a program holds half the accumulator (the 128-row
    # program used 255 registers and spilled in the offline compile). Order: a row's sums follow the layout of
    # its program's rows and warps.
    row_block: int | None = None
    merge_block_d: int | None = None  # head-dim columns per merge program (None: enough programs to fill the GPU)
    # Packed rows per merge program (None: `merge_rows`' rule; else a power of two, at least 16): a window's rows
    # split over programs of their own, each merging its rows alone, so that a call with few (stream, KV head,
    # column block) programs spreads its merge over more. A row's operations do not change with the rows beside it.
    merge_block_rows: int | None = None
    merge_unroll: int | None = None  # chunk partials loaded per merge loop step (None: fit registers)
    merge_num_warps: int = 4
    # "early": the merge issues every load (context length, queries, window rows, maxima, each partial) before it
    # waits on any (`_merge_early`), the loop merge's operations in its order; "loop": it loads the partials a loop
    # step at a time, masked by the context. None: early where the program's partials fit MERGE_EARLY_ELEMENTS.
    # (A third, "groups", folded a fused merge's groups side by side as [G, M, BD] slabs; on the H200 its merge
    # took 5.9 µs against the early merge's 5.1 at the 1-stream bf16 32K decode, session 24: removed. So was the
    # fold pass with the merge in its last program by tickets, one launch for two: 5.9-7.0 µs against 5.6-6.3 for
    # the two launches at one stream, 14.0 against 12.1 at 16 streams over bf16 pools; it won only at 16 streams
    # over fp8 pools, 19.3 against 21.8, where the merge after the fold pass is the loop merge.)
    merge_loads: str | None = None
    # What follows pass 1 (order). "passes": the fold pass (tables of more than `fold` chunks) and the merge, each
    # a launch of its own. "tickets": one launch; after storing its partial, each chunk program takes a ticket
    # (an atomic add) on its group of `fold` chunks, the group's last program folds the group in chunk order
    # relative to the group's own max, takes a ticket on the stream's groups, and the last of those adds the group
    # partials in order and the window's own keys. A stream whose context fits one group gets the bits of the
    # one-pass merge either way; longer ones round differently from "passes" (their groups are weighted by the
    # group max, then rescaled). Session 9's Nsight Compute run put pass 1 of the 32K decode at 37 µs of the
    # call's 55 µs of kernels, the fold, merge and a slice at the rest.
    tail: str = "passes"
    # Pass 1's kernel (order). "triton": the chunk kernel below. "mgpu": bf16 queries over a bf16 or fp8 pool run
    # pass 1 on Mosaic GPU (`attention_window_mgpu`: 64-key blocks, wgmma, TMA, fp8 codes dequantized to bf16 in
    # shared memory; its own bits; block_k, walk, num_warps and fp8_dot are not read there, num_stages is its K/V
    # slots, row_block its split_rows (<= 64 splits; None: split on small grids,
    # `attention_window_mgpu.SPLIT_MAX_CTAS`), a launch choice there); the fold pass and the merge are this
    # module's either way, and fp32 pools stay on the Triton kernel. Needs tail "passes".
    impl: str = "triton"
    # The dtype pass 1 stores a chunk's O partial in (order; its m and l stay fp32). "bfloat16": the unnormalised
    # fp32 accumulator rounded once to bf16 (a relative error of at most 2^-9 an element, the size of the output's
    # own rounding), half the bytes the fold pass or the merge reads back; the fold and merge widen it to fp32.
    # Only the Mosaic GPU pass 1 stores bf16; the Triton pass 1 takes "float32" only.
    partials: str = "float32"


@dataclasses.dataclass(frozen=True)
class PromptTiles:
    """Tiles of the prompt-chunk kernel. `block_k` and `fp8_dot` fix a row's reduction order (key blocks on the
    absolute grid); `block_q`, the launch parameters and `contiguous` never change a row's bits. contiguous: copy
    each stream's pages into contiguous K/V first (one gather at copy speed, small next to the compute-bound
    kernel), so the kernel's loads carry no page-table indirection."""
    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    contiguous: bool = True
    fp8_dot: str = "bfloat16"  # as WindowTiles.fp8_dot
    # "triton": the kernel below. "mgpu": bf16 q over a bf16 or fp8 pool runs `attention_mgpu.prompt_mgpu` (Mosaic
    # GPU, FA3-style, its default PromptMgpuTiles; the fields above are not read; fp8 codes dequantized to bf16 in
    # its gather), its own bits (order); fp32 pools stay on the Triton kernel.
    impl: str = "triton"


# `WindowTiles.fp8_v_max` of the shipped fp8 tiles: "chunk" since session 36 (H100, run.sh hundred-forty-third: its
# gpu tests and the engine's fp8 gate pass; with key-major V the 16-row window's pass 1 at one stream took 106 µs at
# 32K and 395 µs at 128K against 136 and 509 with "block", the 1-row window 36.5 / 117.5 µs against 37.6 / 118.9).
FP8_V_MAX = "chunk"


def window_tiles(*, page_size: int, max_keys: int, head_dim: int, fp8: bool) -> WindowTiles:
    """The shipped verify/decode tiles: the one place they are chosen. Arguments are fixed for a model and cache
    layout (page size, page-table width x page size, head dim, KV dtype), never the streams or rows of a call,
    so the reduction order they set is the same in every program of the engine."""
    del max_keys, head_dim  # measured best so far (docs/kernels/attention.md, sessions 7 and 8)
    # fp8: f16 dots (codes widened natively) with the flat walk: 1-row decode 62.9 / 92.0 / 168.6 µs at 4K / 32K /
    # 128K against 80.5 / 115.5 / 213.2 with bf16 dots and the page walk. Packed rows split in programs of 32
    # (windows of more than 5 rows; a 1-row window's 6 packed rows are one block either way): the 16-row window
    # 78.6 / 214.6 / 703.0 µs against 134.1 / 246.7 / 813.1 in one program. For bf16 pools the split won only at 4K
    # (72.0 vs 85.0) and lost at 32K / 128K (192.9 / 648.7 vs 148.1 / 425.5), so they keep one program.
    # Session 20 shipped bf16 dots for fp8 pools when the engine's fp8 gate failed on the H200 with f16 ones
    # (concurrent != solo at the first decode step). The cause (session 21): the f16 path scaled P·vs by the block's
    # max V scale over all its keys, stale slots past the context among them, so a row's bits followed whatever a
    # reused page still held; `_pv` now takes each row's max over the keys it sees, and the gate passes with f16
    # dots (tools/gpu/run.sh eighty-sixth). f16 again since: that run's window_fp8 (kernels alone, traced) decoded
    # 1 stream at 4K / 32K / 128K in 24.1 / 39.3 / 114.3 µs against 29.1 / 40.5 / 124.6 with bf16 dots, 16 streams
    # at 32K in 395.6 against 459.7 (at 4K 70.8 against 68.2); its 16-row windows were 2-6 % slower.
    # Short contexts in short chunks (session 28): at one stream a 1K-key decode ran one chunk program a KV head
    # (21.4 µs a layer in the 27B round at 1K context, session 18, where its keys' bytes take ~1 µs).
    tiles = WindowTiles(fp8_dot="float16", row_block=32, fp8_v_max=FP8_V_MAX) if fp8 else WindowTiles()
    short = max(SHORT_CHUNK, page_size)
    return dataclasses.replace(tiles, short_chunk=short if short < tiles.chunk else None)


# Which pass 1 a window call without explicit tiles runs: "auto" (the Mosaic GPU pass 1 for bf16 pools compiled
# for a GPU where the model's shapes allow it, `window_mgpu_eligible`; the Triton one in interpret mode and for fp8
# pools), "triton" or "mgpu". The choice depends on the model and cache layout only, never on a call's rows, so a
# serial step and a row of a drafted window always share a kernel.
WINDOW_IMPL = "auto"


# Which prompt-chunk kernel a call without explicit tiles runs: "auto" (the Mosaic GPU kernel for bf16 and fp8
# pools compiled for a GPU, the Triton kernel in interpret mode and for fp32 pools), "triton" or "mgpu". On the
# H200 (session 14, `bench attention --sections prompt_mgpu`) the Mosaic GPU kernel took 547 / 5651 us for a 4K chunk after 0 /
# 32K keys against the Triton kernel's 849 / 12691 and cuDNN's 554 / 4962.
PROMPT_IMPL = "auto"


def prompt_tiles(*, page_size: int, max_keys: int, head_dim: int, fp8: bool) -> PromptTiles:
    """The shipped prompt-chunk tiles (as window_tiles: from the model and cache layout only)."""
    del page_size, max_keys, head_dim, fp8
    return PromptTiles()


def _itemsize(dtype) -> int:
    return jnp.dtype(dtype).itemsize


def pass_one_smem_bytes(*, mrows: int, head_dim: int, block_k: int, num_stages: int, kv_dtype, cdt) -> int:
    """Estimated shared memory of a window chunk program: the query tile, `num_stages` buffers of a K and a V
    block, and for fp8 one widened K and V block staged for the dot. Matches the two overflows seen on the H200
    (3 stages of 64-key bf16 blocks beside 128 rows: 256 KiB asked)."""
    kv = 2 * block_k * head_dim * _itemsize(kv_dtype) + (2 * block_k * 4 if _itemsize(kv_dtype) == 1 else 0)
    widened = 2 * block_k * head_dim * _itemsize(cdt) if _itemsize(kv_dtype) == 1 else 0
    return mrows * head_dim * _itemsize(cdt) + num_stages * kv + widened


def prompt_smem_bytes(tiles: PromptTiles, *, head_dim: int, kv_dtype, cdt) -> int:
    """Estimated shared memory of a prompt program (as pass_one_smem_bytes, with block_q query rows)."""
    return pass_one_smem_bytes(mrows=tiles.block_q, head_dim=head_dim, block_k=tiles.block_k,
                               num_stages=tiles.num_stages, kv_dtype=kv_dtype, cdt=cdt)


def window_launch(tiles: WindowTiles, *, mrows: int, head_dim: int, kv_dtype, cdt) -> tuple[int, int]:
    """(num_warps, num_stages) of the chunk programs for `mrows` packed rows."""
    warps = tiles.num_warps or (4 if mrows <= 32 else 8)
    if tiles.num_stages:
        return warps, tiles.num_stages
    # The flat walk's page-index load takes pipeline stages of its own: Triton 3.6 keeps one K/V buffer in flight
    # at 3 or 4 stages and two at 5 (offline compile, docs/kernels/attention.md).
    stages = (3 if mrows <= 32 else 2) + (2 if tiles.walk == "flat" else 0)
    while stages > 1 and pass_one_smem_bytes(mrows=mrows, head_dim=head_dim, block_k=tiles.block_k,
                                             num_stages=stages, kv_dtype=kv_dtype, cdt=cdt) > SMEM_BYTES:
        stages -= 1
    return warps, stages


def _pad_table(page_table: jax.Array, keys: int, page_size: int) -> jax.Array:
    """Widen the table with dummy page 0 to cover `keys` positions, so a key block never indexes past it (those
    keys lie beyond max_keys and are masked)."""
    pages = -(-keys // page_size)
    page_table = page_table.astype(jnp.int32)
    return jnp.pad(page_table, ((0, 0), (0, max(0, pages - page_table.shape[1]))))


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _padded_rows(n: int) -> int:
    """Rows an MMA tile holds for n rows (packed query rows, window keys): a power of two, at least 16."""
    return max(16, _pow2(n))


def _row_parts(real_rows: int, rows: int) -> int:
    """Programs of `rows` packed rows that hold `real_rows` real ones: none of padding rows alone is run."""
    return -(-real_rows // rows)


def _pow2_floor(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


def mgpu_operands(q_dtype, pool: KVPool) -> bool:
    """Whether the Mosaic GPU attention kernels (prompt and window pass 1) take these operands: bf16 queries over a
    bf16 or fp8 pool. fp32 queries or pools stay on the Triton kernels."""
    return jnp.dtype(q_dtype) == jnp.bfloat16 and (pool.fp8 or pool.k.dtype == jnp.bfloat16)


def _compute_dtype(q_dtype, pool: KVPool, fp8_dot: str = "bfloat16"):
    if jnp.float32 in (jnp.dtype(q_dtype), jnp.dtype(pool.k.dtype)):
        return jnp.float32
    return jnp.float16 if pool.fp8 and fp8_dot == "float16" else jnp.bfloat16


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] @ b [K, N] -> fp32; fp32 operands at IEEE precision (the default would be tf32 on the GPU)."""
    precision = _HI if a.dtype == jnp.float32 else None
    return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


def _seen_scales(vs: jax.Array, visible: jax.Array | None) -> jax.Array:
    """V's scales vs [BK] as each row sees them: [1 or M, BK], zero at keys the row does not see (a stale slot's
    scale must never reach a row's bits)."""
    return vs[None, :] if visible is None else jnp.where(visible, vs[None, :], 0.0)


def _pv(p: jax.Array, v: jax.Array, vs: jax.Array | None, visible: jax.Array | None, cdt) -> jax.Array:
    """sum_j p[m, j] * vs[j] * v[j, :] in fp32: p [M, BK] fp32; v [BK, D]; vs [BK] or None; visible [M, BK] bool
    or None (all visible) -> [M, D]. f16 operands (fp8 pools only) take vs relative to the row's max over the keys
    it sees, so P·vs stays in f16's normal range for every p that matters; that max multiplies the fp32 product.
    The max is per row and over visible keys only: a block also holds keys past the context (stale values a reused
    page still holds) and a window holds other branches' keys, and a max over those made a row's bits follow them
    (the f16 engine gate's concurrent != solo on the H200, session 20)."""
    if vs is None:
        return _dot(p.astype(cdt), v.astype(cdt))
    if cdt == jnp.float16:
        seen = _seen_scales(vs, visible)
        top = jnp.max(seen, axis=1)
        top = jnp.where(top > 0, top, 1.0)
        return _dot((p * (seen / top[:, None])).astype(cdt), v.astype(cdt)) * top[:, None]
    return _dot((p * vs[None, :]).astype(cdt), v.astype(cdt))


def _online_step(carry, q, k, v, ks, vs, visible, scale: float, cdt, v_inv=None):
    """One online-softmax step over a key block. carry (m [M], l [M], acc [M, D]) fp32; q [M, D] cdt;
    k, v [BK, D]; ks, vs [BK] or None; visible [M, BK] bool or None (all visible). v_inv (f16 dots over an fp8
    pool, `WindowTiles.fp8_v_max` "chunk"): 1 / the chunk's largest V scale, by which P·vs is taken, the product
    accumulated into acc as it stands (the caller multiplies the chunk's acc by that max)."""
    m, l, acc = carry
    logits = _dot(q, k.astype(cdt).T)
    logits = logits * (ks[None, :] * scale if ks is not None else scale)
    if visible is not None:
        logits = jnp.where(visible, logits, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(logits, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(logits - m_new[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    if v_inv is not None:
        seen = _seen_scales(vs, visible)
        return m_new, l, acc * alpha[:, None] + _dot((p * (seen * v_inv)).astype(cdt), v.astype(cdt))
    acc = acc * alpha[:, None] + _pv(p, v, vs, visible, cdt)
    return m_new, l, acc


def _v_rows(v_ref, page, rows, v_keys: bool) -> jax.Array:
    """Value rows `rows` (a pl.ds of keys) of one page as [keys, D]: v_ref [P, page, D], or [P, D, page] where
    v_keys (`KVPool.v_layout` "keys"), whose block is loaded with the keys contiguous and transposed as a value."""
    return v_ref[page, :, rows].T if v_keys else v_ref[page, rows, :]


def _v_pages(v_ref, pages, block_k: int, v_keys: bool) -> jax.Array:
    """Whole pages `pages` [n] of v_ref (as `_v_rows`) as [n * page, D] rows."""
    if v_keys:
        return jnp.swapaxes(v_ref[pages], 1, 2).reshape(block_k, v_ref.shape[-2])
    return v_ref[pages].reshape(block_k, v_ref.shape[-1])


def _walk_pages(carry, step, pt_ref, k_ref, v_ref, ks_ref, vs_ref, *, first_key, n_keys, span: int,
                block_k: int, page_size: int, walk: str = "page", v_keys: bool = False):
    """Fold step(carry, first, k, v, ks, vs) over the key blocks of [first_key, first_key + span) that hold keys
    < n_keys, in order (the same blocks in the same order for either `walk`). first_key and span are multiples of
    max(block_k, page_size) where page_size > block_k.
    k_ref, v_ref [P, page, D] (v_keys: v_ref [P, D, page]); ks_ref, vs_ref [P, page] or None; pt_ref [Pmax]."""
    d = k_ref.shape[-1]
    if block_k >= page_size:
        n = block_k // page_size

        def body(b, carry):
            first = first_key + b * block_k
            pages = pt_ref[pl.ds(first // page_size, n)]
            k = k_ref[pages].reshape(block_k, d)
            v = _v_pages(v_ref, pages, block_k, v_keys)
            ks = None if ks_ref is None else ks_ref[pages].reshape(block_k)
            vs = None if vs_ref is None else vs_ref[pages].reshape(block_k)
            return step(carry, first, k, v, ks, vs)

        n_blocks = jnp.clip((n_keys - first_key + block_k - 1) // block_k, 0, span // block_k)
        return jax.lax.fori_loop(0, n_blocks, body, carry)

    if walk == "flat":
        def flat_body(b, carry):
            first = first_key + b * block_k
            # (first - page*size rather than %: the Triton lowering of a signed % inside a loop fails)
            logical = first // page_size
            page, rows = pt_ref[logical], pl.ds(first - logical * page_size, block_k)
            ks = None if ks_ref is None else ks_ref[page, rows]
            vs = None if vs_ref is None else vs_ref[page, rows]
            return step(carry, first, k_ref[page, rows, :], _v_rows(v_ref, page, rows, v_keys), ks, vs)

        n_blocks = jnp.clip((n_keys - first_key + block_k - 1) // block_k, 0, span // block_k)
        return jax.lax.fori_loop(0, n_blocks, flat_body, carry)

    per_page = page_size // block_k

    def page_body(i, carry):
        page_first = first_key + i * page_size
        page = pt_ref[page_first // page_size]

        def body(b, carry):
            rows = pl.ds(b * block_k, block_k)
            ks = None if ks_ref is None else ks_ref[page, rows]
            vs = None if vs_ref is None else vs_ref[page, rows]
            return step(carry, page_first + b * block_k, k_ref[page, rows, :], _v_rows(v_ref, page, rows, v_keys),
                        ks, vs)

        n_blocks = jnp.clip((n_keys - page_first + block_k - 1) // block_k, 0, per_page)
        return jax.lax.fori_loop(0, n_blocks, body, carry)

    n_pages = jnp.clip((n_keys - first_key + page_size - 1) // page_size, 0, span // page_size)
    return jax.lax.fori_loop(0, n_pages, page_body, carry)


def _packed_rows(mrows: int, r: int, hq: int, group: int, g, first=0) -> tuple[jax.Array, jax.Array]:
    """Row m of KV head g's block is query head g*G + h of window row r (m = r*G + h): for rows first ..
    first + mrows - 1, (index into the [R*Hq, D] view of q, whether m is a real row)."""
    m = first + jnp.arange(mrows)
    node = m // group
    real = node < r
    return jnp.where(real, node * hq + g * group + m % group, 0), real


# ----------------------------------------------------------------------------------------------------------------
# Verify/decode window: pass 1, one program per (stream, KV head, chunk of committed keys)
# ----------------------------------------------------------------------------------------------------------------

def _window_chunk_kernel(cache_len_ref, pt_ref, q_ref, k_ref, v_ref, *refs, fp8: bool, scale: float, r: int,
                         group: int, mrows: int, parts: int, max_keys: int, page_size: int, tiles: WindowTiles, cdt,
                         v_keys: bool = False, sized: bool = False):
    # cache_len_ref [S]: the streams' key counts (sized: [2 S], then the counts that set their chunk size,
    # `window_partials`' size_len); pt_ref [Pmax]; q_ref [R*Hq, D] (this stream); k_ref, v_ref [P, page, D] (this KV head;
    # v_keys: v_ref [P, D, page]);
    # fp8: ks_ref, vs_ref [P, page]; outputs m_ref, l_ref [MB], acc_ref [MB, D] fp32: this chunk's partial
    # relative to its own max for packed rows part*MB .. part*MB + MB - 1 (mrows = MB; axis 1 of the grid is
    # KV head x parts); rows r*G + h, rows past R*G left unwritten.
    if fp8:
        ks_ref, vs_ref, m_ref, l_ref, acc_ref = refs
    else:
        ks_ref = vs_ref = None
        m_ref, l_ref, acc_ref = refs
    s, gp, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    g, part = gp // parts, gp % parts
    n_keys = jnp.minimum(cache_len_ref[s], max_keys)
    size = stream_chunking(cache_len_ref[cache_len_ref.shape[0] // 2 + s] if sized else n_keys, tiles.chunk,
                           tiles.short_chunk)[0]
    n_chunks = lax.div(n_keys + size - 1, size)

    @pl.when(c < n_chunks)
    def _():
        idx, real = _packed_rows(mrows, r, q_ref.shape[0] // r, group, g, part * mrows)
        m, l, acc = _chunk_partial(q_ref[idx].astype(cdt), pt_ref, k_ref, v_ref, ks_ref, vs_ref,
                                   chunk_start=c * size, span=size, n_keys=n_keys, scale=scale,
                                   page_size=page_size, tiles=tiles, cdt=cdt, v_keys=v_keys)
        plgpu.store(m_ref, m, mask=real)
        plgpu.store(l_ref, l, mask=real)
        plgpu.store(acc_ref, acc, mask=real[:, None])


def _chunk_partial(q, pt_ref, k_ref, v_ref, ks_ref, vs_ref, *, chunk_start, span, n_keys, scale: float,
                   page_size: int, tiles: WindowTiles, cdt, v_keys: bool = False):
    """One chunk's online-softmax partial (m [M], l [M], acc [M, D], relative to m) for packed query rows q
    [M, D] over the committed keys chunk_start .. chunk_start + span - 1 below n_keys (span: the stream's chunk,
    `stream_chunking`)."""
    mrows, bk = q.shape[0], tiles.block_k
    v_max = (_chunk_v_max(pt_ref, vs_ref, chunk_start=chunk_start, span=span, n_keys=n_keys, chunk=tiles.chunk,
                          page_size=page_size) if _chunk_scaled(tiles, vs_ref is not None, cdt) else None)

    def step(carry, first, k, v, ks, vs):
        visible = jnp.broadcast_to((first + jnp.arange(bk) < n_keys)[None, :], (mrows, bk))
        return _online_step(carry, q, k, v, ks, vs, visible, scale, cdt, None if v_max is None else 1.0 / v_max)

    init = (jnp.full((mrows,), -jnp.inf, jnp.float32), jnp.zeros((mrows,), jnp.float32),
            jnp.zeros((mrows, q.shape[1]), jnp.float32))
    m, l, acc = _walk_pages(init, step, pt_ref, k_ref, v_ref, ks_ref, vs_ref, first_key=chunk_start, n_keys=n_keys,
                            span=span, block_k=bk, page_size=page_size, walk=tiles.walk, v_keys=v_keys)
    return m, l, acc if v_max is None else acc * v_max


def _chunk_scaled(tiles: WindowTiles, fp8: bool, cdt) -> bool:
    """Whether pass 1 takes V's scales relative to the chunk's max (`WindowTiles.fp8_v_max`)."""
    return fp8 and cdt == jnp.float16 and tiles.fp8_v_max == "chunk"


def _chunk_v_max(pt_ref, vs_ref, *, chunk_start, span, n_keys, chunk: int, page_size: int):
    """The largest V scale among the committed keys (< n_keys) of the chunk [chunk_start, chunk_start + span)
    (span <= chunk), 1 where that is 0 or there are none: from those keys alone. Reads the pages of `chunk` keys
    from the chunk's first (`_pass_one` widens the table by a chunk, so they are in it)."""
    n = max(1, chunk // page_size)
    first_page = chunk_start // page_size
    pages = pt_ref[pl.ds(first_page, n)]
    key = (first_page + jnp.arange(n))[:, None] * page_size + jnp.arange(page_size)[None, :]
    live = (key >= chunk_start) & (key < chunk_start + span) & (key < n_keys)
    top = jnp.max(jnp.where(live, vs_ref[pages], 0.0))
    return jnp.where(top > 0, top, 1.0)


# ----------------------------------------------------------------------------------------------------------------
# Verify/decode window: pass 2, fold the chunk partials in chunk order, then the window's own keys
# ----------------------------------------------------------------------------------------------------------------

def _committed_max(m_ref, n_chunks, real, max_block: int, mrows: int, first=0):
    """Max over the written chunk maxima first .. first + n_chunks - 1 of m_ref [NC, M] (exact in any order, so
    read `max_block` chunks at a time). Only the written (chunk, real row) entries are loaded: the rest were never
    stored."""
    def max_body(i, m):
        live = (i * max_block + jnp.arange(max_block)) < n_chunks
        start = i * max_block if isinstance(first, int) and first == 0 else first + i * max_block
        m_part = plgpu.load(m_ref.at[pl.ds(start, max_block), :],
                            mask=live[:, None] & real[None, :], other=-jnp.inf)
        return jnp.maximum(m, jnp.max(m_part, axis=0))

    return jax.lax.fori_loop(0, (n_chunks + max_block - 1) // max_block, max_body,
                             jnp.full((mrows,), -jnp.inf, jnp.float32))


def _load_entry(l_ref, acc_ref, m_ref, c, ok):
    """Entry c of l_ref [N, M], acc_ref [N, M, BD] and m_ref [N, M] (None: no maxima) for the rows where ok [M]
    holds (zeros and -inf elsewhere) -> (l [M, 1], acc [M, BD] fp32, m [M, 1] or None). Per-row values travel as
    [M, 1] columns: beside the [M, BD] partials Triton then keeps each entry's weight out of shared memory, where a
    [M] vector's layout made it convert every entry's weight (a barrier each; offline sm_90 compile, session 23)."""
    l_c = plgpu.load(l_ref.at[c], mask=ok, other=0.0)[:, None]
    # (bf16 partials, `WindowTiles.partials`, widen exactly to fp32 before any arithmetic)
    acc_c = plgpu.load(acc_ref.at[c], mask=ok[:, None], other=0.0).astype(jnp.float32)
    m_c = None if m_ref is None else plgpu.load(m_ref.at[c], mask=ok, other=-jnp.inf)[:, None]
    return l_c, acc_c, m_c


def _add_entry(carry, entry, live, base):
    """carry (l [M, 1], acc [M, BD]) plus a loaded entry (l [M, 1], acc, m [M, 1] or None), weighted by
    exp(m - base) where it has a max (base [M, 1]), where live holds. Every fold of partials adds through here, so
    the fold pass, the merges and the merge that folds the groups itself run the same operations. The weight is
    exp2((m - base) log2 e): on the GPU about 3 instructions where exp took ~14 (the merges' weights are a large
    share of their instructions, session 23)."""
    l, acc = carry
    l_c, acc_c, m_c = entry
    if m_c is not None:
        w = jnp.exp2((m_c - base) * _LOG2E)
        l_c, acc_c = w * l_c, w * acc_c
    # A select, not an added zero: a step past the context must not even flip the sign of a zero.
    return jnp.where(live, l + l_c, l), jnp.where(live, acc + acc_c, acc)


def _zero_sums(mrows: int, bd: int):
    return jnp.zeros((mrows, 1), jnp.float32), jnp.zeros((mrows, bd), jnp.float32)


def _row(column: jax.Array) -> jax.Array:
    """[M, 1] -> [M], bit for bit (a max over one value)."""
    return jnp.max(column, axis=1)


def _fold_columns(l_ref, acc_ref, m_ref, *, first, count: int, n_live, real, base, unroll: int, mrows: int,
                  bd: int):
    """`_fold_in_order` on columns: base [M, 1]; -> (l [M, 1], acc [M, BD])."""
    def body(i, carry):
        for k in range(unroll):
            c = first + i * unroll + k
            live = c < n_live
            carry = _add_entry(carry, _load_entry(l_ref, acc_ref, m_ref, c, real & live), live, base)
        return carry

    steps = (jnp.clip(n_live - first, 0, count) + unroll - 1) // unroll
    return jax.lax.fori_loop(0, steps, body, _zero_sums(mrows, bd))


def _fold_in_order(l_ref, acc_ref, m_ref, *, first, count: int, n_live, real, m_base, unroll: int, mrows: int,
                   bd: int):
    """Sum of entries first .. first + count - 1 (those below n_live) of l_ref [N, M] and acc_ref [N, M, BD], one
    entry at a time in index order (elementwise, no cross-lane reduction, so the order depends on entry positions
    only: not on `unroll` (entries loaded per loop step), the head-dim split, warps or layouts). m_ref: chunk
    maxima [N, M], each entry weighted by exp(m - m_base) (m_base [M]); None: the entries are already relative to
    m_base. Entries past n_live are never read, and only real rows are loaded. -> (l [M], acc [M, BD])."""
    l, acc = _fold_columns(l_ref, acc_ref, m_ref, first=first, count=count, n_live=n_live, real=real,
                           base=m_base[:, None], unroll=unroll, mrows=mrows, bd=bd)
    return _row(l), acc


def _fold_groups_in_order(l_ref, acc_ref, m_ref, *, n_chunks, real, m_base, fold: int, unroll: int, mrows: int,
                          bd: int):
    """The fold pass and the merge's sum over its group partials in one program: each run of `fold` chunk partials
    (l_ref [NC, M], acc_ref [NC, M, BD], maxima m_ref [NC, M]; NC a multiple of fold) on the absolute chunk grid
    folded from zeros in chunk order, weighted by exp(m - m_base), as `_window_fold_kernel` folds it; the group
    sums added from zeros in group order, as `_window_merge_kernel` adds the fold pass's output. Same operations
    in the same order, so the same bits (a padding row's group sum is zero here, as the merge's masked load of it
    is). A loop step loads `unroll` chunks (rounded down to a power of two) before it adds any: whole groups where
    that covers `fold`, so the dependent memory round trips number about chunks / unroll, not chunks.
    -> (l [M], acc [M, BD])."""
    n_groups = (n_chunks + fold - 1) // fold
    per_step = _pow2_floor(unroll)
    base = m_base[:, None]
    if per_step < fold:  # a group in fold / per_step steps of its own (per_step divides fold: both powers of two)
        def group_body(j, carry):
            group_sum = _fold_columns(l_ref, acc_ref, m_ref, first=j * fold, count=fold, n_live=n_chunks,
                                      real=real, base=base, unroll=per_step, mrows=mrows, bd=bd)
            return _add_entry(carry, (*group_sum, None), j < n_groups, base)

        l, acc = jax.lax.fori_loop(0, n_groups, group_body, _zero_sums(mrows, bd))
        return _row(l), acc

    # Whole groups a step; a power of two dividing NC / fold (a power of two too), so no load runs past NC.
    groups = min(per_step // fold, l_ref.shape[0] // fold)

    def step_body(i, carry):
        first = i * groups * fold
        chunks = [first + k for k in range(groups * fold)]
        entries = [_load_entry(l_ref, acc_ref, m_ref, c, real & (c < n_chunks)) for c in chunks]
        for j in range(groups):
            group_sum = _zero_sums(mrows, bd)
            for k in range(j * fold, (j + 1) * fold):
                group_sum = _add_entry(group_sum, entries[k], chunks[k] < n_chunks, base)
            carry = _add_entry(carry, (*group_sum, None), i * groups + j < n_groups, base)
        return carry

    l, acc = jax.lax.fori_loop(0, (n_groups + groups - 1) // groups, step_body, _zero_sums(mrows, bd))
    return _row(l), acc


# ----------------------------------------------------------------------------------------------------------------
# Verify/decode window: between the passes on long tables, fold each run of `fold` chunk partials in parallel
# ----------------------------------------------------------------------------------------------------------------

def _window_fold_kernel(cache_len_ref, m_ref, l_ref, acc_ref, lg_ref, accg_ref, *, r: int, hq: int, group: int,
                        mrows: int, max_keys: int, chunk: int, short_chunk: int | None, fold: int, unroll: int,
                        max_block: int):
    # m_ref, l_ref [NC, M], acc_ref [NC, M, BD]: this (stream, KV head)'s chunk partials; outputs lg_ref [M],
    # accg_ref [M, BD]: group j's partial relative to the committed max (written for live groups and real rows).
    s, g, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    n_chunks = stream_chunking(jnp.minimum(cache_len_ref[s], max_keys), chunk, short_chunk)[1]

    @pl.when(j * fold < n_chunks)
    def _():
        _, real = _packed_rows(mrows, r, hq, group, g)
        m_committed = _committed_max(m_ref, n_chunks, real, max_block, mrows)
        m_base = jnp.where(m_committed == -jnp.inf, 0.0, m_committed)
        l, acc = _fold_in_order(l_ref, acc_ref, m_ref, first=j * fold, count=fold, n_live=n_chunks, real=real,
                                m_base=m_base, unroll=unroll, mrows=mrows, bd=accg_ref.shape[1])
        plgpu.store(lg_ref, l, mask=real)
        plgpu.store(accg_ref, acc, mask=real[:, None])


# ----------------------------------------------------------------------------------------------------------------
# Verify/decode window: pass 2, fold the chunk (or group) partials in order, then the window's own keys
# ----------------------------------------------------------------------------------------------------------------

def _window_merge_kernel(cache_len_ref, parents_ref, q_ref, kw_ref, vw_ref, m_ref, l_ref, acc_ref, *refs,
                         fp8: bool, scale: float, r: int, group: int, mrows: int, parts: int, rp: int, max_keys: int,
                         chunk: int, short_chunk: int | None, fold: int | None, fold_here: bool, unroll: int,
                         max_block: int, early: bool, cdt):
    # cache_len_ref [S]; parents_ref [R]; q_ref [R*Hq, D]; kw_ref [R*Hkv, D], vw_ref [R*Hkv, BD] the window's rows as
    # stored (fp8 codes widened to cdt, `_window_rows_for_merge`; row j*Hkv + g is window key j of KV head g); m_ref
    # [NC, M] the chunk maxima; l_ref, acc_ref [N, M], [N, M, BD]: the chunk partials (fold None, or fold_here: this
    # program folds the groups of `fold` chunks itself) or the fold pass's group partials; fp8: ksw_ref, vsw_ref
    # [R*Hkv]; output o_ref [M, BD]. early: `_merge_early` (every load issued before the first one is waited on). M =
    # mrows: the program's packed rows, part * mrows ... of the KV head's (axis 1 of the grid is KV head x parts).
    if fp8:
        ksw_ref, vsw_ref, o_ref = refs
    else:
        ksw_ref = vsw_ref = None
        (o_ref,) = refs
    s, gp = pl.program_id(0), pl.program_id(1)
    g, first = (gp // parts, (gp % parts) * mrows) if parts > 1 else (gp, 0)
    if early:
        o_ref[...] = _merge_early(cache_len_ref, parents_ref, q_ref, kw_ref, vw_ref, m_ref, l_ref, acc_ref, ksw_ref,
                                  vsw_ref, s=s, g=g, first=first, scale=scale, r=r, group=group, mrows=mrows, rp=rp,
                                  max_keys=max_keys, chunk=chunk, short_chunk=short_chunk, fold=fold,
                                  fold_here=fold_here, cdt=cdt).astype(o_ref.dtype)
        return
    n_chunks = stream_chunking(jnp.minimum(cache_len_ref[s], max_keys), chunk, short_chunk)[1]
    idx, real = _packed_rows(mrows, r, q_ref.shape[0] // r, group, g, first)
    q = q_ref[idx].astype(cdt)  # (loaded first: it does not wait on the partials)
    bd = acc_ref.shape[2]
    m_committed = _committed_max(m_ref, n_chunks, real, max_block, mrows)

    # The fold is relative to the committed max alone (the window's keys join after it), which keeps the loop free
    # of the window dot's MMA layout: weighting the loaded partials by a max derived from that dot made Triton
    # convert every loaded [M, BD] partial into the MMA layout through shared memory.
    # Chunk partials are weighted here; the fold pass's group partials were weighted there.
    m_base = jnp.where(m_committed == -jnp.inf, 0.0, m_committed)
    if fold_here:  # (only on a grouped table: fold is set)
        l, acc = _fold_groups_in_order(l_ref, acc_ref, m_ref, n_chunks=n_chunks, real=real, m_base=m_base,
                                       fold=fold, unroll=unroll, mrows=mrows, bd=bd)
    else:
        l, acc = _fold_in_order(l_ref, acc_ref, m_ref if fold is None else None, first=0, count=l_ref.shape[0],
                                n_live=n_chunks if fold is None else (n_chunks + fold - 1) // fold, real=real,
                                m_base=m_base, unroll=unroll, mrows=mrows, bd=bd)

    o_ref[...] = _with_window_keys(l, acc, m_committed, m_base, q, real, g, parents_ref, kw_ref, vw_ref, ksw_ref,
                                   vsw_ref, scale=scale, r=r, group=group, rp=rp, first_row=first,
                                   cdt=cdt).astype(o_ref.dtype)


def merge_entries(*, max_keys: int, chunk: int, short_chunk: int | None, fold: int | None, fold_here: bool) -> int:
    """Partials a merge program may add: the table's chunks (fold None or fold_here), else its groups."""
    chunks = table_chunks(max_keys, chunk, short_chunk)
    return chunks if fold is None or fold_here else -(-chunks // fold)


def _merge_early(cache_len_ref, parents_ref, q_ref, kw_ref, vw_ref, m_ref, l_ref, acc_ref, ksw_ref, vsw_ref, *, s,
                 g, first, scale: float, r: int, group: int, mrows: int, rp: int, max_keys: int, chunk: int,
                 short_chunk: int | None, fold: int | None, fold_here: bool, cdt):
    """The merge with every load issued first: the stream's context length, the query rows, the window's operands,
    the chunk maxima and each of the table's partials (`merge_entries`), none masked by the context (only by the
    real rows, which the program id fixes), so no load waits on another's result. Partials past the context are
    read as whatever the buffer holds and never enter a sum: where the loop merge skips or zero-fills an entry,
    this one selects the running sums unchanged (`_add_entry`) or -inf for a maximum. The loop merge's operations
    in its order, so the same bits, with two memory round trips in the program's chain (the partials, then the
    queries, which ptxas issues after the weights that wait on the partials) instead of one a loop step and one for
    the maxima. Its partials live in registers at once: `window` takes it where they fit
    (`MERGE_EARLY_ELEMENTS`). On the H200 (session 23) the 1-stream 32K fused merge took 4.7-5.1 µs against 7.8
    for the loop, a merge of a few partials 2.3-3.7 against 3.8-6.8."""
    n_len = cache_len_ref[s]
    idx, real = _packed_rows(mrows, r, q_ref.shape[0] // r, group, g, first)
    q = q_ref[idx]
    operands = _window_operands(g, parents_ref, kw_ref, vw_ref, ksw_ref, vsw_ref, real=real, r=r, group=group,
                                rp=rp, first_row=first, mrows=mrows)
    weighted = fold is None or fold_here
    n_entries = merge_entries(max_keys=max_keys, chunk=chunk, short_chunk=short_chunk, fold=fold,
                              fold_here=fold_here)
    entries = [_load_entry(l_ref, acc_ref, m_ref if weighted else None, jnp.int32(c), real)
               for c in range(n_entries)]
    if not weighted:  # group partials: the chunk maxima apart
        nc = m_ref.shape[0]
        maxima = plgpu.load(m_ref, mask=jnp.broadcast_to(real[None, :], (nc, mrows)), other=-jnp.inf)  # [NC, M]
    # The window dot's operands reach the MMA layout through shared memory behind a barrier, which waits for their
    # loads; no load is moved past a barrier, and Triton puts the conversion right after what it converts, which
    # held every partial's load behind the queries' round trip. So the queries and window rows pass through a
    # select on the context length (a context is never negative: the select keeps them, bit for bit), which puts
    # the conversions after every load above. (ptxas still issues the queries' loads after the weights, which wait
    # on the partials: two round trips, in that order; offline sm_90 compile, session 23.)
    def held(x):
        return None if x is None else jnp.where(n_len >= 0, x, jnp.zeros_like(x))

    q = held(q).astype(cdt)
    operands = tuple(held(x) for x in operands)
    logits_w = _window_logits(q, operands, scale=scale, cdt=cdt)

    n_chunks = stream_chunking(jnp.minimum(n_len, max_keys), chunk, short_chunk)[1]
    # Per-row values (l, maxima, the committed max) as [M, 1] columns (`_load_entry`).
    if weighted:
        # The maximum of the loaded entries' maxima, one column at a time (exact in any order): derived from the
        # same loads as the weights, the committed max takes their layout, where a max over a [NC, M] block took the
        # block's, and Triton converted every entry's weights into the partials' rows through shared memory (a
        # barrier an entry).
        m_column = jnp.full((mrows, 1), -jnp.inf, jnp.float32)
        for c in range(n_entries):
            m_column = jnp.maximum(m_column, jnp.where(c < n_chunks, entries[c][2], -jnp.inf))
    else:
        m_column = jnp.max(jnp.where((jnp.arange(nc) < n_chunks)[:, None], maxima, -jnp.inf), axis=0)[:, None]
    base_column = jnp.where(m_column == -jnp.inf, 0.0, m_column)

    def add(carry, entry, live):
        return _add_entry(carry, entry, live, base_column)

    def zeros():
        return _zero_sums(mrows, acc_ref.shape[2])

    carry = zeros()
    if fold_here:  # `_fold_groups_in_order`: each group from zeros in chunk order, the sums in group order
        n_groups = (n_chunks + fold - 1) // fold
        for j in range(-(-n_entries // fold)):
            group_sum = zeros()
            for c in range(j * fold, min((j + 1) * fold, n_entries)):
                group_sum = add(group_sum, entries[c], c < n_chunks)
            carry = add(carry, (*group_sum, None), j < n_groups)
    else:  # `_fold_in_order` over the chunk partials (weighted) or the fold pass's group partials
        n_live = n_chunks if fold is None else (n_chunks + fold - 1) // fold
        for c in range(n_entries):
            carry = add(carry, entries[c], c < n_live)
    l, acc = _row(carry[0]), carry[1]
    m_committed, m_base = _row(m_column), _row(base_column)
    return _add_window_keys(l, acc, m_committed, m_base, q, operands, r=r, scale=scale, cdt=cdt,
                            logits_w=logits_w)


def _window_operands(g, parents_ref, kw_ref, vw_ref, ksw_ref, vsw_ref, *, real, r: int, group: int, rp: int,
                     first_row, mrows: int):
    """What the window's own keys need from memory, loaded (no arithmetic on partials waits for them, so a merge
    may issue these loads before any other): (visible [M, RP] bool, window K rows [RP, D], V rows [RP, BD], K and
    V scales [RP] or None). Row m (packed row first_row + m, window node (first_row + m) // G) sees node j iff j is
    the node or one of its ancestors, found by climbing parent pointers (at most R steps; parents[j] < j).
    kw_ref [R*Hkv, D], vw_ref [R*Hkv, BD] (row j*Hkv + g is window key j of KV head g); ksw_ref, vsw_ref [R*Hkv]
    or None."""
    hkv = kw_ref.shape[0] // r
    j = jnp.arange(rp)
    widx = jnp.where(j < r, j * hkv + g, 0)
    rows = jnp.arange(mrows) if isinstance(first_row, int) and first_row == 0 else first_row + jnp.arange(mrows)
    node = jnp.where(real, rows // group, -1)
    visible = jnp.zeros((mrows, rp), jnp.bool_)
    for _ in range(r):
        visible = visible | (node[:, None] == j[None, :])
        node = jnp.where(node >= 0, parents_ref[jnp.clip(node, 0, r - 1)], -1)
    return (visible, kw_ref[widx], vw_ref[widx], None if ksw_ref is None else ksw_ref[widx],
            None if vsw_ref is None else vsw_ref[widx])


def _window_logits(q, operands, *, scale: float, cdt):
    """The window's own keys' scaled logits for rows q [M, D] cdt, -inf where a row does not see the key."""
    visible, kw, _, ksw, _ = operands
    logits_w = _dot(q, kw.astype(cdt).T)
    logits_w = logits_w * (ksw[None, :] * scale if ksw is not None else scale)
    return jnp.where(visible, logits_w, -jnp.inf)


def _window_key_sum(p: jax.Array, r: int) -> jax.Array:
    """sum_j p[:, j] over the window's r keys (p [M, RP] >= 0, zero where a row does not see the key), added one
    key at a time in key order -> [M]. Each key's column is taken out by a masked sum (the key's value and zeros:
    exact in any order). A plain sum over the columns adds in the order of the register layout, which Triton picks
    from the merge program's rows and head-dim columns (an MMA with the columns split over the warps at 16 rows,
    kept in one warp at 32, a wgmma at 128: offline sm_90 compile, session 26), and those launch choices follow
    the number of streams (`merge_launch`, `merge_rows`). So the order is fixed here by construction; on the H200
    the plain sum changed no output across the splits (`merge_rows_probe.py --sums`, session 26: the flips there
    came from the dots, `_window_rows_for_merge`). A row sees no key past its own node, so it gets the same bits
    from any window that holds its path (the zeros after add exactly)."""
    cols = jnp.arange(p.shape[1])[None, :]
    total = jnp.sum(jnp.where(cols == 0, p, 0.0), axis=1)
    for j in range(1, min(r, p.shape[1])):
        total = total + jnp.sum(jnp.where(cols == j, p, 0.0), axis=1)
    return total


def _add_window_keys(l, acc, m_committed, m_base, q, operands, *, r: int, scale: float, cdt, logits_w=None):
    """The committed keys' folded (l [M], acc [M, BD]) relative to m_base, with the window's r own keys
    (`_window_operands`; their `_window_logits` if already computed) added last -> the output rows [M, BD] fp32.
    q [M, D] cdt."""
    visible, _, vw, _, vsw = operands
    if logits_w is None:
        logits_w = _window_logits(q, operands, scale=scale, cdt=cdt)
    m_total = jnp.maximum(m_committed, jnp.max(logits_w, axis=1))
    # Padding rows see nothing; keep their arithmetic finite.
    m_total = jnp.where(m_total == -jnp.inf, 0.0, m_total)
    alpha = jnp.where(m_committed == -jnp.inf, 0.0, jnp.exp(m_base - m_total))  # no committed keys: l, acc are 0
    p = jnp.exp(logits_w - m_total[:, None])
    l = l * alpha + _window_key_sum(p, r)
    acc = acc * alpha[:, None] + _pv(p, vw, vsw, visible, cdt)
    return acc / jnp.where(l > 0, l, 1.0)[:, None]


def _with_window_keys(l, acc, m_committed, m_base, q, real, g, parents_ref, kw_ref, vw_ref, ksw_ref, vsw_ref, *,
                      scale: float, r: int, group: int, rp: int, first_row, cdt):
    """`_add_window_keys` with its operands loaded here, after the fold."""
    operands = _window_operands(g, parents_ref, kw_ref, vw_ref, ksw_ref, vsw_ref, real=real, r=r, group=group,
                                rp=rp, first_row=first_row, mrows=q.shape[0])
    return _add_window_keys(l, acc, m_committed, m_base, q, operands, r=r, scale=scale, cdt=cdt)


# ----------------------------------------------------------------------------------------------------------------
# Verify/decode window in one launch (WindowTiles.tail == "tickets"): pass 1, then the fold and the merge in the
# tail of whichever program finishes last, found by atomic tickets
# ----------------------------------------------------------------------------------------------------------------

def _window_ticket_kernel(cache_len_ref, parents_ref, pt_ref, q_ref, kw_ref, vw_ref, k_ref, v_ref, *refs,
                          fp8: bool, scale: float, r: int, group: int, mrows: int, parts: int, rp: int,
                          max_keys: int, page_size: int, tiles: WindowTiles, unroll: int, max_block: int,
                          interpret: bool, cdt, v_keys: bool = False):
    # cache_len_ref [S]; parents_ref [R]; pt_ref [Pmax]; q_ref [R*Hq, D]; kw_ref, vw_ref [R*Hkv, D] the window's rows as
    # stored (fp8 codes widened, `_window_rows_for_merge`); k_ref, v_ref [P, page, D] (this KV head; v_keys: v_ref
    # [P, D, page]); fp8: ks_ref,
    # vs_ref [P, page], ksw_ref, vsw_ref [R*Hkv]; tickets_in_ref (aliased to tickets_ref, zeros). Outputs, for packed
    # rows part*MB .. part*MB + MB - 1 (MB = mrows): m_ref, l_ref [NC, MB] and acc_ref [NC, MB, D] the chunk partials;
    # mg_ref, lg_ref [G, MB], accg_ref [G, MB, D] the group partials, each relative to its group's max; o_ref [MB, D];
    # tickets_ref [S, Hkv*parts, G + 1] int32: per (stream, KV head x part) one counter a group of `fold` chunks, then
    # one for the groups.
    if fp8:
        ks_ref, vs_ref, ksw_ref, vsw_ref, _, m_ref, l_ref, acc_ref, mg_ref, lg_ref, accg_ref, o_ref, tickets_ref = refs
    else:
        ks_ref = vs_ref = ksw_ref = vsw_ref = None
        _, m_ref, l_ref, acc_ref, mg_ref, lg_ref, accg_ref, o_ref, tickets_ref = refs
    s, gp, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    g, part = gp // parts, gp % parts
    n_keys = jnp.minimum(cache_len_ref[s], max_keys)
    size, n_chunks = stream_chunking(n_keys, tiles.chunk, tiles.short_chunk)
    n_groups = (n_chunks + tiles.fold - 1) // tiles.fold
    idx, real = _packed_rows(mrows, r, q_ref.shape[0] // r, group, g, part * mrows)
    q = q_ref[idx].astype(cdt)
    d = q.shape[1]

    @pl.when(c < n_chunks)
    def _():
        m, l, acc = _chunk_partial(q, pt_ref, k_ref, v_ref, ks_ref, vs_ref, chunk_start=c * size, span=size,
                                   n_keys=n_keys, scale=scale, page_size=page_size, tiles=tiles, cdt=cdt,
                                   v_keys=v_keys)
        plgpu.store(m_ref.at[c], m, mask=real)
        plgpu.store(l_ref.at[c], l, mask=real)
        plgpu.store(acc_ref.at[c], acc, mask=real[:, None])

    def ticket(counter):
        # Every thread's stores of this program are issued before one thread takes the ticket (acquire-release at
        # GPU scope), so whoever draws the last ticket reads all of them.
        if not interpret:
            plgpu.debug_barrier()
        return plgpu.atomic_add(tickets_ref, (s, gp, jnp.asarray(counter, jnp.int32)), jnp.ones((), jnp.int32))

    grp = c // tiles.fold
    in_group = jnp.clip(n_chunks - grp * tiles.fold, 0, tiles.fold)

    # A stream with no committed keys runs no chunk: program 0 takes its tickets alone.
    @pl.when((c < n_chunks) | (c == 0))
    def _():
        @pl.when(ticket(grp) == jnp.maximum(in_group, 1) - 1)
        def _():
            # The group's chunks in order, relative to the group's own max.
            m_group = _committed_max(m_ref, in_group, real, min(max_block, tiles.fold), mrows,
                                     first=grp * tiles.fold)
            l, acc = _fold_in_order(l_ref, acc_ref, m_ref, first=grp * tiles.fold, count=tiles.fold,
                                    n_live=n_chunks, real=real, m_base=jnp.where(m_group == -jnp.inf, 0.0, m_group),
                                    unroll=min(unroll, tiles.fold), mrows=mrows, bd=d)
            plgpu.store(mg_ref.at[grp], m_group, mask=real)
            plgpu.store(lg_ref.at[grp], l, mask=real)
            plgpu.store(accg_ref.at[grp], acc, mask=real[:, None])

            @pl.when(ticket(mg_ref.shape[0]) == jnp.maximum(n_groups, 1) - 1)
            def _():
                # The groups in order, relative to the committed max, then the window's own keys.
                m_committed = _committed_max(mg_ref, n_groups, real, min(max_block, mg_ref.shape[0]), mrows)
                m_base = jnp.where(m_committed == -jnp.inf, 0.0, m_committed)
                l, acc = _fold_in_order(lg_ref, accg_ref, mg_ref, first=0, count=mg_ref.shape[0], n_live=n_groups,
                                        real=real, m_base=m_base, unroll=min(unroll, mg_ref.shape[0]), mrows=mrows,
                                        bd=d)
                o_ref[...] = _with_window_keys(l, acc, m_committed, m_base, q, real, g, parents_ref, kw_ref, vw_ref,
                                               ksw_ref, vsw_ref, scale=scale, r=r, group=group, rp=rp,
                                               first_row=part * mrows, cdt=cdt).astype(o_ref.dtype)


def _unpack_rows(x: jax.Array, r: int, hq: int) -> jax.Array:
    """[S, Hkv, M, D] packed rows -> [S, R, Hq, D]."""
    s, hkv, _, d = x.shape
    g = hq // hkv
    return jnp.moveaxis(x[:, :, : r * g].reshape(s, hkv, r, g, d), 1, 2).reshape(s, r, hq, d)


def merge_launch(tiles: WindowTiles, *, streams: int, hkv: int, mrows: int, head_dim: int,
                 groups: int | None = None, entries: int | None = None) -> tuple[int, int]:
    """(head-dim columns per program, partials loaded per loop step) of the merge (groups None) or of the fold pass
    over `groups` chunk groups. Neither changes a row's bits, so both may follow the call's shape: at one stream
    the head dim is split finely so that ~128 merge (~256 fold) programs work side by side, and a loop step keeps
    about 32 KiB of partials in flight (at most `fold` in the fold pass)."""
    fixed = tiles.merge_block_d if groups is None else tiles.fold_block_d
    if fixed:
        bd = min(fixed, head_dim)
    else:
        programs = streams * hkv * (groups or 1)
        columns = min(max(1, head_dim // 16), _pow2(-(-(128 if groups is None else 256) // programs)))
        bd = max(16, min(head_dim // columns, _pow2_floor(8192 // mrows)))
        # A merge of `entries` partials: narrower column blocks where that lets a program's partials fit the early
        # merge (`merge_early`). At 16 streams a 1-row decode over 8 short chunks took the loop merge at 128 columns:
        # 7.4 µs against 3.2 over one chunk (H200, session 28).
        fit = _pow2_floor(max(1, MERGE_EARLY_ELEMENTS // (entries * mrows))) if groups is None and entries else bd
        bd = fit if 16 <= fit < bd else bd
    unroll = max(1, min(16, 8192 // (mrows * bd)))
    if groups is None:
        return bd, tiles.merge_unroll or unroll
    return bd, min(unroll, tiles.fold)


# The longest table (in chunks) whose merge folds the groups itself under fold_in_merge's rule. On the H200
# (`bench attention --sections decode_sweep --trace`, session 22, 1 stream, 1 row, kernels alone) the fused merge
# took 5.3 µs over 32 live chunks against the fold pass's 5.3 + the merge's 3.6, but 12.3 over 64 (against 5.0 +
# 4.0) and 21.1 / 40.5 over 128 / 256 (against 6.8 + 4.5 / 8.4 + 6.7): its one program walks the chunks in
# sequence, where the fold pass spreads the groups. 40: between the two measured points, under the break-even
# (about 48 chunks) that a straight line through them puts.
FOLD_IN_MERGE_MAX_CHUNKS = 40


def fold_in_merge(tiles: WindowTiles, *, streams: int, hkv: int, chunks: int) -> bool:
    """Whether a window call on a table of more than `fold` chunks (`chunks` of them, the table's width in chunks)
    folds the groups inside the merge (one launch) rather than in a fold pass of its own
    (`WindowTiles.fold_in_merge`). Either way a row gets the same bits, so the choice may follow the call's static
    shape, never its cache_len values. None: fused for at most 8 (stream, KV head) pairs (1 or 2 streams at the 27B
    shape), where the fold pass has few programs to spread, on tables of at most FOLD_IN_MERGE_MAX_CHUNKS chunks.
    Fused, the 1-stream 1-row decode of 32K keys over a bf16 pool took 41.0 µs against 44.8 (kernels alone)."""
    if tiles.fold_in_merge is not None:
        return tiles.fold_in_merge
    return streams * hkv <= 8 and chunks <= FOLD_IN_MERGE_MAX_CHUNKS


# fp32 values of partials a merge program may hold at once and still load them all before it adds any: a 1-stream
# decode folding a table of FOLD_IN_MERGE_MAX_CHUNKS chunks itself, 16 packed rows x 16 columns, holds 10240 (219
# registers and no spills on 4 warps in an offline compile for sm_90; 182 at 32 chunks).
MERGE_EARLY_ELEMENTS = 10240


# The (stream, KV head, head-dim column block) merge programs of a call at or under which `merge_rows` splits a
# window's rows into programs of MERGE_SPLIT_ROWS: on the H200 (session 25, `bench attention --sections
# merge_variants --trace`, 16-row bf16 windows, the merge alone) 32-row programs took 9.6 µs against 15.6 for whole
# ones at 1 stream and 32K keys (64 programs), 6.5 against 11.5 at 128K, 5.9 against 6.5 at 4K; at 16 streams (128
# programs) they took 19.5 against 13.2 at 4K and 16.8 against 15.7 at 32K, and 16-row programs lost to 32-row ones
# at 1 stream (14.0 µs at 32K).
MERGE_SPLIT_MAX_PROGRAMS = 64
MERGE_SPLIT_ROWS = 32


def merge_rows(tiles: WindowTiles, *, mrows: int, programs: int) -> int:
    """Packed rows per merge program (`WindowTiles.merge_block_rows`; a launch choice, the same bits): None splits
    the rows into programs of MERGE_SPLIT_ROWS where the call has at most MERGE_SPLIT_MAX_PROGRAMS merge programs
    otherwise (`programs`: streams x KV heads x head-dim column blocks), else takes them all. From static shapes
    only."""
    if tiles.merge_block_rows is not None:
        return min(tiles.merge_block_rows, mrows)
    return min(MERGE_SPLIT_ROWS, mrows) if programs <= MERGE_SPLIT_MAX_PROGRAMS else mrows


def merge_early(tiles: WindowTiles, *, entries: int, mrows: int, bd: int) -> bool:
    """Whether a merge program of `bd` head-dim columns over `mrows` packed rows and `entries` partials
    (`merge_entries`) loads them all first (`WindowTiles.merge_loads`; the same bits either way)."""
    if tiles.merge_loads is not None:
        return tiles.merge_loads == "early"
    return entries * mrows * bd <= MERGE_EARLY_ELEMENTS


class _PassOne(NamedTuple):
    """How the chunk programs of a window call are laid out (`window_partials` and the tickets kernel share it, so
    both run pass 1 with the same rows, warps and stages, i.e. the same bits): `mrows` packed rows per KV head in
    `parts` programs of `rows`; `n_chunks` chunk programs over the table of `max_keys` keys (`page_table` padded
    to cover them); the compute dtype; the launch; the BlockSpecs of the pool's K, V (and fp8 scales) per KV
    head, for a (stream, KV head x part, chunk) grid."""
    mrows: int
    rows: int
    parts: int
    n_chunks: int
    max_keys: int
    page_table: jax.Array
    cdt: object
    warps: int
    stages: int
    kv_specs: list


def _pass_one(q: jax.Array, pool: KVPool, page_table: jax.Array, tiles: WindowTiles) -> _PassOne:
    _, r, hq, d = q.shape
    ps = pool.page_size
    mrows = _padded_rows(r * (hq // pool.k.shape[0]))
    cdt = _compute_dtype(q.dtype, pool, tiles.fp8_dot)
    max_keys = page_table.shape[1] * ps
    n_chunks = table_chunks(max_keys, tiles.chunk, tiles.short_chunk)
    rb = min(tiles.row_block or mrows, mrows)
    parts = _row_parts(r * (hq // pool.k.shape[0]), rb)
    warps, stages = window_launch(tiles, mrows=rb, head_dim=d, kv_dtype=pool.k.dtype, cdt=cdt)
    per_head = pl.BlockSpec((None, pool.num_pages, ps, d), lambda i, j, c: (j // parts, 0, 0, 0))
    per_head_v = pl.BlockSpec((None,) + pool.v.shape[1:], lambda i, j, c: (j // parts, 0, 0, 0))
    per_head_scale = pl.BlockSpec((None, pool.num_pages, ps), lambda i, j, c: (j // parts, 0, 0))
    # (Short chunks divide chunk. A chunk's V max, `_chunk_v_max`, reads a whole chunk's pages from any chunk start
    # below max_keys: one chunk more.)
    extra = tiles.chunk if _chunk_scaled(tiles, pool.fp8, cdt) else 0
    table = _pad_table(page_table, -(-max_keys // tiles.chunk) * tiles.chunk + extra, ps)
    return _PassOne(mrows, rb, parts, n_chunks, max_keys, table, cdt, warps, stages,
                    [per_head, per_head_v] + ([per_head_scale, per_head_scale] if pool.fp8 else []))


def _pool_operands(pool: KVPool) -> list[jax.Array]:
    """The pool's arrays in the order of `_PassOne.kv_specs`."""
    return [pool.k, pool.v] + ([pool.k_scale, pool.v_scale] if pool.fp8 else [])


def window_impl(q_dtype, pool: KVPool, num_heads: int, tiles: WindowTiles, interpret: bool) -> str:
    """Pass 1's kernel under WINDOW_IMPL for a model's window calls (from the model and cache layout, never a call's
    rows): "auto" takes the Mosaic GPU pass 1 compiled for a GPU wherever `attention_window_mgpu.unsupported` finds
    nothing against it, else the Triton one."""
    if WINDOW_IMPL not in ("auto", "triton", "mgpu"):
        raise ValueError(f"attention.WINDOW_IMPL must be 'auto', 'triton' or 'mgpu'; got {WINDOW_IMPL!r}")
    if WINDOW_IMPL != "auto":
        return WINDOW_IMPL
    if interpret or tiles.tail != "passes":
        return "triton"
    from pallas_kernels import attention_window_mgpu as awm  # (it imports this module)
    if pool.fp8 and not (awm.FP8 and pool.keys_major):  # (the dequantizing pass over V by rows: explicit only)
        return "triton"
    why = awm.unsupported(q_dtype, pool, num_heads // pool.k.shape[0], chunk=tiles.chunk, stages=tiles.num_stages,
                          short_chunk=tiles.short_chunk)
    return "triton" if why else "mgpu"


def model_window_tiles(q_dtype, pool: KVPool, num_heads: int, *, max_keys: int, interpret: bool) -> WindowTiles:
    """The tiles every window call of a model runs (`window` with tiles=None): `window_tiles` for the cache layout,
    pass 1's kernel under WINDOW_IMPL, and, where that is the Mosaic GPU pass 1, its own chunk
    (`attention_window_mgpu.CHUNK`). From the model and cache layout only, so the 1-row step and every drafted row
    share the reduction order."""
    tiles = window_tiles(page_size=pool.page_size, max_keys=max_keys, head_dim=pool.k.shape[-1], fp8=pool.fp8)
    impl = window_impl(q_dtype, pool, num_heads, tiles, interpret)
    if impl != "mgpu":
        return dataclasses.replace(tiles, impl=impl)
    from pallas_kernels import attention_window_mgpu as awm
    return dataclasses.replace(tiles, impl=impl, chunk=awm.CHUNK, partials=awm.PARTIALS)


def _mgpu_pass_one(q: jax.Array, pool: KVPool, tiles: WindowTiles, interpret) -> bool:
    """Whether this window call's pass 1 runs on Mosaic GPU: impl "mgpu" on bf16 queries over a bf16 or fp8 pool
    (fp32 calls keep the Triton pass 1); a model the kernel cannot take is an error, not a silent fallback."""
    if tiles.impl != "mgpu" or not mgpu_operands(q.dtype, pool):
        return False
    from pallas_kernels import attention_window_mgpu as awm
    why = awm.unsupported(q.dtype, pool, q.shape[2] // pool.k.shape[0], chunk=tiles.chunk, stages=tiles.num_stages,
                          short_chunk=tiles.short_chunk,
                          interpret=bool(interpret))
    if why:
        raise ValueError(f"WindowTiles.impl='mgpu': the Mosaic GPU pass 1 needs {why}")
    return True


def _split_rows(tiles: WindowTiles, one: _PassOne, streams: int, hkv: int) -> bool:
    """The Mosaic GPU pass 1's split_rows for a call: row_block set, as it says (<= 64 splits); None, a window of
    two compute warpgroups split where the grid is small (`attention_window_mgpu.SPLIT_MAX_CTAS`)."""
    if tiles.row_block is not None:
        return tiles.row_block <= 64
    from pallas_kernels import attention_window_mgpu as awm
    return one.mrows > awm.WG_ROWS and streams * hkv * one.n_chunks <= awm.SPLIT_MAX_CTAS


def packed_query_rows(q_shape: tuple[int, ...], q_dtype, pool: KVPool, page_table_width: int, *,
                      interpret: bool) -> int | None:
    """The packed rows a model's window call over queries [S, R, Hq, D] reads q in where its pass 1 is the Mosaic GPU
    one (`attention_window_mgpu.pack_queries`): its caller can write q that way itself (`attn_prep`'s packed_rows)
    and hand it to `window` as q_packed. None where the call's pass 1 takes q as it is."""
    tiles = model_window_tiles(q_dtype, pool, q_shape[2], max_keys=page_table_width * pool.page_size,
                               interpret=interpret)
    if tiles.tail == "tickets" or not _mgpu_pass_one(jax.ShapeDtypeStruct(q_shape, q_dtype), pool, tiles,
                                                       interpret):
        return None
    from pallas_kernels import attention_window_mgpu as awm
    return awm.packed_rows(q_shape, pool.k.shape[0])


def _partials_chunks(n_chunks: int, pad_chunks_to: int) -> int:
    """The chunk entries of `window_partials`' outputs for a table of n_chunks chunk programs."""
    return max(_pow2(n_chunks), pad_chunks_to)


def window_partials(q: jax.Array, pool: KVPool, page_table: jax.Array, cache_len: jax.Array, *, scale: float,
                    tiles: WindowTiles, interpret: bool = False, pad_chunks_to: int = 1,
                    q_packed: jax.Array | None = None, size_len: jax.Array | None = None
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pass 1 of `window` alone (window calls it; the bench times it apart from the merge): one program per
    (stream, KV head, chunk) writes the chunk's partial for the real packed rows; entries of chunks at or past the
    stream's context and of padding rows are left unwritten. tiles.impl "mgpu" runs it on Mosaic GPU for bf16 calls
    (`attention_window_mgpu`, which writes some padding rows too).

    q [S, R, Hq, D]; page_table [S, Pmax]; cache_len [S] -> m, l [S, Hkv, NC, M] fp32 and acc [S, Hkv, NC, M, D]
    (fp32, or bf16 from the Mosaic GPU pass 1 with tiles.partials "bfloat16"),
    NC = the chunk count over the table rounded up to a power of two (and to pad_chunks_to), M packed rows.
    q_packed: q as the Mosaic GPU pass 1 packs it (`packed_query_rows`), which it then reads; other pass 1s read q.
    size_len [S]: the counts that set each stream's chunk size (`stream_chunking`), already capped; None: the
    stream's own, min(cache_len, the table's keys). A stream's chunks are then that size from its table's first key
    on, cut at its cache_len (`window_rows`: a window's rows share the chunks below their stream's position).
    """
    s, r, hq, d = q.shape
    hkv = pool.k.shape[0]
    one = _pass_one(q, pool, page_table, tiles)
    cache_len = cache_len.astype(jnp.int32)
    rb, parts = one.rows, one.parts
    nc_pad = _partials_chunks(one.n_chunks, pad_chunks_to)
    if _mgpu_pass_one(q, pool, tiles, interpret):
        from pallas_kernels import attention_window_mgpu as awm
        return awm.window_partials_mgpu(q, pool, one.page_table, cache_len, scale=scale, chunk=tiles.chunk,
                                        short_chunk=tiles.short_chunk, n_chunks=one.n_chunks, nc_pad=nc_pad,
                                        max_keys=one.max_keys,
                                        tiles=awm.WindowMgpuTiles(stages=tiles.num_stages,
                                                                  split_rows=_split_rows(tiles, one, s, hkv),
                                                                  ping_pong=awm.PING_PONG, dequant=awm.DEQUANT),
                                        partials=tiles.partials, q_packed=q_packed, size_len=size_len,
                                        interpret=interpret)
    lens = cache_len if size_len is None else jnp.concatenate([cache_len, size_len.astype(jnp.int32)])

    with jax.named_scope("attn_window_chunks"):
        kernel = functools.partial(_window_chunk_kernel, fp8=pool.fp8, v_keys=pool.keys_major, scale=scale, r=r,
                                   group=hq // hkv, mrows=rb,
                                   parts=parts, max_keys=one.max_keys, page_size=pool.page_size, tiles=tiles,
                                   cdt=one.cdt, sized=size_len is not None)
        return pallas_call(
            kernel,
            grid=(s, hkv * parts, one.n_chunks),
            in_specs=[pl.BlockSpec(lens.shape, lambda i, j, c: (0,)),
                      pl.BlockSpec((None, one.page_table.shape[1]), lambda i, j, c: (i, 0)),
                      pl.BlockSpec((None, r * hq, d), lambda i, j, c: (i, 0, 0)),
                      *one.kv_specs],
            out_specs=[pl.BlockSpec((None, None, None, rb), lambda i, j, c: (i, j // parts, c, j % parts)),
                       pl.BlockSpec((None, None, None, rb), lambda i, j, c: (i, j // parts, c, j % parts)),
                       pl.BlockSpec((None, None, None, rb, d), lambda i, j, c: (i, j // parts, c, j % parts, 0))],
            out_shape=[jax.ShapeDtypeStruct((s, hkv, nc_pad, one.mrows), jnp.float32),
                       jax.ShapeDtypeStruct((s, hkv, nc_pad, one.mrows), jnp.float32),
                       jax.ShapeDtypeStruct((s, hkv, nc_pad, one.mrows, d), jnp.float32)],
            interpret=interpret,
            compiler_params=plgpu.CompilerParams(num_warps=one.warps, num_stages=one.stages),
            name="attn_window_chunks",
        )(lens, one.page_table, q.reshape(s, r * hq, d),  # reshape: free
          *_pool_operands(pool))


def window(q: jax.Array, k_win: jax.Array, v_win: jax.Array, parents: jax.Array, pool: KVPool,
           page_table: jax.Array, cache_len: jax.Array, *, scale: float, interpret: bool = False,
           tiles: WindowTiles | None = None, q_packed: jax.Array | None = None) -> jax.Array:
    """Same contract as window_reference. Pass 1 streams the committed keys of each (stream, KV head) in chunks of
    `tiles.chunk` keys, one program each, and writes per-chunk partials; pass 2 folds them in chunk order and
    adds the window's own keys last (they sit after every committed key). On a table of more than `tiles.fold`
    chunks, a fold pass in between folds each run of `fold` chunks in its own programs and pass 2 adds those group
    partials in order (the same bits as one pass wherever a stream's context fits one group), or pass 2 folds the
    groups itself, the same operations in one launch (`fold_in_merge`). A row's bits depend only on its own
    stream's inputs and the tiles' reduction fields: not on other streams, nor on how many pages the table holds,
    nor on the launch fields. tiles=None: `model_window_tiles` for this pool and table.

    q [S, R, Hq, D]; k_win, v_win [S, R, Hkv, D]; parents [S, R]; page_table [S, Pmax]; cache_len [S]
    -> o [S, R, Hq, D] in q.dtype. q_packed: q packed for the Mosaic GPU pass 1 (`packed_query_rows`), the same
    values, so the same bits.
    """
    if tiles is None:
        tiles = model_window_tiles(q.dtype, pool, q.shape[2], max_keys=page_table.shape[-1] * pool.page_size,
                                   interpret=interpret)
    hkv = _check_window(q, k_win, v_win, parents, pool, page_table, cache_len, tiles)
    if tiles.tail == "tickets":
        return _window_tickets(q, k_win, v_win, parents, pool, page_table, cache_len, scale=scale, tiles=tiles,
                               interpret=interpret)
    m, l, acc = window_partials(q, pool, page_table, cache_len, scale=scale, tiles=tiles, interpret=interpret,
                                pad_chunks_to=_merge_plan(q.shape, pool, page_table, tiles).pad_chunks_to,
                                q_packed=q_packed)
    return merge_partials(q, k_win, v_win, parents, pool, page_table, cache_len, (m, l, acc), scale=scale,
                          tiles=tiles, interpret=interpret)


class _MergePlan(NamedTuple):
    """How a window call's partials are folded (`merge_partials`), from its shapes and tiles alone."""
    grouped: bool
    fold_here: bool
    entries: int
    bd: int
    unroll: int
    pad_chunks_to: int


def _merge_plan(q_shape, pool: KVPool, page_table: jax.Array, tiles: WindowTiles) -> _MergePlan:
    s, r, hq, d = q_shape
    hkv = pool.k.shape[0]
    max_keys = page_table.shape[1] * pool.page_size
    n_table = table_chunks(max_keys, tiles.chunk, tiles.short_chunk)  # fixed for a model and layout
    grouped = n_table > tiles.fold
    fold_here = grouped and fold_in_merge(tiles, streams=s, hkv=hkv, chunks=n_table)
    entries = merge_entries(max_keys=max_keys, chunk=tiles.chunk, short_chunk=tiles.short_chunk,
                            fold=tiles.fold if grouped else None, fold_here=fold_here)
    bd, unroll = merge_launch(tiles, streams=s, hkv=hkv, mrows=_padded_rows(r * (hq // hkv)), head_dim=d,
                              entries=entries)
    return _MergePlan(grouped, fold_here, entries, bd, unroll, tiles.fold if grouped else unroll)


def merge_partials(q: jax.Array, k_win: jax.Array, v_win: jax.Array, parents: jax.Array, pool: KVPool,
                   page_table: jax.Array, cache_len: jax.Array, partials: tuple[jax.Array, jax.Array, jax.Array], *,
                   scale: float, tiles: WindowTiles, interpret: bool = False) -> jax.Array:
    """`window`'s pass 2 (and its fold pass) over pass 1's partials (m, l, acc as `window_partials` returns them,
    padded to `_merge_plan`'s pad_chunks_to): the same arguments as `window`, tiles given."""
    hkv = pool.k.shape[0]
    s, r, hq, d = q.shape
    group = hq // hkv
    mrows = _padded_rows(r * group)  # as `_pass_one` packs them for pass 1
    rp = _padded_rows(r)
    fp8 = pool.fp8
    cdt = _compute_dtype(q.dtype, pool, tiles.fp8_dot)
    max_keys = page_table.shape[1] * pool.page_size
    cache_len = cache_len.astype(jnp.int32)
    grouped, fold_here, entries, bd, unroll, _ = _merge_plan(q.shape, pool, page_table, tiles)
    m, l, acc = partials
    nc_pad = m.shape[2]
    max_block = min(nc_pad, _pow2_floor(max(1, 4096 // mrows)))
    q_rows = q.reshape(s, r * hq, d)  # free: rows picked inside the kernels
    if grouped and not fold_here:
        groups = nc_pad // tiles.fold
        with jax.named_scope("attn_window_fold"):
            bdf, unroll_f = merge_launch(tiles, streams=s, hkv=hkv, mrows=mrows, head_dim=d, groups=groups)
            kernel = functools.partial(_window_fold_kernel, r=r, hq=hq, group=group, mrows=mrows, max_keys=max_keys,
                                       chunk=tiles.chunk, short_chunk=tiles.short_chunk, fold=tiles.fold,
                                       unroll=unroll_f, max_block=max_block)
            maxima = pl.BlockSpec((None, None, nc_pad, mrows), lambda i, j, c, e: (i, j, 0, 0))
            l, acc = pallas_call(
                kernel,
                grid=(s, hkv, groups, d // bdf),
                in_specs=[pl.BlockSpec((s,), lambda i, j, c, e: (0,)), maxima, maxima,
                          pl.BlockSpec((None, None, nc_pad, mrows, bdf), lambda i, j, c, e: (i, j, 0, 0, e))],
                out_specs=[pl.BlockSpec((None, None, None, mrows), lambda i, j, c, e: (i, j, c, 0)),
                           pl.BlockSpec((None, None, None, mrows, bdf), lambda i, j, c, e: (i, j, c, 0, e))],
                out_shape=[jax.ShapeDtypeStruct((s, hkv, groups, mrows), jnp.float32),
                           jax.ShapeDtypeStruct((s, hkv, groups, mrows, d), jnp.float32)],
                interpret=interpret,
                compiler_params=plgpu.CompilerParams(num_warps=tiles.merge_num_warps, num_stages=2),
                name="attn_window_fold",
            )(cache_len, m, l, acc)
        unroll = min(unroll, groups)
    n_parts = l.shape[2]

    with jax.named_scope("attn_window_merge"):
        kw, vw, scales = _window_rows_for_merge(k_win, v_win, pool, cdt, interpret)
        mb = merge_rows(tiles, mrows=mrows, programs=s * hkv * (d // bd))
        parts = _row_parts(r * group, mb)
        kernel = functools.partial(_window_merge_kernel, fp8=fp8, scale=scale, r=r, group=group, mrows=mb,
                                   parts=parts, rp=rp, max_keys=max_keys, chunk=tiles.chunk,
                                   short_chunk=tiles.short_chunk,
                                   fold=tiles.fold if grouped else None, fold_here=fold_here, unroll=unroll,
                                   max_block=max_block, cdt=cdt,
                                   early=merge_early(tiles, mrows=mb, bd=bd, entries=entries))
        win_scale = pl.BlockSpec((None, r * hkv), lambda i, j, e: (i, 0))
        out = pallas_call(
            kernel,
            grid=(s, hkv * parts, d // bd),
            in_specs=[pl.BlockSpec((s,), lambda i, j, e: (0,)),
                      pl.BlockSpec((None, r), lambda i, j, e: (i, 0)),
                      pl.BlockSpec((None, r * hq, d), lambda i, j, e: (i, 0, 0)),
                      pl.BlockSpec((None, r * hkv, d), lambda i, j, e: (i, 0, 0)),
                      pl.BlockSpec((None, r * hkv, None, bd), lambda i, j, e: (i, 0, e, 0)),
                      pl.BlockSpec((None, None, nc_pad, mb), lambda i, j, e: (i, j // parts, 0, j % parts)),
                      pl.BlockSpec((None, None, n_parts, mb), lambda i, j, e: (i, j // parts, 0, j % parts)),
                      pl.BlockSpec((None, None, n_parts, mb, bd), lambda i, j, e: (i, j // parts, 0, j % parts, e))]
                     + ([win_scale, win_scale] if fp8 else []),
            out_specs=pl.BlockSpec((None, None, mb, bd), lambda i, j, e: (i, j // parts, j % parts, e)),
            out_shape=jax.ShapeDtypeStruct((s, hkv, mrows, d), q.dtype),
            interpret=interpret,
            compiler_params=plgpu.CompilerParams(num_warps=tiles.merge_num_warps, num_stages=2),
            name="attn_window_merge",
        )(cache_len, parents.astype(jnp.int32), q_rows, kw.reshape(s, r * hkv, d),
          vw.reshape(s, r * hkv, d // bd, bd), m, l, acc, *scales)
    return _unpack_rows(out, r, hq)


# Whether `window_rows` shares pass 1 below a window's rows (False: every row its own one-row call, as before
# session 44; the same bits either way). Read at tracing. On since session 45: on the H200 the gates passed
# (`test_gpu_27b_window_rows`, bf16 and fp8, chains and trees; the engine's drafted == serial with copy chains and
# DFlash trees) and a 16-row DFlash window at 32K of context took 12.04 ms against 15.40 (1K: 10.49 against 10.50;
# `tools/gpu/run.sh hundred-seventy-sixth`, `hundred-seventy-eighth`).
SHARED_ROWS = True


def window_rows(q: jax.Array, k_win: jax.Array, v_win: jax.Array, pool: KVPool, page_table: jax.Array,
                row_tables: jax.Array, row_len: jax.Array, base: jax.Array, *, scale: float,
                interpret: bool = False, tiles: WindowTiles | None = None) -> jax.Array:
    """Every row of a window as a one-row `window` of its own, what a drafted row must be (drafted ≡ serial): row r
    of stream s attends over row_len[s, r] committed keys through row_tables[s R + r], with its own key as its one
    window key. Bit for bit those R one-row calls, but pass 1 reads the keys below the rows once: every chunk (of
    the size all the stream's rows cut their keys into, `stream_chunking`) that ends at or below base[s] is the same
    for each row, so one R-row pass 1 over the stream's table, cut at F (the start of the chunk holding base),
    gives those partials; a one-row pass 1 a row over its table from F on gives the one or two chunks after; the
    one-row merge of each row folds them all in chunk order, as its own call would (docs/drafting.md, "Long
    contexts"). A call whose rows straddle a chunk-size threshold (once a stream's life at each, `SHORT_CHUNKS`)
    takes the one-row calls themselves.

    q [S, R, Hq, D]; k_win, v_win [S, R, Hkv, D]; page_table [S, Pmax]: the stream's table, whose pages below base
    hold what every row's table holds there; row_tables [S R, Pmax]; row_len [S, R]: base[s] or more, or 0 for a
    row whose output is not read; base [S] -> o [S, R, Hq, D]."""
    s, r, hq, d = q.shape
    hkv = pool.k.shape[0]
    if tiles is None:
        tiles = model_window_tiles(q.dtype, pool, hq, max_keys=page_table.shape[1] * pool.page_size,
                                   interpret=interpret)
    if row_tables.shape != (s * r, page_table.shape[1]) or row_len.shape != (s, r) or base.shape != (s,):
        raise ValueError(f"window_rows: row_tables [S R, Pmax], row_len [S, R], base [S] for q {q.shape} and "
                         f"page_table {page_table.shape}; got {row_tables.shape}, {row_len.shape}, {base.shape}")
    ps = pool.page_size
    max_keys = page_table.shape[1] * ps
    one = lambda a: a.reshape((s * r, 1) + a.shape[2:])  # noqa: E731
    q1, k1, v1 = one(q), one(k_win), one(v_win)
    parents1 = jnp.full((s * r, 1), -1, jnp.int32)
    len1 = row_len.reshape(s * r).astype(jnp.int32)

    def per_row():
        return window(q1, k1, v1, parents1, pool, row_tables, len1, scale=scale, interpret=interpret, tiles=tiles)

    if tiles.tail == "tickets" or r == 1 or not SHARED_ROWS:
        return per_row().reshape(q.shape)
    base = jnp.minimum(base.astype(jnp.int32), max_keys)
    size = stream_chunking(base, tiles.chunk, tiles.short_chunk)[0]  # [S]
    size_top = stream_chunking(jnp.minimum(jnp.max(row_len, axis=1), max_keys), tiles.chunk, tiles.short_chunk)[0]
    straddle = jnp.any(size != size_top)
    first_chunk = base // size
    cut = first_chunk * size  # F: the first key of the chunk holding base

    def shared():
        # The chunks below F, once for all the stream's rows.
        whole = _merge_plan(q.shape, pool, page_table, tiles)
        ms, ls, accs = window_partials(q, pool, page_table, cut, scale=scale, tiles=tiles, interpret=interpret,
                                       pad_chunks_to=whole.pad_chunks_to, size_len=base)
        # Each row's chunks from F on: its table from F's page on, its keys counted from F, its chunk size set by
        # its own count (the stream's, as the rows do not straddle).
        pages = 2 * tiles.chunk // ps + 1
        cols = jnp.clip((cut // ps)[:, None] + jnp.arange(pages)[None, :], 0, page_table.shape[1] - 1)
        tail_tables = jnp.take_along_axis(row_tables, jnp.repeat(cols, r, axis=0), axis=1)
        tail_len = jnp.maximum(len1 - jnp.repeat(cut, r), 0)
        mt, lt, acct = window_partials(q1, pool, tail_tables, tail_len, scale=scale, tiles=tiles,
                                       interpret=interpret, size_len=jnp.repeat(base, r))
        # The partials each row's own call would have: the shared chunks' rows of this row, then its tail chunks at
        # F's chunk and the one after.
        plan = _merge_plan(q1.shape, pool, row_tables, tiles)
        group = hq // hkv
        mrows = _padded_rows(group)
        n_pad = _partials_chunks(table_chunks(max_keys, tiles.chunk, tiles.short_chunk), plan.pad_chunks_to)
        c = jnp.arange(n_pad)
        at = (c[None, :] - jnp.repeat(first_chunk, r)[:, None])  # [S R, NC]: 0 / 1 at the tail's chunks

        def rows(a, tail):
            # [S, Hkv, NCs, M_R(, D)] -> [S R, Hkv, n_pad, mrows(, D)], the tail's chunks put in
            extra = a.shape[4:]
            a = a[:, :, :n_pad, :r * group]
            nc = a.shape[2]
            a = jnp.moveaxis(a.reshape((s, hkv, nc, r, group) + extra), 3, 1).reshape((s * r, hkv, nc, group) + extra)
            a = jnp.pad(a, [(0, 0), (0, 0), (0, n_pad - nc), (0, mrows - group)] + [(0, 0)] * len(extra))
            sel = at.reshape((s * r, 1, n_pad, 1) + (1,) * len(extra))
            tail = tail[:, :, :2, :mrows]
            return jnp.where(sel == 0, tail[:, :, None, 0], jnp.where(sel == 1, tail[:, :, None, 1], a))

        parts = (rows(ms, mt), rows(ls, lt), rows(accs, acct))
        return merge_partials(q1, k1, v1, parents1, pool, row_tables, len1, parts, scale=scale, tiles=tiles,
                              interpret=interpret)

    return jax.lax.cond(straddle, per_row, shared).reshape(q.shape)


def window_rows_reference(q: jax.Array, k_win: jax.Array, v_win: jax.Array, pool: KVPool, page_table: jax.Array,
                          row_tables: jax.Array, row_len: jax.Array, base: jax.Array, *, scale: float) -> jax.Array:
    """Same contract as window_rows: the one-row windows as streams of their own, through window_reference."""
    del page_table, base  # (the kernel's sharing needs them; each row alone does not)
    s, r = q.shape[:2]
    one = lambda a: a.reshape((s * r, 1) + a.shape[2:])  # noqa: E731
    o = window_reference(one(q), one(k_win), one(v_win), jnp.full((s * r, 1), -1, jnp.int32), pool, row_tables,
                         row_len.reshape(s * r), scale=scale)
    return o.reshape(q.shape)


def _window_rows_for_merge(k_win: jax.Array, v_win: jax.Array, pool: KVPool, cdt, interpret: bool):
    """The window's own K and V rows as the pool will store them, as the merge takes them -> (kw, vw [S, R, Hkv, D],
    [k scales, v scales] each [S, R*Hkv] for fp8 pools, else []). fp8 pools: the codes widened to the compute dtype
    cdt (exact). Codes widened inside the kernel made Triton lay the window dots' K dimension out four elements a
    thread (its 8-bit operand layout), which permutes K inside an mma.sync but not inside a wgmma, and the MMA
    follows the merge program's rows: its row and column splits, which `merge_launch` picks from the stream count,
    then changed the outputs' bits (7 of 1179648 with f16 dots, `merge_rows_probe.py --sums` on the H200, session
    26; offline sm_90 compile: kWidth 4 against the bf16 pools' 2)."""
    s, r, hkv, _ = k_win.shape
    if pool.fp8:
        # The write kernel's own quantizer, so a drafted key has the bits its committed self will have (K and V
        # in one launch: rows are quantized independently).
        codes, row_scales = kv_quant.quantize(jnp.stack([k_win, v_win]), interpret=interpret)
        return (codes[0].astype(cdt), codes[1].astype(cdt),
                [row_scales[0].reshape(s, r * hkv), row_scales[1].reshape(s, r * hkv)])
    return k_win.astype(pool.k.dtype), v_win.astype(pool.k.dtype), []


def _window_tickets(q: jax.Array, k_win: jax.Array, v_win: jax.Array, parents: jax.Array, pool: KVPool,
                    page_table: jax.Array, cache_len: jax.Array, *, scale: float, tiles: WindowTiles,
                    interpret: bool) -> jax.Array:
    """`window` in one launch (tiles.tail == "tickets"): grid (stream, KV head x row part, chunk); see
    `_window_ticket_kernel`. The chunk and group partials are scratch outputs, dropped here."""
    s, r, hq, d = q.shape
    hkv = pool.k.shape[0]
    one = _pass_one(q, pool, page_table, tiles)
    mrows, rb, parts, n_chunks = one.mrows, one.rows, one.parts, one.n_chunks
    groups = _pow2(-(-n_chunks // tiles.fold))  # a power of two, as every tensor shape the Triton lowering makes
    nc = groups * tiles.fold
    _, unroll = merge_launch(tiles, streams=s, hkv=hkv, mrows=rb, head_dim=d, groups=groups)
    max_block = min(nc, _pow2_floor(max(1, 4096 // rb)))
    kw, vw, win_scales = _window_rows_for_merge(k_win, v_win, pool, one.cdt, interpret)

    def rows_of(c_dim: int, *tail):  # an output's block: this (stream, KV head)'s entries for the part's rows
        return pl.BlockSpec((None, None, c_dim, rb, *tail), lambda i, j, c: (i, j // parts, 0, j % parts,
                                                                             *(0,) * len(tail)))

    win_scale = pl.BlockSpec((None, r * hkv), lambda i, j, c: (i, 0))
    tickets = pl.BlockSpec((s, hkv * parts, groups + 1), lambda i, j, c: (0, 0, 0))
    in_specs = ([pl.BlockSpec((s,), lambda i, j, c: (0,)),
                 pl.BlockSpec((None, r), lambda i, j, c: (i, 0)),
                 pl.BlockSpec((None, one.page_table.shape[1]), lambda i, j, c: (i, 0)),
                 pl.BlockSpec((None, r * hq, d), lambda i, j, c: (i, 0, 0)),
                 pl.BlockSpec((None, r * hkv, d), lambda i, j, c: (i, 0, 0)),
                 pl.BlockSpec((None, r * hkv, d), lambda i, j, c: (i, 0, 0)),
                 *one.kv_specs] + ([win_scale, win_scale] if pool.fp8 else []) + [tickets])
    operands = ([cache_len.astype(jnp.int32), parents.astype(jnp.int32), one.page_table, q.reshape(s, r * hq, d),
                 kw.reshape(s, r * hkv, d), vw.reshape(s, r * hkv, d), *_pool_operands(pool), *win_scales,
                 jnp.zeros((s, hkv * parts, groups + 1), jnp.int32)])
    kernel = functools.partial(_window_ticket_kernel, fp8=pool.fp8, v_keys=pool.keys_major, scale=scale, r=r,
                               group=hq // hkv, mrows=rb,
                               parts=parts, rp=_padded_rows(r), max_keys=one.max_keys, page_size=pool.page_size,
                               tiles=tiles, unroll=unroll, max_block=max_block, interpret=interpret, cdt=one.cdt)
    f32 = jnp.float32
    with jax.named_scope("attn_window_tickets"):
        out = pallas_call(
            kernel,
            grid=(s, hkv * parts, n_chunks),
            in_specs=in_specs,
            out_specs=[rows_of(nc), rows_of(nc), rows_of(nc, d), rows_of(groups), rows_of(groups),
                       rows_of(groups, d),
                       pl.BlockSpec((None, None, rb, d), lambda i, j, c: (i, j // parts, j % parts, 0)), tickets],
            out_shape=[jax.ShapeDtypeStruct((s, hkv, nc, mrows), f32), jax.ShapeDtypeStruct((s, hkv, nc, mrows), f32),
                       jax.ShapeDtypeStruct((s, hkv, nc, mrows, d), f32),
                       jax.ShapeDtypeStruct((s, hkv, groups, mrows), f32),
                       jax.ShapeDtypeStruct((s, hkv, groups, mrows), f32),
                       jax.ShapeDtypeStruct((s, hkv, groups, mrows, d), f32),
                       jax.ShapeDtypeStruct((s, hkv, mrows, d), q.dtype),
                       jax.ShapeDtypeStruct((s, hkv * parts, groups + 1), jnp.int32)],
            input_output_aliases={len(operands) - 1: 7},
            interpret=interpret,
            compiler_params=plgpu.CompilerParams(num_warps=one.warps, num_stages=one.stages),
            name="attn_window_tickets",
        )(*operands)[6]
    return _unpack_rows(out, r, hq)


def _check_pool(pool: KVPool, d: int) -> None:
    check_v_layout(pool)
    if pool.k.shape[3] != d:
        raise ValueError(f"queries have head dim {d} but the pool holds {pool.k.shape[3]}")
    ps = pool.page_size
    if ps & (ps - 1):
        raise ValueError(f"page size {ps} must be a power of two")
    if d & (d - 1) or d < 16:
        raise ValueError(f"head dim {d} must be a power of two >= 16 for the kernels")
    if pool.fp8 and (pool.k_scale is None or pool.v_scale is None):
        raise ValueError("an fp8 pool needs k_scale and v_scale (build it with kv_quant.empty_pool)")


def _check_block(block_k: int, what: str) -> None:
    if block_k & (block_k - 1) or block_k < 16:
        raise ValueError(f"{what}.block_k={block_k} must be a power of two >= 16")


def _check_window(q, k_win, v_win, parents, pool: KVPool, page_table, cache_len, tiles: WindowTiles) -> int:
    if q.ndim != 4:
        raise ValueError(f"q must be [S, R, Hq, D]; got shape {q.shape}")
    s, r, hq, d = q.shape
    hkv = pool.k.shape[0]
    _check_pool(pool, d)
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of the pool's {hkv} KV heads")
    if not 1 <= r <= 16:
        raise ValueError(f"a window holds 1..16 rows per stream; got R={r}")
    if k_win.shape != (s, r, hkv, d) or v_win.shape != k_win.shape:
        raise ValueError(f"k_win and v_win must be [S, R, Hkv, D] = {(s, r, hkv, d)}; got {k_win.shape}, "
                         f"{v_win.shape}")
    if parents.shape != (s, r):
        raise ValueError(f"parents must be [S, R] = {(s, r)}; got {parents.shape}")
    if page_table.ndim != 2 or page_table.shape[0] != s:
        raise ValueError(f"page_table must be [S={s}, Pmax]; got {page_table.shape}")
    if cache_len.shape != (s,):
        raise ValueError(f"cache_len must be [S={s}]; got {cache_len.shape}")
    _check_block(tiles.block_k, "WindowTiles")
    if tiles.chunk % tiles.block_k or tiles.chunk % pool.page_size:
        raise ValueError(f"WindowTiles.chunk={tiles.chunk} must be a multiple of block_k={tiles.block_k} and of "
                         f"the page size {pool.page_size}")
    sc = tiles.short_chunk
    if sc is not None and (sc < 1 or sc % tiles.block_k or sc % pool.page_size or tiles.chunk % sc
                           or (tiles.chunk // sc) & (tiles.chunk // sc - 1)):
        raise ValueError(f"WindowTiles.short_chunk={sc} must be a multiple of block_k={tiles.block_k} and of the "
                         f"page size {pool.page_size}, and chunk={tiles.chunk} a power-of-two multiple of it")
    if tiles.row_block is not None and (tiles.row_block < 16 or tiles.row_block & (tiles.row_block - 1)):
        raise ValueError(f"WindowTiles.row_block={tiles.row_block} must be a power of two >= 16")
    if tiles.fold < 1 or tiles.fold & (tiles.fold - 1):
        raise ValueError(f"WindowTiles.fold={tiles.fold} must be a power of two >= 1")
    if tiles.fold_block_d is not None and (tiles.fold_block_d & (tiles.fold_block_d - 1)
                                           or d % min(tiles.fold_block_d, d)):
        raise ValueError(f"WindowTiles.fold_block_d={tiles.fold_block_d} must be a power of two dividing {d}")
    if tiles.fold_in_merge not in (None, True, False):
        raise ValueError(f"WindowTiles.fold_in_merge must be None, True or False; got {tiles.fold_in_merge!r}")
    if tiles.merge_loads not in (None, "early", "loop"):
        raise ValueError(f"WindowTiles.merge_loads must be None, 'early' or 'loop'; got "
                         f"{tiles.merge_loads!r}")
    if tiles.merge_unroll is not None and tiles.merge_unroll < 1:
        raise ValueError(f"WindowTiles.merge_unroll={tiles.merge_unroll} must be >= 1")
    if tiles.fp8_dot not in ("bfloat16", "float16"):
        raise ValueError(f"WindowTiles.fp8_dot must be 'bfloat16' or 'float16'; got {tiles.fp8_dot!r}")
    if tiles.fp8_v_max not in ("block", "chunk"):
        raise ValueError(f"WindowTiles.fp8_v_max must be 'block' or 'chunk'; got {tiles.fp8_v_max!r}")
    if tiles.impl not in ("triton", "mgpu"):
        raise ValueError(f"WindowTiles.impl must be 'triton' or 'mgpu'; got {tiles.impl!r}")
    if tiles.partials not in ("float32", "bfloat16"):
        raise ValueError(f"WindowTiles.partials must be 'float32' or 'bfloat16'; got {tiles.partials!r}")
    if tiles.partials != "float32" and tiles.impl != "mgpu":
        raise ValueError(f"WindowTiles.partials={tiles.partials!r} needs impl='mgpu' (the Triton pass 1 stores "
                         "fp32 partials)")
    if tiles.impl == "mgpu" and tiles.tail != "passes":
        raise ValueError(f"WindowTiles.impl='mgpu' needs tail='passes'; got tail={tiles.tail!r}")
    if tiles.tail not in ("passes", "tickets"):
        raise ValueError(f"WindowTiles.tail must be 'passes' or 'tickets'; got {tiles.tail!r}")
    if tiles.walk not in ("page", "flat"):
        raise ValueError(f"WindowTiles.walk must be 'page' or 'flat'; got {tiles.walk!r}")
    if tiles.merge_block_d is not None and (tiles.merge_block_d & (tiles.merge_block_d - 1)
                                            or d % min(tiles.merge_block_d, d)):
        raise ValueError(f"WindowTiles.merge_block_d={tiles.merge_block_d} must be a power of two dividing {d}")
    mbr = tiles.merge_block_rows
    if mbr is not None and (mbr < 16 or mbr & (mbr - 1)):
        raise ValueError(f"WindowTiles.merge_block_rows={mbr} must be a power of two, at least 16")
    return hkv


# ----------------------------------------------------------------------------------------------------------------
# Prompt chunk: causal attention of new rows over the cached prefix plus themselves
# ----------------------------------------------------------------------------------------------------------------

def _prompt_kernel(start_ref, lengths_ref, pt_ref, q_ref, k_ref, v_ref, *refs, fp8: bool, contiguous: bool,
                   scale: float, max_keys: int, page_size: int, n_q_blocks: int, tiles: PromptTiles, cdt,
                   v_keys: bool = False):
    # start_ref, lengths_ref [S]; pt_ref [Pmax]; q_ref [BQ, D] (one query head, rows of one tile);
    # k_ref, v_ref: contiguous [L, D] (this stream's keys of the head's KV head), else the pool's [P, page, D]
    # (v_keys: v_ref [P, D, page]);
    # fp8: ks_ref, vs_ref [L] or [P, page]; o_ref [BQ, D].
    if fp8:
        ks_ref, vs_ref, o_ref = refs
    else:
        ks_ref = vs_ref = None
        (o_ref,) = refs
    s = pl.program_id(2)
    # Longest tiles first: the causal triangle makes late tiles the slow ones.
    tile = n_q_blocks - 1 - pl.program_id(1)
    bq, bk = tiles.block_q, tiles.block_k
    start, length = start_ref[s], lengths_ref[s]
    t0 = tile * bq
    rows = t0 + jnp.arange(bq)
    qpos = start + rows

    @pl.when(t0 >= length)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(t0 < length)
    def _():
        q = q_ref[...].astype(cdt)
        d = q.shape[1]

        def keys(b):
            if contiguous:
                blk = pl.ds(b * bk, bk)
                return (k_ref[blk, :], v_ref[blk, :], None if ks_ref is None else ks_ref[blk],
                        None if vs_ref is None else vs_ref[blk])
            first = b * bk
            if bk >= page_size:
                pages = pt_ref[pl.ds(first // page_size, bk // page_size)]
                return (k_ref[pages].reshape(bk, d), _v_pages(v_ref, pages, bk, v_keys),
                        None if ks_ref is None else ks_ref[pages].reshape(bk),
                        None if vs_ref is None else vs_ref[pages].reshape(bk))
            # (first - page*size rather than %: the Triton lowering of a signed % inside the loop fails)
            logical = first // page_size
            page, blk = pt_ref[logical], pl.ds(first - logical * page_size, bk)
            return (k_ref[page, blk, :], _v_rows(v_ref, page, blk, v_keys),
                    None if ks_ref is None else ks_ref[page, blk], None if vs_ref is None else vs_ref[page, blk])

        last_key = jnp.minimum(start + jnp.minimum(t0 + bq, length) - 1, max_keys - 1)
        n_blocks = last_key // bk + 1
        # Blocks wholly at or before the tile's first row need no mask.
        n_open = jnp.minimum((jnp.minimum(start + t0, max_keys - 1) + 1) // bk, n_blocks)

        def open_body(b, carry):
            return _online_step(carry, q, *keys(b), None, scale, cdt)

        def masked_body(b, carry):
            visible = (b * bk + jnp.arange(bk))[None, :] <= qpos[:, None]
            return _online_step(carry, q, *keys(b), visible, scale, cdt)

        carry = (jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32),
                 jnp.zeros((bq, d), jnp.float32))
        carry = jax.lax.fori_loop(0, n_open, open_body, carry)
        _, l, acc = jax.lax.fori_loop(n_open, n_blocks, masked_body, carry)
        out = acc / jnp.where(l > 0, l, 1.0)[:, None]
        o_ref[...] = jnp.where((rows < length)[:, None], out, 0.0).astype(o_ref.dtype)


def _contiguous_keys(pool: KVPool, page_table: jax.Array) -> list[jax.Array]:
    """Each stream's pages copied into rows: k, v [Hkv, S, L, D] (+ fp8 scales [Hkv, S, L]), L = Pmax*page."""
    s, pmax = page_table.shape

    def rows(y):  # [Hkv, S, Pmax, page(, D)]
        return y.reshape(y.shape[0], s, pmax * pool.page_size, *y.shape[4:])

    return ([rows(pool.k[:, page_table]), rows(pool.v_pages(page_table))]
            + ([rows(pool.k_scale[:, page_table]), rows(pool.v_scale[:, page_table])] if pool.fp8 else []))


def check_prompt_rows(q: jax.Array, pool: KVPool, page_table: jax.Array, start: jax.Array, lengths: jax.Array
                      ) -> None:
    """The prompt entry points' shared checks of q [S, T, Hq, D] against the pool's KV heads, the page table and
    the per-stream start and lengths (ValueError)."""
    s, hq, hkv = q.shape[0], q.shape[2], pool.k.shape[0]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of the pool's {hkv} KV heads")
    if page_table.ndim != 2 or page_table.shape[0] != s:
        raise ValueError(f"page_table must be [S={s}, Pmax]; got {page_table.shape}")
    if start.shape != (s,) or lengths.shape != (s,):
        raise ValueError(f"start and lengths must be [S={s}]; got {start.shape}, {lengths.shape}")


def prompt(q: jax.Array, pool: KVPool, page_table: jax.Array, start: jax.Array, lengths: jax.Array, *,
           scale: float, interpret: bool = False, tiles: PromptTiles | None = None) -> jax.Array:
    """Same contract as prompt_reference: one program per (query head, tile of block_q rows, stream) walks the key
    blocks of the absolute grid from position 0 to its last row, in order, with an online softmax. A row's bits
    depend only on its absolute position and the keys up to it, so cutting a prompt into chunks anywhere, or
    resuming from a cache, gives the same bits as one pass. tiles=None: prompt_tiles() for this pool and table.
    tiles.impl="mgpu" sends bf16 queries over bf16 or fp8 pools to the Mosaic GPU kernel (`attention_mgpu`; same
    contract, its own bits).

    q [S, T, Hq, D]; page_table [S, Pmax]; start [S]; lengths [S] -> o [S, T, Hq, D] (rows past lengths: zeros)
    """
    if q.ndim != 4:
        raise ValueError(f"q must be [S, T, Hq, D]; got shape {q.shape}")
    s, t, hq, d = q.shape
    hkv = pool.k.shape[0]
    _check_pool(pool, d)
    if tiles is None:
        tiles = prompt_tiles(page_size=pool.page_size, max_keys=page_table.shape[-1] * pool.page_size, head_dim=d,
                             fp8=pool.fp8)
        if PROMPT_IMPL not in ("auto", "triton", "mgpu"):
            raise ValueError(f"attention.PROMPT_IMPL must be 'auto', 'triton' or 'mgpu'; got {PROMPT_IMPL!r}")
        impl = ("triton" if interpret else "mgpu") if PROMPT_IMPL == "auto" else PROMPT_IMPL
        tiles = dataclasses.replace(tiles, impl=impl)
    if tiles.fp8_dot not in ("bfloat16", "float16"):
        raise ValueError(f"PromptTiles.fp8_dot must be 'bfloat16' or 'float16'; got {tiles.fp8_dot!r}")
    if tiles.impl not in ("triton", "mgpu"):
        raise ValueError(f"PromptTiles.impl must be 'triton' or 'mgpu'; got {tiles.impl!r}")
    if tiles.impl == "mgpu" and mgpu_operands(q.dtype, pool):
        from pallas_kernels.attention_mgpu import prompt_mgpu  # (it imports this module)
        return prompt_mgpu(q, pool, page_table, start, lengths, scale=scale, interpret=interpret)
    check_prompt_rows(q, pool, page_table, start, lengths)
    _check_block(tiles.block_k, "PromptTiles")
    if tiles.block_q & (tiles.block_q - 1) or tiles.block_q < 16:
        raise ValueError(f"PromptTiles.block_q={tiles.block_q} must be a power of two >= 16")
    group = hq // hkv
    bq = tiles.block_q
    tp = -(-t // bq) * bq
    if tp != t:
        q = jnp.pad(q, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
    n_q_blocks = tp // bq
    ps, fp8 = pool.page_size, pool.fp8
    max_keys = page_table.shape[1] * ps
    page_table = _pad_table(page_table, -(-max_keys // tiles.block_k) * tiles.block_k, ps)
    kernel = functools.partial(_prompt_kernel, fp8=fp8, contiguous=tiles.contiguous,
                               v_keys=pool.keys_major and not tiles.contiguous, scale=scale, max_keys=max_keys,
                               page_size=ps, n_q_blocks=n_q_blocks, tiles=tiles,
                               cdt=_compute_dtype(q.dtype, pool, tiles.fp8_dot))
    if tiles.contiguous:
        with jax.named_scope("attn_prompt_gather"):
            kv = _contiguous_keys(pool, page_table)
        n_keys = kv[0].shape[2]
        kv_spec = v_spec = pl.BlockSpec((None, None, n_keys, d), lambda h, i, b: (h // group, b, 0, 0))
        kv_scale = pl.BlockSpec((None, None, n_keys), lambda h, i, b: (h // group, b, 0))
    else:
        kv = [pool.k, pool.v] + ([pool.k_scale, pool.v_scale] if fp8 else [])
        kv_spec = pl.BlockSpec((None, pool.num_pages, ps, d), lambda h, i, b: (h // group, 0, 0, 0))
        v_spec = pl.BlockSpec((None,) + pool.v.shape[1:], lambda h, i, b: (h // group, 0, 0, 0))
        kv_scale = pl.BlockSpec((None, pool.num_pages, ps), lambda h, i, b: (h // group, 0, 0))
    # Grid axis 0 varies fastest at launch: the G heads sharing a KV head run side by side and share its blocks
    # through L2.
    q_spec = pl.BlockSpec((None, bq, None, d), lambda h, i, b: (b, n_q_blocks - 1 - i, h, 0))
    with jax.named_scope("attn_prompt"):
        out = pallas_call(
            kernel,
            grid=(hq, n_q_blocks, s),
            in_specs=[pl.BlockSpec((s,), lambda h, i, b: (0,)), pl.BlockSpec((s,), lambda h, i, b: (0,)),
                      pl.BlockSpec((None, page_table.shape[1]), lambda h, i, b: (b, 0)),
                      q_spec, kv_spec, v_spec] + ([kv_scale, kv_scale] if fp8 else []),
            out_specs=q_spec,
            out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
            interpret=interpret,
            compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
            name="attn_prompt",
        )(start.astype(jnp.int32), lengths.astype(jnp.int32), page_table, q, *kv)
    return out[:, :t]
