"""Prompt-chunk attention on Mosaic GPU (Hopper wgmma, warp-specialised TMA pipeline): the bf16 path of
`attention.prompt` rewritten FA3-style, with the same contract and the same exactness property.

Letters as in `attention`: s streams, t rows, h query heads, g KV heads, d head dim, l key positions.

Why a second kernel: the Triton prompt kernel (64x64 tiles, one query head a program) runs at 0.39-0.50x cuDNN on
the H200 at the 27B shape (issue #5). Here a CTA owns `block_q` rows of one query head, 64 rows per compute
warpgroup, and a memory warpgroup streams the KV head's key blocks through TMA into `stages` shared-memory slots
(K and V of a slot on barriers of their own, so S = Q K^T starts while V is still in flight). Per block each
compute warpgroup runs S = Q K^T by wgmma into a fresh fp32 accumulator, the online softmax in fp32 registers,
P rounded to bf16 as the register A operand of P V, accumulated by wgmma into the running fp32 O. With two
compute warpgroups a schedule barrier alternates them (FA3's ping-pong), so one's softmax overlaps the other's
MMAs.

Exactness (the `attention` conventions): key block b always covers absolute positions [b*block_k, (b+1)*block_k),
and every row walks blocks 0, 1, ... in order up to its CTA's last visible key. A row's S, max, sum and P V are
computed from that row alone (wgmma reduces over d per row; the softmax reductions are per row), so its bits depend
only on its position and the keys up to it. Masking selects -inf on the raw S before any arithmetic, so a block run
with the mask and one run without it apply the same operations to a visible logit (Mosaic GPU lets the compiler
contract s c - m into an FMA; the select comes before the multiply, so it can in both; the gpu tests cut a chunk
where a row's block changes sides). A fully masked block is an exact no-op (m unchanged, alpha = 2^0 = 1, p = 0:
O + 0 x V and l + 0 are O and l, for finite V: stale keys in a page are finite, as the Triton kernel assumes too),
so the blocks a row visits past its own last key (its warpgroup or CTA reaches further) never change it. Block 0
holds key 0, visible to every row, so m is finite after the first block. Hence cutting a prompt into chunks
anywhere, the other streams, and the CTA or warpgroup a row lands in leave its bits alone. The bits differ from
the Triton kernel's (another reduction order inside the MMAs, exp2 of pre-scaled logits); a model uses one prompt
kernel.

Floors (H200, 27B: Hq 24, d 256): a causal chunk of T rows over P cached keys costs 4 d Hq (T P + T^2 / 2) FLOPs;
the 4K chunk alone ~0.21 TFLOP, ~260 µs at 790 TFLOP/s (dense bf16 wgmma at realistic clocks), 3.5 TFLOP and
~4.4 ms after a 32K prefix. Shared memory (227 KiB a CTA): Q (reused for O) 64 rows x d bf16 per warpgroup
(2 x 32 KiB at d 256) plus `stages` x (K + V) blocks of block_k x d bf16 (64 KiB a stage at 64 keys), so two
stages at d 256 (192 KiB). Registers: O is 64 x d fp32 per warpgroup, 128 a thread at d 256, S 32 more at 64 keys;
two compute warpgroups take 232 registers each, the memory warpgroup 40 (one compute warpgroup: no adjustment).

Status (session 14): right in the interpreter (tests/test_attention_mgpu.py) and on the H200 (its 5 `-m gpu` tests:
float64 bounds, chunk cuts and launch variants bit for bit, at the 27B shape). `python -m pallas_kernels.bench
attention --sections prompt_mgpu` on the H200: a 4K chunk in 547 µs after 0 keys (377 TFLOP/s, 1.01x cuDNN's 554 µs)
and 5651 µs after 32K (620 TFLOP/s, 0.88x cuDNN's 4962), where the Triton kernel took 849 / 12691 µs. The default
for bf16 pools on a GPU since then (`attention.PROMPT_IMPL`); the engine's 6 gates pass with it. Since session 15
it is lowered once a process per shape (`mgpu_lowering`), not once per attention layer of every program.

fp8 pools (session 21): the gather that copies a stream's pages into contiguous rows for the TMA dequantizes
them on the way, to bf16(code x scale) (`dequantized_keys`), and the kernel runs unchanged on those rows, so a
row's bits are the bf16 kernel's over a pool holding the dequantized values, and the exactness above carries over
(a key's dequantized value depends on that key alone). The copy reads a byte and writes two per value where the
bf16 pool's reads two: at a 4K chunk it is a few percent of the kernel's time.

Interpret mode (CPU, `plgpu.InterpretGPUParams`) runs the same kernel with two differences the interpreter needs:
P goes to shared memory for the P V wgmma (it takes no register operand), and P V lands in a fresh accumulator
added to O (no `run_state` accumulator initialised from a value).
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

from pallas_kernels.attention import (SMEM_BYTES, _check_pool, _contiguous_keys, _pad_table, check_prompt_rows,
                                     mgpu_operands)
from pallas_kernels.kv_quant import KVPool, dequantize_reference
from pallas_kernels.mgpu_lowering import CachedKernel

WG_ROWS = 64  # query rows a compute warpgroup owns (the wgmma M)
COMPUTE_REGISTERS, MEMORY_REGISTERS = 232, 40  # (2 x 232 + 40) x 128 threads <= the SM's 64K registers
_LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class PromptMgpuTiles:
    """Tiles of the Mosaic GPU prompt kernel. `block_k` fixes a row's reduction order (key blocks on the absolute
    grid); `block_q` (64 rows per compute warpgroup: 64 or 128) and `stages` (K/V blocks in flight) are launch
    choices that never change a row's bits."""
    block_q: int = 128
    block_k: int = 64
    stages: int = 2


def smem_bytes(tiles: PromptMgpuTiles, head_dim: int, *, interpret: bool = False) -> int:
    """Shared memory a CTA asks for: the Q/O tiles, the K/V stages (and interpret mode's P tiles)."""
    wgs = tiles.block_q // WG_ROWS
    q = wgs * WG_ROWS * head_dim * 2
    kv = tiles.stages * 2 * tiles.block_k * head_dim * 2
    p = wgs * WG_ROWS * tiles.block_k * 2 if interpret else 0
    return q + kv + p


def _transforms(cols: int, bits: int = 16) -> tuple:
    """Tiling and swizzle of a shared-memory tile with rows of `cols` elements of `bits` bits (bf16 by default; 8
    for e4m3 codes), a wgmma operand."""
    swizzle = plgpu.find_swizzle(cols * bits)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def _div(a: jax.Array, b: int) -> jax.Array:
    """a // b for a >= 0 as one integer division (jnp's floor division adds sign fix-ups)."""
    return lax.div(a, jnp.asarray(b, a.dtype))


def feed_slots(fetch, n_blocks: jax.Array, stages: int, frees) -> None:
    """The memory warpgroup's walk over key blocks 0 .. n_blocks - 1 into `stages` slots: fetch(b, reuse) copies
    block b into slot b mod stages (reuse: after waiting on the slot's free barriers for its last block). Then it
    observes the last blocks' releases on `frees` too: nothing waits for them on the device, but the interpreter
    checks that a barrier's waiters saw every phase before it is freed."""
    for b in range(stages):
        pl.when(b < n_blocks)(functools.partial(fetch, jnp.int32(b), False))
    pl.loop(stages, lax.max(n_blocks, stages))(functools.partial(fetch, reuse=True))

    @pl.loop(lax.max(n_blocks, stages), n_blocks + stages)
    def _(b):
        for free in frees:
            plgpu.barrier_wait(free.at[lax.rem(b, stages)])


def online_start(d: int) -> tuple:
    """A compute warpgroup's (O [64, d], running max m [64], sum l [64]) before its first key block, in the wgmma
    layouts."""
    return (plgpu.layout_cast(jnp.full((WG_ROWS, d), 0, jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((WG_ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
            plgpu.layout_cast(jnp.full((WG_ROWS,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1)))


def online_softmax(logits: jax.Array, acc: jax.Array, m: jax.Array, l: jax.Array, c: float, *,
                   rescale: jax.Array | None = None, p_dtype=jnp.bfloat16) -> tuple:
    """One key block's online-softmax update in log2 units (p = 2^(s c - m)): logits [64, bk] fp32 (masked keys
    -inf), O acc [64, d], m, l [64] -> (O rescaled to the new max, the new m and l, P [64, bk] in p_dtype).
    rescale [64]: a further factor O takes with the max's (None: none)."""
    m_new = jnp.maximum(m, logits.max(axis=1) * c)
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(logits * c - lax.broadcast_in_dim(m_new, logits.shape, [0]))
    l = l * alpha + p.sum(axis=1)
    factor = alpha if rescale is None else alpha * rescale
    return acc * lax.broadcast_in_dim(factor, acc.shape, [0]), m_new, l, p.astype(p_dtype)


def add_pv(acc: jax.Array, p16: jax.Array, v_tile, p_tile, *, then) -> jax.Array:
    """O + P V by wgmma: acc [64, d] fp32, p16 [64, bk] bf16 (the register A operand), v_tile [bk, d] in shared
    memory; then() runs once the MMA is issued, before its result is read. p_tile: interpret mode's [64, bk]
    shared-memory tile (the interpreter's wgmma takes no register operand and no accumulator initialised from a
    value: P goes through it and P V lands in a fresh accumulator added to O), None when compiled."""
    if p_tile is not None:
        p_tile[...] = p16
        plgpu.commit_smem()

    def pv(acc_ref):
        plgpu.wgmma(acc_ref, p16 if p_tile is None else p_tile, v_tile)
        then()

    return accumulate(acc, pv, fresh=p_tile is not None)


def accumulate(acc: jax.Array, issue, *, fresh: bool) -> jax.Array:
    """acc [64, n] fp32 plus the wgmmas issue(acc_ref) issues: accumulated into acc itself, or (fresh: interpret
    mode, whose wgmma starts from zero) into a fresh accumulator then added to acc."""
    if fresh:
        return acc + pl.run_scoped(lambda acc_ref: (issue(acc_ref), acc_ref[...])[1],
                                   plgpu.ACC(acc.shape, jnp.float32))
    return pl.run_state(issue)(plgpu.ACC.init(acc))


def _kernel_call(start: jax.Array, lengths: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
                 max_keys: int, group: int, tiles: PromptMgpuTiles,
                 interpret: bool | plgpu.InterpretGPUParams) -> jax.Array:
    """q [S, Tp, Hq, D] bf16 (Tp a multiple of block_q); k, v [Hkv, S, L, D] bf16 (L a multiple of block_k);
    start, lengths [S] int32 -> o [S, Tp, Hq, D] bf16. Grid (query head, row tile, stream), heads fastest so the
    G heads of a KV head run side by side and share its blocks through L2; row tiles longest first."""
    s_count, tp, hq, d = q.shape
    bq, bk, stages = tiles.block_q, tiles.block_k, tiles.stages
    wgs = bq // WG_ROWS
    n_tiles = tp // bq
    ping_pong = wgs == 2
    c = scale * _LOG2E  # logits in log2 units: p = 2^(s c - m)

    def kernel(start_gmem, lengths_gmem, q_gmem, k_gmem, v_gmem, o_gmem, smem, ready, free, q_ready, schedule):
        # start_gmem, lengths_gmem [S]; q_gmem, o_gmem [S, Tp, Hq, D]; k_gmem, v_gmem [Hkv, S, L, D]
        # smem: qo [wgs, 64, D], k, v [stages, bk, D] (interpret: p [wgs, 64, bk]); ready, free: (K, V) barriers
        qo_smem, k_smem, v_smem, p_smem = smem
        k_ready, v_ready = ready
        k_free, v_free = free
        h = lax.axis_index("heads")
        tile = n_tiles - 1 - lax.axis_index("tiles")
        s = lax.axis_index("streams")
        wg = lax.axis_index("wg")
        start, length = start_gmem[s], lengths_gmem[s]
        t0 = tile * bq
        # The CTA's last visible key (its last real row's), clipped to the table; no key block past a short stream.
        last_key = lax.min(start + lax.min(t0 + bq, length) - 1, jnp.int32(max_keys - 1))
        n_blocks = jnp.where(t0 < length, _div(last_key, bk) + 1, 0)

        def sync_compute():
            if ping_pong:
                plgpu.barrier_arrive(schedule)
                plgpu.barrier_wait(schedule)

        @pl.when(wg < wgs)
        def _compute():
            if wgs == 2:  # (with one, the 256 threads may each hold 255 registers from the launch)
                plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
            qo = qo_smem.at[wg]
            r0 = t0 + wg * WG_ROWS
            rows = pl.ds(r0, WG_ROWS)
            plgpu.copy_gmem_to_smem(q_gmem.at[s, rows, h], qo, q_ready.at[wg])
            plgpu.barrier_wait(q_ready.at[wg])
            first = start + r0  # absolute position of the warpgroup's first row
            # Blocks wholly at or before the first row need no mask (a launch choice: the masked step gives a
            # visible logit the same operations).
            n_open = lax.min(_div(lax.min(first, jnp.int32(max_keys - 1)) + 1, bk), n_blocks)

            def step(b, carry, masked: bool):
                acc, m, l = carry
                slot = lax.rem(b, stages)

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, qo, k_smem.at[slot].T)
                    sync_compute()
                    return acc_ref[...]

                logits = pl.run_scoped(qk, plgpu.ACC((WG_ROWS, bk), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if masked:
                    row = plgpu.broadcasted_iota(jnp.int32, (WG_ROWS, bk), 0, layout=plgpu.Layout.WGMMA)
                    col = plgpu.broadcasted_iota(jnp.int32, (WG_ROWS, bk), 1, layout=plgpu.Layout.WGMMA)
                    logits = jnp.where(col - row <= first - b * bk, logits, -jnp.inf)
                acc, m_new, l, p16 = online_softmax(logits, acc, m, l, c)
                if ping_pong:
                    plgpu.barrier_arrive(schedule)
                plgpu.barrier_wait(v_ready.at[slot])
                if ping_pong:
                    plgpu.barrier_wait(schedule)

                def wait_next_keys():
                    @pl.when(b + 1 < n_blocks)
                    def _():
                        plgpu.barrier_wait(k_ready.at[lax.rem(b + 1, stages)])

                acc = add_pv(acc, p16, v_smem.at[slot], p_smem.at[wg] if interpret else None, then=wait_next_keys)
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l

            carry = online_start(d)

            @pl.when(n_blocks > 0)
            def _():
                plgpu.barrier_wait(k_ready.at[0])

            if ping_pong:
                pl.when(wg == 1)(sync_compute)
            carry = lax.fori_loop(0, n_open, functools.partial(step, masked=False), carry)
            acc, _, l = lax.fori_loop(n_open, n_blocks, functools.partial(step, masked=True), carry)
            if ping_pong:
                pl.when(wg == 0)(sync_compute)
            row = plgpu.broadcasted_iota(jnp.int32, (WG_ROWS, d), 0, layout=plgpu.Layout.WGMMA)
            l = jnp.where(l > 0, l, 1.0)
            out = acc / lax.broadcast_in_dim(l, acc.shape, [0])
            qo[...] = jnp.where(row < length - r0, out, 0.0).astype(jnp.bfloat16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo, o_gmem.at[s, rows, h])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == wgs)
        def _memory():
            if wgs == 2:
                plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")
            g = _div(h, group)
            kv = ((k_gmem, k_smem, k_ready, k_free), (v_gmem, v_smem, v_ready, v_free))

            def fetch(b, reuse: bool):
                # Block b into its slot; reuse: first wait until both compute warpgroups released the slot's last
                # block (K and V apart, so K's copy never waits for V's release).
                slot = lax.rem(b, stages)
                for src, dst, ready, free in kv:
                    if reuse:
                        plgpu.barrier_wait(free.at[slot])
                    plgpu.copy_gmem_to_smem(src.at[g, s, pl.ds(b * bk, bk)], dst.at[slot], ready.at[slot])

            feed_slots(fetch, n_blocks, stages, [free for *_, free in kv])

    qd, kd = _transforms(d), _transforms(d)
    smem = (plgpu.SMEM((wgs, WG_ROWS, d), jnp.bfloat16, transforms=qd),
            plgpu.SMEM((stages, bk, d), jnp.bfloat16, transforms=kd),
            plgpu.SMEM((stages, bk, d), jnp.bfloat16, transforms=kd),
            plgpu.SMEM((wgs, WG_ROWS, bk), jnp.bfloat16, transforms=_transforms(bk)) if interpret else None)
    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(hq, n_tiles, s_count), grid_names=("heads", "tiles", "streams"),
        num_threads=wgs + 1, thread_name="wg",
        scratch_types=(smem,
                       (plgpu.Barrier(num_barriers=stages),) * 2,
                       (plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),) * 2,
                       plgpu.Barrier(num_barriers=wgs),
                       plgpu.Barrier(num_arrivals=wgs)),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=(interpret if isinstance(interpret, plgpu.InterpretGPUParams)
                   else plgpu.InterpretGPUParams() if interpret else None))
    return call(start, lengths, q, k, v)


def _check(q: jax.Array, pool: KVPool, page_table: jax.Array, start: jax.Array, lengths: jax.Array,
           tiles: PromptMgpuTiles, interpret: bool | plgpu.InterpretGPUParams) -> None:
    if q.ndim != 4:
        raise ValueError(f"q must be [S, T, Hq, D]; got shape {q.shape}")
    d = q.shape[3]
    _check_pool(pool, d)
    if not mgpu_operands(q.dtype, pool):
        raise ValueError(f"prompt_mgpu takes bf16 queries over a bf16 or fp8 pool; got q {q.dtype}, pool "
                         f"{pool.k.dtype} (fp32 pools: attention.prompt with the Triton kernel)")
    if d % 64 or d > 256:
        raise ValueError(f"prompt_mgpu needs a head dim that is a multiple of 64, at most 256; got {d}")
    check_prompt_rows(q, pool, page_table, start, lengths)
    if tiles.block_q not in (64, 128):
        raise ValueError(f"PromptMgpuTiles.block_q={tiles.block_q} must be 64 or 128 (64 rows a warpgroup)")
    if tiles.block_k not in (64, 128):
        # P V's contraction runs over the block's keys, V's rows of d bf16 in 128-byte swizzled tiles: the wgmma
        # lowering takes a multiple of 64; 128 keys hold S in 64 more registers a thread beside O's 128.
        raise ValueError(f"PromptMgpuTiles.block_k={tiles.block_k} must be 64 or 128")
    if tiles.stages < 1:
        raise ValueError(f"PromptMgpuTiles.stages={tiles.stages} must be >= 1")
    need = smem_bytes(tiles, d, interpret=bool(interpret))
    if need > SMEM_BYTES:
        raise ValueError(f"{tiles} at head dim {d} needs {need} bytes of shared memory; a CTA has {SMEM_BYTES} "
                         "(fewer stages or a smaller block_k)")


def prompt_mgpu(q: jax.Array, pool: KVPool, page_table: jax.Array, start: jax.Array, lengths: jax.Array, *,
                scale: float, interpret: bool | plgpu.InterpretGPUParams = False,
                tiles: PromptMgpuTiles | None = None) -> jax.Array:
    """Same contract as `attention.prompt_reference` (see the module docstring for the kernel and its exactness):
    bf16 q over a bf16 or fp8 pool only (ValueError otherwise; fp8 keys enter the kernel as bf16(code x scale),
    `dequantized_keys`). tiles=None: PromptMgpuTiles(). interpret: True, or the
    interpreter's own parameters (e.g. plgpu.InterpretGPUParams(detect_races=True)).

    q [S, T, Hq, D]; page_table [S, Pmax]; start [S] absolute position of row 0; lengths [S] real rows
    -> o [S, T, Hq, D] (rows past lengths: zeros)
    """
    tiles = tiles or PromptMgpuTiles()
    _check(q, pool, page_table, start, lengths, tiles, interpret)
    return _prompt(q, pool, page_table, start.astype(jnp.int32), lengths.astype(jnp.int32), scale=scale,
                   tiles=tiles, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("scale", "tiles", "interpret"))
def _prompt(q: jax.Array, pool: KVPool, page_table: jax.Array, start: jax.Array, lengths: jax.Array, *,
            scale: float, tiles: PromptMgpuTiles, interpret: bool | plgpu.InterpretGPUParams) -> jax.Array:
    # One program around the kernel (as qmm_mgpu: eager dispatches beside an interpreted kernel can deadlock).
    s, t, hq, _ = q.shape
    tp = -(-t // tiles.block_q) * tiles.block_q
    if tp != t:
        q = jnp.pad(q, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
    max_keys = page_table.shape[1] * pool.page_size
    page_table = _pad_table(page_table, -(-max_keys // tiles.block_k) * tiles.block_k, pool.page_size)
    with jax.named_scope("attn_prompt_gather"):
        k, v = dequantized_keys(pool, page_table)
    static = dict(scale=scale, max_keys=max_keys, group=hq // pool.k.shape[0], tiles=tiles)
    with jax.named_scope("attn_prompt_mgpu"):
        if interpret:
            out = _kernel_call(start, lengths, q, k, v, interpret=interpret, **static)
        else:
            (out,) = _PROMPT(start, lengths, q, k, v, **static)
    return out[:, :t]


def dequantized_keys(pool: KVPool, page_table: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each stream's pages copied into bf16 rows k, v [Hkv, S, L, D] (L = Pmax*page): a bf16 pool's values as
    stored; an fp8 pool's as bf16(code x scale), the code widened to fp32, times its key's fp32 scale, rounded once
    to nearest even (the values `attention_window_mgpu` dequantizes to). One fused gather: it reads a key's byte
    codes and scale and writes 2 bytes, where the bf16 pool's copy reads 2 and writes 2."""
    k, v, *scales = _contiguous_keys(pool, page_table)
    if not pool.fp8:
        return k, v
    return tuple(dequantize_reference(x, sc).astype(jnp.bfloat16) for x, sc in zip((k, v), scales))


# Lowered once a process per shapes and static parameters (`mgpu_lowering`): 16 attention layers a prompt program.
_PROMPT = CachedKernel("attn_prompt_mgpu", _kernel_call,
                       lambda _, __, q, *___, **____: [jax.core.ShapedArray(q.shape, q.dtype)])
