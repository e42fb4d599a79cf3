"""Group-quantized matmul (MLX affine, 4/8-bit): y[M, N] = x[M, K] @ dequantize(w)[N, K]^T.

Letters: m rows of x (tokens), n output features, k input features, g groups along k, c packed uint32 words,
j field position inside a word. `reference()` is the plain-jnp definition every kernel here must match; it
dequantizes the whole weight (fine for tests and tiny models, slow at the 27B's shapes).

How the kernel works (Pallas, Triton lowering; docs/kernels/qmm.md has the measurements behind each choice):
- K is cut into blocks of `block` columns (fixed by K and bits alone, see `block_cols`). Inside a block, the
  weight words are read once, 16 bytes at a time, and split into "field pairs": fields j and j + per/2 of a word
  sit 16 bits apart, so one shift, one AND with 0x000F000F and one OR with 0x43004300 turn them into two bf16
  numbers 128 + q (the bf16 mantissa has 7 bits; no int->float conversion). Field pair j of all the block's words
  is one "chunk" of 2 * words columns, an MMA operand built in registers: w = (q' - 128) * scale + bias, one
  bf16 FMA for two weights, rounded once from the exact dequantized value -- as designed, and as pip Triton
  compiles it; on the H200, compiled by XLA, 38 % of the weights came out 1-2 ulp off that value (q * scale
  rounded before the bias, 2026-11-30). `Tiles.fma_ptx` writes the two steps as PTX bf16x2 FMAs so no compiler
  can split them: on the H200 it gives the single rounding (gpu tests, session 5) and a 5.9 % faster decode
  round, so it is on in the shipped tiles.
- Chunk column 2c + t is (word c, field j + t * per/2): the weight is used exactly as the checkpoint stores it
  (no load-time repack). x must meet it in that "chunk order": it is permuted per call (an XLA transpose that
  fuses into x's producer when that is an XLA fusion). Decode tiles can instead (`Tiles.x_natural`) read x in
  its natural order with two strided loads a chunk (columns j and j + per/2 of every word's span, stride per)
  joined in registers, so no transpose runs between a Pallas producer (a norm) and the matmul; measured slower
  on the H200 (the strided loads cost more than the transposes), so off by default.
- The decode tiles read the scales and biases as uint32 words of two adjacent groups (`Tiles.scale_words`, a free
  view; split in registers), which the cp.async pipeline carries with the weight words; as 2-byte loads they were
  plain global loads (prefetched a step ahead: `Tiles.prefetch`, now off), and on the device the wgmma fences were
  the most stalled instructions, on the long scoreboard, which we read as waiting for them. Each
  field pair's mask-and-OR is one inline-PTX lop3 (`Tiles.lop3`; the compiler emits two instructions).
- The MMA runs weight-major (w [block_n, chunk] @ x^T [chunk, block_m], Hopper wgmma when block_n >= 64), fp32
  accumulation, one chunk after another in increasing k.
- Split-K (`Tiles.k_splits` = S > 1, for decode shapes with too few n tiles to fill the GPU): a third grid axis
  cuts K into S contiguous ranges of whole loop steps; each program writes an fp32 partial [S, M, N], and the
  wrapper adds the partials in a fixed sequence ((p0 + p1) + p2 ...) before the cast.

Prompt path, second implementation (`Tiles.impl == "dequant"`, chosen by `prompt_tiles`; `PROMPT_IMPL` is the
default): the whole weight is dequantized to the MMA dtype in memory, with the values the fused kernel builds
(4-bit with bf16 x and scales: the Pallas pass `dequant_pass`; otherwise one XLA fusion, `dequantize_for_matmul`;
the two give the same bits), then a plain Pallas (Triton) matmul x [bm, bk] @ w^T [bk, bn] with
fp32 accumulation, K in increasing blocks of `block_k`, one output tile a program, a 1-D grid walked in groups of
`group_m` row tiles (row tile fastest) so consecutive programs share the weight tile.

Exactness (STYLE.md): the k order (blocks, then chunks, each one MMA of fixed shape) and every tile shape are fixed
by the weight's shape and the path (`prompt`) alone. A row of x is always computed in a `block_m`-row MMA tile of
one shape, whatever M is and whichever rows share the call, so row i's bits never depend on M or on the other
rows. M is padded inside (masked loads and stores). With split-K, each element's partials and their summation
order are fixed by the same shape-only tiles.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import qmm_mgpu, replace_fields
from pallas_kernels.calls import pallas_call
from pallas_kernels.qweight import (QuantizedWeight, add_rounded_once_to_bf16, dequantize, dequantize_rows,
                                    natural_words, to_lane_words, unpack)

# Two bf16 128.0s: OR-ing a 4-bit field q into the low mantissa bits of one gives the bf16 number 128 + q exactly.
_BF16_128_PAIR = 0x43004300
_MAX_BLOCK = 256


def _min_block(bits: int) -> int:
    """Smallest block whose chunks have the 16 columns an MMA needs (chunk = block * 2 / fields per word)."""
    return 16 * (32 // bits) // 2


def block_cols(k: int, bits: int) -> int:
    """The k block of a weight: the largest power of two <= 256 dividing K, at least `_min_block(bits)`.

    K not divisible by the minimum (only a 32-group 4-bit weight with K an odd multiple of 32) is zero-padded.
    """
    block = _MAX_BLOCK
    while block > _min_block(bits) and k % block:
        block //= 2
    return block


def _padded_k(k: int, bits: int) -> int:
    step = _min_block(bits)
    return -(-k // step) * step


# ---------------------------------------------------------------------------------------------------------------
# layouts


def _to_kernel_order(x: jax.Array, block: int, bits: int) -> jax.Array:
    """x [M, K] in natural order -> chunk order: block b's position j * chunk + 2c + t holds natural column
    b * block + c * per + t * per/2 + j (word c, field j + t * per/2 of the weight)."""
    per = 32 // bits
    m, k = x.shape
    words = block * bits // 32
    x = x.reshape(m, k // block, words, 2, per // 2)  # natural column = blk * block + c * per + t * half + j
    return jnp.transpose(x, (0, 1, 4, 2, 3)).reshape(m, k)  # -> (blk, j, c, t)


def _pad_weight(w: QuantizedWeight) -> QuantizedWeight:
    """w for the Triton kernels: natural field order (lane-ordered words are restored: a whole-weight pass, so
    decode_layout lays out only weights whose decode calls go to the Mosaic GPU kernel), K padded to the block."""
    if w.lanes:
        w = QuantizedWeight(natural_words(w), w.scales, w.biases, w.bits, w.group_size)
    n, k = w.shape
    kp = _padded_k(k, w.bits)
    if kp == k:
        return w
    # Zero words, scales and biases: the padded columns dequantize to exactly 0.
    wpad = kp * w.bits // 32 - w.words.shape[1]
    gpad = kp // w.group_size - w.scales.shape[1]
    return QuantizedWeight(jnp.pad(w.words, ((0, 0), (0, wpad))), jnp.pad(w.scales, ((0, 0), (0, gpad))),
                           jnp.pad(w.biases, ((0, 0), (0, gpad))), w.bits, w.group_size)


def _validate(x: jax.Array, w: QuantizedWeight) -> None:
    if not isinstance(w, QuantizedWeight):
        raise ValueError(f"qmm: weight must be a QuantizedWeight, got {type(w).__name__}")
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


# ---------------------------------------------------------------------------------------------------------------
# tiles


@dataclasses.dataclass(frozen=True)
class Tiles:
    """One kernel configuration. Part of the numerics: a path must pick it from the weight's shape alone."""
    block_m: int  # rows of x per MMA tile (power of 2, >= 8)
    block_n: int  # output features per program (power of 2, >= 16)
    blocks_per_step: int = 1  # k blocks per loop step (power of 2)
    num_warps: int = 4
    num_stages: int = 3
    max_m_blocks: int = 1  # block_m-row tiles one program carries, so one weight chunk serves up to this many
    k_splits: int = 1  # contiguous K ranges on a third grid axis, fp32 partials summed in a fixed order after
    # "fused": the kernel above, dequantizing inside the MMA loop. "dequant": the whole weight dequantized by XLA,
    # then the plain matmul kernel (blocks_per_step and max_m_blocks do not apply; block_k, group_m and k_splits
    # do: K cut into k_splits contiguous ranges of whole block_k steps, fp32 partials summed in order after).
    impl: str = "fused"
    block_k: int = 64  # "dequant": k columns a loop step (must divide K; `prompt_tiles` fits it)
    group_m: int = 8  # "dequant": row tiles walked together, row tile fastest, before the next weight tiles
    # "fused": read x in natural order with strided loads (True) or from an XLA-permuted copy (False); the same
    # values meet the same MMA either way, so the bits do not change.
    x_natural: bool = False
    # "fused": load the next loop step's scales and biases during this one (carried in registers) instead of at
    # the start of the step that uses them. Same values, same arithmetic: the bits do not change.
    prefetch: bool = False
    # "fused", compiled (not interpret mode): mask and OR of a field pair in one inline-PTX lop3 (same bits).
    lop3: bool = False
    # "fused", compiled, 4-bit bf16: the dequantizing subtract and FMA as inline-PTX bf16x2 FMAs (one rounding
    # guaranteed; see `_weight_chunk`). On in the shipped tiles since session 5 (see `DECODE_TILES`).
    fma_ptx: bool = False
    # "fused", 16-bit scales and biases: read them as uint32 words of two adjacent groups (a free view made per
    # call) and split them in registers. 4-byte elements can ride the cp.async pipeline with the weight words;
    # 2-byte loads stay plain global loads, which the device profile (session 10) suggests every step waits for.
    # Same values: the bits do not change.
    scale_words: bool = False

    def check(self) -> None:
        if self.impl not in IMPLS:
            raise ValueError(f"qmm tiles: impl={self.impl!r} must be one of {IMPLS}")
        for name, least in (("block_m", 8), ("block_n", 16), ("block_k", 16)):
            v = getattr(self, name)
            if v < least or v & (v - 1):
                raise ValueError(f"qmm tiles: {name}={v} must be a power of two >= {least}")
        for name in ("blocks_per_step", "max_m_blocks", "num_warps", "num_stages", "k_splits", "group_m"):
            if getattr(self, name) < 1:
                raise ValueError(f"qmm tiles: {name} must be >= 1")


IMPLS = ("fused", "dequant")


def replace_tiles(tiles: Tiles, spec: str) -> Tiles:
    """`tiles` with the fields named in spec "field=value,..." replaced (benchmarks' A/B switches; booleans as 0/1,
    impl by name). Unknown fields and values that do not parse are a ValueError naming them."""
    out = replace_fields(tiles, spec, "qmm tiles")
    out.check()
    return out


# The decode/verify tiles, in one place: `decode_tiles` fits them to a weight's K and picks the K splits. 64 output
# features a program on one warpgroup (wgmma, weights as the register operand), one k block a loop step, 3 pipeline
# stages; a program carries two 16-row tiles, so M = 32 reads each weight tile once from HBM. Measured on the H200
# (docs/kernels/qmm.md, BENCHMARKS.md): the split-K sweep of session 2 chose the shape; on 2026-11-30 (session 4)
# the whole 27B decode round ran 13.81 ms with the switches off, 13.39 with `prefetch`, 13.34 with `prefetch` and
# `lop3`, 14.26 with those and 4 stages (one run, same machine; runs on other days differed by ~5 %), so both
# switches are on. `x_natural` stays off: the same probe put the round at 14.24 ms with it against 13.14 without
# (the strided 2-byte x loads cannot use cp.async and cost more inside the kernel than the transposes they save).
# `fma_ptx` (session 5, one device run): the round 13.43 -> 12.64 ms, isolated decode kernels 1.05-1.24x, and the
# weights now get the single rounding the design specifies (without it XLA's build rounded q * s first).
# `scale_words` with `prefetch` off (session 10): Nsight Compute's stall samples put the kernel's largest stalls
# at the wgmma fences, on the long scoreboard (read as waiting for the prefetched 2-byte scale loads), and the
# scales went through shared memory once more to change layout; as uint32 words they ride the cp.async stages and
# the round trip goes (offline SASS).
# One device run: the whole decode round 12.25 -> 11.83 ms device-bound, 12.39 -> 11.89 pipelined; isolated
# kernels 1.02-1.22x at M = 1, 0.97-1.06x at M = 16; bits unchanged (gpu test at the 27B's MLP shapes).
DECODE_TILES = Tiles(block_m=16, block_n=64, blocks_per_step=1, num_warps=4, num_stages=3, max_m_blocks=2,
                     k_splits=1, x_natural=False, prefetch=False, lop3=True, fma_ptx=True, scale_words=True)
# Programs a decode launch should have at least (132 SMs; the H200 sweep of docs/kernels/qmm.md run 3: the best
# split counts gave 640-2720 programs, the unsplit default 160-544).
DECODE_MIN_PROGRAMS = 600


def decode_tiles(n: int, k: int, bits: int, group: int) -> Tiles:
    """Decode/verify (memory-bound) tiles, from the weight's shape only: `DECODE_TILES` with the fewest K
    splits (a divisor of K's block count) that give `DECODE_MIN_PROGRAMS` programs over N."""
    tiles = fit_tiles(DECODE_TILES, k, bits)
    kp = _padded_k(k, bits)
    blocks = kp // (block_cols(kp, bits) * tiles.blocks_per_step)
    n_tiles = -(-n // tiles.block_n)
    splits = next((s for s in range(1, blocks + 1) if blocks % s == 0 and n_tiles * s >= DECODE_MIN_PROGRAMS),
                  blocks)
    return dataclasses.replace(tiles, k_splits=splits)


def fit_tiles(tiles: Tiles, k: int, bits: int) -> Tiles:
    """`tiles` with blocks_per_step halved, then k_splits lowered, until they cut K's blocks evenly (a function of
    K and bits alone, so still a shape-only choice)."""
    blocks = _padded_k(k, bits) // block_cols(_padded_k(k, bits), bits)
    steps, splits = tiles.blocks_per_step, tiles.k_splits
    while steps > 1 and blocks % steps:
        steps //= 2
    while splits > 1 and blocks % (steps * splits):
        splits -= 1
    return dataclasses.replace(tiles, blocks_per_step=steps, k_splits=splits)


# The decode path's implementation: "triton" (the fused kernel above, `DECODE_TILES`), "mgpu" (the Mosaic GPU
# kernel of `qmm_mgpu.py`, for the calls it supports; the others stay on Triton), or "auto" (the default): "mgpu"
# when the program runs on a GPU and not in interpret mode, "triton" otherwise (`decode_impl`). Read when a
# program is traced; `bench --qmm-decode-impl` switches it for a whole engine run. The two kernels differ in the
# last bits, so one process uses one of them for every decode and verify call. Default since session 11: in one
# H200 run the engine decoded 86.6 forwards/s with "mgpu" against 83.0 with "triton" (1 stream; 72.6 vs 70.2 at 16
# streams), and the engine's exactness gates passed with it (BENCHMARKS.md, session 11).
DECODE_IMPL = "auto"
DECODE_IMPLS = ("auto", "triton", "mgpu")


def decode_impl(interpret: bool = False) -> str:
    """The decode implementation a call traced now uses: DECODE_IMPL, with "auto" resolved."""
    if DECODE_IMPL not in DECODE_IMPLS:
        raise ValueError(f"qmm: decode impl {DECODE_IMPL!r} is not one of {DECODE_IMPLS}")
    if DECODE_IMPL == "auto":
        return "mgpu" if not interpret and jax.default_backend() == "gpu" else "triton"
    return DECODE_IMPL


def decode_on_mgpu(x, w, interpret: bool = False) -> bool:
    """Whether a decode call of x [M, K] (an array or a ShapeDtypeStruct) by w goes to the Mosaic GPU kernel: the
    decode implementation is "mgpu" and the kernel takes the call (`qmm_mgpu.supports`)."""
    return decode_impl(interpret) == "mgpu" and isinstance(w, QuantizedWeight) and qmm_mgpu.supports(x, w)

# The prompt path's implementation: "fused" (dequantize inside the MMA loop) or "dequant" (a pass dequantizes the
# weight to bf16 in memory, then `DEQUANT_PROMPT_TILES`' matmul). H200, session 5 (`bench qmm --sweep
# --prompt-only`, XLA's pass then): dequant 403 / 1199 us at 5120->17408, M = 1024 / 4096, against the fused
# kernel's 683 / 2795 (1.7x / 2.3x), 502 / 1212 against 756 / 2697 at 17408->5120; the 27B's 4096-token prompt
# pass 9143 tok/s against 4692 (`bench --qmm-prompt-impl`), 9707 with the Pallas pass. So "dequant" is the default.
PROMPT_IMPL = "dequant"
FUSED_PROMPT_TILES = Tiles(block_m=128, block_n=128, blocks_per_step=1, num_warps=8, num_stages=3, max_m_blocks=1,
                           fma_ptx=True)
# Triton's usual Hopper bf16 GEMM tile (two warpgroups, each 64 rows x 256 columns of wgmma, 147 KB of shared
# memory at 3 stages: one program a SM). The session 5 sweep timed it against 4 neighbours: the fastest or within
# 4 % of the fastest at both MLP shapes and M = 1024 / 4096 (128x128 tiles: 9 % faster at 17408->5120, M = 1024,
# 20 % slower at M = 4096).
DEQUANT_PROMPT_TILES = Tiles(block_m=128, block_n=256, num_warps=8, num_stages=3, impl="dequant", block_k=64,
                             group_m=8)


def prompt_tiles(n: int, k: int, bits: int, group: int, impl: str | None = None) -> Tiles:
    """Prompt (compute-bound) tiles from the weight's shape only (never from M).

    "fused": a 128x128 output tile per program (two warpgroups), weight tiles reused from L2 by the programs of
    consecutive row blocks; 3 stages at 4 bits (225-226 KB of shared memory), 2 at 8 bits, whose 256-column block
    has twice the words: 3 stages asked 263 KB and failed to launch on the H200 (227 KB a block), 2 take 161-162
    KB (offline compile for sm_90). "dequant": `DEQUANT_PROMPT_TILES` fitted to the shape (`fit_dequant_tiles`).
    impl: None for `PROMPT_IMPL`.
    """
    impl = PROMPT_IMPL if impl is None else impl
    if impl == "fused":
        return FUSED_PROMPT_TILES if bits == 4 else dataclasses.replace(FUSED_PROMPT_TILES, num_stages=2)
    if impl == "dequant":
        return fit_dequant_tiles(DEQUANT_PROMPT_TILES, n, k)
    raise ValueError(f"qmm: prompt impl {impl!r} is not one of {IMPLS}")


def fit_dequant_tiles(tiles: Tiles, n: int, k: int) -> Tiles:
    """`tiles` with block_k halved until it divides K (K is a multiple of the group, so 32 always does), block_n
    no wider than the power of two covering N, and k_splits lowered until the splits cut K into whole block_k
    steps (a function of N and K alone)."""
    bk, bn, splits = tiles.block_k, tiles.block_n, tiles.k_splits
    while bk > 16 and k % bk:
        bk //= 2
    while bn > 16 and bn // 2 >= n:
        bn //= 2
    while splits > 1 and (k // bk) % splits:
        splits -= 1
    return dataclasses.replace(tiles, block_k=bk, block_n=bn, k_splits=splits)


# ---------------------------------------------------------------------------------------------------------------
# kernel


def _weight_chunk(words, j: int, bits: int, s, b, w_dtype, bf16_fma: bool, lop3: bool = False,
                  fma_ptx: bool = False):
    """words uint32 [bn, c] -> the chunk's dequantized weights [bn, 2c]: fields j and j + per/2 of each word.
    lop3: build the bf16 pair with one inline PTX lop3 (compiled kernels only; the same bits as the jnp ops).
    fma_ptx: the dequantizing subtract and FMA as inline PTX (compiled only; see `Tiles.fma_ptx`)."""
    bn, c = words.shape
    shifted = words >> jnp.uint32(j * bits) if j else words
    # Fields j and j + half sit 16 bits apart: one AND (and for bf16 one OR of the 128.0 pattern) builds both
    # halves of the MMA operand's 32-bit register.
    field = (1 << bits) - 1
    if bf16_fma and lop3:
        # (w & 0x000F000F) | 0x43004300 as one instruction (lookup table 0xEA = (a & b) | c); the compiler emits
        # the AND and the OR separately when both masks are constants.
        pair, = plt.elementwise_inline_asm(
            f"lop3.b32 $0, $1, {field | field << 16:#010x}, {_BF16_128_PAIR:#010x}, 0xEA;",
            args=[jax.lax.bitcast_convert_type(shifted, jnp.int32)], constraints="=r,r", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(shifted.shape, jnp.int32)])
        pair = jax.lax.bitcast_convert_type(pair, jnp.uint32)
    else:
        pair = shifted & jnp.uint32(field | field << 16)
        if bf16_fma:
            pair = pair | jnp.uint32(_BF16_128_PAIR)
    halves = [(pair & jnp.uint32(0xFFFF)).astype(jnp.uint16), (pair >> jnp.uint32(16)).astype(jnp.uint16)]
    fields = jnp.stack(halves, axis=-1).reshape(bn, 2 * c)  # Triton `join`: both halves stay in one thread
    if bf16_fma:
        q = jax.lax.bitcast_convert_type(fields, jnp.bfloat16)  # 128 + q, exact
        if fma_ptx:
            # The same two steps as PTX bf16x2 FMAs, so no compiler can round q * s before adding b: 1 * q' - 128
            # (exact), then q * s + b rounded once.
            w, = plt.elementwise_inline_asm(
                "{ .reg .b32 t, one, m128; mov.b32 one, 0x3F803F80; mov.b32 m128, 0xC300C300;"
                " fma.rn.bf16x2 t, $1, one, m128; fma.rn.bf16x2 $0, t, $2, $3; }",
                args=[q, s, b], constraints="=r,r,r,r", pack=2,
                result_shape_dtypes=[jax.ShapeDtypeStruct(q.shape, jnp.bfloat16)])
            return w
        return (q - jnp.bfloat16(128)) * s + b  # exact q, one bf16 FMA: the dequantized value rounded once
    q = fields.astype(jnp.int32).astype(jnp.float32)
    return (q * s.astype(jnp.float32) + b.astype(jnp.float32)).astype(w_dtype)


def _qmm_kernel(x_ref, w_ref, s_ref, b_ref, *out_refs, m: int, n: int, kp: int, bits: int, group: int,
                block: int, tiles: Tiles, m_blocks: int, w_dtype, bf16_fma: bool, precision, interpret: bool,
                scale_dtype=None):
    # x_ref [M, Kp] in chunk order (natural order with tiles.x_natural); w_ref uint32 [N, Kp*bits/32]; s_ref,
    # b_ref [N, Kp/g]; o_ref [M, N], or the fp32 partials [S, M, N] with split-K (preceded by the unread `after`
    # operand and by the aliased input buffer when the caller poisons it).
    o_ref = out_refs[-1]
    # Grid (row super-block, n tile[, k split]): each program owns rows [pid_m * m_blocks * block_m, ...) x one n
    # tile x (with split-K) one contiguous range of K's loop steps.
    bm, bn = tiles.block_m, tiles.block_n
    per = 32 // bits
    half = per // 2
    words_per_block = block * bits // 32
    chunk = 2 * words_per_block  # columns per chunk
    # Chunk column 2c + t is natural column c * per + t * half + j, in group c // (group / per): every chunk meets
    # every group of its block (or the one group holding the block) in runs of 2 * group / per, so one broadcast
    # of the block's scales serves all its chunks.
    block_groups = max(1, block // group)
    run = chunk // block_groups
    pid_m, pid_n = pl.program_id(0), pl.program_id(1)
    n0 = pl.multiple_of(pid_n * bn, bn)
    nsl = pl.ds(n0, bn)
    cols = n0 + jnp.arange(bn, dtype=jnp.int32)
    n_ragged = n % bn != 0
    row0 = pid_m * (m_blocks * bm)
    row_ok = [(row0 + mb * bm + jnp.arange(bm, dtype=jnp.int32)) < m for mb in range(m_blocks)]
    row_idx = [pl.ds(row0 + mb * bm, bm) for mb in range(m_blocks)]

    def load_n_rows(ref, idx, width):
        if not n_ragged:
            return ref[idx]
        return plt.load(ref.at[idx], mask=jnp.broadcast_to((cols < n)[:, None], (bn, width)), other=0)

    steps = kp // (block * tiles.blocks_per_step * tiles.k_splits)  # loop steps a program
    step0 = pl.program_id(2) * steps if tiles.k_splits > 1 else 0

    def load_scales(it):
        """The scales and biases of loop step `it`'s blocks: [(s, b)] each [bn, block_groups]."""
        out = []
        for blk in range(tiles.blocks_per_step):
            g0 = ((step0 + it) * tiles.blocks_per_step + blk) * block // group
            if scale_dtype is None:
                gsl = pl.ds(g0, block_groups)
                out.append((load_n_rows(s_ref, (nsl, gsl), block_groups),
                            load_n_rows(b_ref, (nsl, gsl), block_groups)))
            else:  # uint32 words of group pairs (`Tiles.scale_words`)
                gsl = pl.ds(g0 // 2, block_groups // 2)
                out.append(tuple(_split_scale_words(load_n_rows(ref, (nsl, gsl), block_groups // 2), scale_dtype)
                                 for ref in (s_ref, b_ref)))
        return out

    def step(it, carry):
        accs, scales = list(carry[0]), carry[1]
        if tiles.prefetch:
            # Next step's scales now (the last step re-reads its own): the loads' latency overlaps this step's
            # dequantization and MMAs instead of stalling its start (they are 2-byte loads, too narrow for the
            # cp.async pipeline that carries the words and x).
            nxt = load_scales(jnp.minimum(it + 1, steps - 1))
        else:
            scales = load_scales(it)
        for blk in range(tiles.blocks_per_step):
            kb = (step0 + it) * tiles.blocks_per_step + blk
            words = load_n_rows(w_ref, (nsl, pl.ds(pl.multiple_of(kb * words_per_block, words_per_block),
                                                   words_per_block)), words_per_block)
            s, b = scales[blk]
            s = jnp.broadcast_to(s[:, :, None], (bn, block_groups, run)).reshape(bn, chunk)
            b = jnp.broadcast_to(b[:, :, None], (bn, block_groups, run)).reshape(bn, chunk)
            for j in range(half):
                col0 = kb * block + j * chunk
                wt = _weight_chunk(words, j, bits, s, b, w_dtype, bf16_fma,
                                   lop3=tiles.lop3 and not interpret,
                                   fma_ptx=tiles.fma_ptx and not interpret)  # [bn, chunk]
                xcols = pl.ds(pl.multiple_of(col0, chunk), chunk)
                for mb in range(m_blocks):
                    if tiles.x_natural:
                        xc = _natural_x_chunk(x_ref, row_idx[mb], row_ok[mb], kb * block, j, words_per_block,
                                              per, interpret)
                    else:
                        xmask = jnp.broadcast_to(row_ok[mb][:, None], (bm, chunk))
                        xc = plt.load(x_ref.at[row_idx[mb], xcols], mask=xmask, other=0)
                    xc = xc.astype(w_dtype)
                    # dot first: Triton folds `dot + acc` (not `acc + dot`) into the MMA's accumulator.
                    accs[mb] = jax.lax.dot_general(
                        wt, xc, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) + accs[mb]
        return tuple(accs), (nxt if tiles.prefetch else ())

    zeros = tuple(jnp.zeros((bn, bm), jnp.float32) for _ in range(m_blocks))
    accs, _ = jax.lax.fori_loop(0, steps, step, (zeros, load_scales(0) if tiles.prefetch else ()))
    for mb in range(m_blocks):
        mask = row_ok[mb][:, None] & (cols < n)[None, :]
        dst = o_ref.at[pl.program_id(2), row_idx[mb], nsl] if tiles.k_splits > 1 else o_ref.at[row_idx[mb], nsl]
        plt.store(dst, accs[mb].T.astype(o_ref.dtype), mask=mask)


def _split_scale_words(w, dtype):
    """uint32 [bn, c] words of two 16-bit values (the lower group in the low half) -> [bn, 2c] dtype."""
    halves = [(w & jnp.uint32(0xFFFF)).astype(jnp.uint16), (w >> jnp.uint32(16)).astype(jnp.uint16)]
    return jax.lax.bitcast_convert_type(jnp.stack(halves, axis=-1).reshape(w.shape[0], 2 * w.shape[1]), dtype)


def _as_scale_words(a: jax.Array) -> jax.Array:
    """[N, G] 16-bit -> uint32 [N, G / 2], two adjacent groups a word (a view of the same bytes)."""
    n, g = a.shape
    return jax.lax.bitcast_convert_type(a.reshape(n, g // 2, 2), jnp.uint32)


def _natural_x_chunk(x_ref, rows, row_ok, col0, j: int, words: int, per: int, interpret: bool):
    """Chunk j of the k block starting at natural column col0, from x in natural order: chunk column 2c + t is
    natural column col0 + t * per/2 + j + c * per. Two strided loads (t = 0, 1), joined so both stay in one
    thread as `_weight_chunk` joins the weight's field pairs. Interpret mode has no strided loads: it reads the
    block's span and takes the same columns by index. -> [bm, 2 * words]"""
    bm = row_ok.shape[0]
    starts = [t * (per // 2) + j for t in (0, 1)]
    if interpret:
        span = plt.load(x_ref.at[rows, pl.ds(col0, words * per)],
                        mask=jnp.broadcast_to(row_ok[:, None], (bm, words * per)), other=0)
        halves = [jnp.take(span, st + per * jnp.arange(words), axis=1) for st in starts]
    else:
        mask = jnp.broadcast_to(row_ok[:, None], (bm, words))
        halves = [plt.load(x_ref.at[rows, pl.ds(col0 + st, words, stride=per)], mask=mask, other=0)
                  for st in starts]
    return jnp.stack(halves, axis=-1).reshape(bm, 2 * words)


def _arith(x_dtype, scale_dtype, bits: int):
    """(MMA operand dtype, dot precision, whether the bf16 bit trick + bf16 FMA builds the weights)."""
    if x_dtype == jnp.float32:
        # The verification path: fp32 weights and full fp32 products (IEEE FMA, not tf32).
        return jnp.float32, jax.lax.Precision.HIGHEST, False
    bf16_fma = x_dtype == jnp.bfloat16 and scale_dtype == jnp.bfloat16 and bits == 4
    return x_dtype, None, bf16_fma


def _qmm_call(xk: jax.Array, words, scales, biases, n: int, bits: int, group: int, out_dtype, tiles: Tiles,
              interpret: bool, poison: bool = False, after: jax.Array | None = None) -> jax.Array:
    """The kernel on x (in chunk order unless tiles.x_natural) -> y [M, N] out_dtype (split-K partials summed
    here). poison: the kernel writes into a NaN-filled buffer, so an element it never writes shows up (tests).
    after: an operand the kernel never reads, so the call runs after whatever produced it (the benchmark chains
    calls through it)."""
    m, kp = xk.shape
    block = block_cols(kp, bits)
    if kp % (block * tiles.blocks_per_step * tiles.k_splits):
        raise ValueError(f"qmm tiles: blocks_per_step={tiles.blocks_per_step} x k_splits={tiles.k_splits} does not "
                         f"divide K={kp} into whole blocks of {block} (qmm.fit_tiles picks ones that do)")
    m_blocks = min(tiles.max_m_blocks, pl.cdiv(m, tiles.block_m))
    grid = (pl.cdiv(m, m_blocks * tiles.block_m), pl.cdiv(n, tiles.block_n))
    split = tiles.k_splits > 1
    if split:
        grid += (tiles.k_splits,)
    out_shape = jax.ShapeDtypeStruct((tiles.k_splits, m, n) if split else (m, n),
                                     jnp.float32 if split else out_dtype)
    w_dtype, precision, bf16_fma = _arith(xk.dtype, scales.dtype, bits)
    block_groups = max(1, block // group)
    scale_dtype = None
    if tiles.scale_words and scales.dtype.itemsize == 2 and block_groups % 2 == 0 and scales.shape[1] % 2 == 0:
        scale_dtype = scales.dtype
        scales, biases = _as_scale_words(scales), _as_scale_words(biases)
    # A fresh partial per call: jax#40847 reuses a stale jaxpr when one kernel function meets several grids.
    kernel = functools.partial(_qmm_kernel, m=m, n=n, kp=kp, bits=bits, group=group, block=block, tiles=tiles,
                               m_blocks=m_blocks, w_dtype=w_dtype, bf16_fma=bf16_fma, precision=precision,
                               interpret=bool(interpret), scale_dtype=scale_dtype)
    operands = (xk, words, scales, biases) + (() if after is None else (after,))
    if poison:
        operands += (jnp.full(out_shape.shape, jnp.nan, out_shape.dtype),)
    y = pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        compiler_params=plt.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        input_output_aliases={len(operands) - 1: 0} if poison else {},
        interpret=interpret,
        name=f"qmm_{bits}b_g{group}" + (f"_split{tiles.k_splits}" if split else ""),
    )(*operands)
    return _sum_splits(y, out_dtype) if split else y


def _sum_splits(y: jax.Array, out_dtype) -> jax.Array:
    """Split-K partials [S, M, N] fp32 -> [M, N] out_dtype."""
    with jax.named_scope("qmm_split_sum"):
        # One fixed sequence of plain adds for every element (no tree reduction whose order XLA may choose).
        total = y[0]
        for s in range(1, y.shape[0]):
            total = total + y[s]
        return total.astype(out_dtype)


# ---------------------------------------------------------------------------------------------------------------
# the "dequant" implementation: the whole weight dequantized by XLA, then a plain matmul kernel


def dequantize_for_matmul(w: QuantizedWeight, x_dtype) -> jax.Array:
    """The whole weight [N, K] in the MMA operand dtype for an x of `x_dtype`: one XLA elementwise fusion on the
    packed words, with the values the fused kernel's dequantization gives on the GPU.

    - bf16 x, bf16 scales, 4 bits: q * s + b rounded once to bf16 (the fused kernel's single bf16 FMA). In interpret
      mode the fused kernel rounds q * s to bf16 first, so there the two implementations differ in the last bit.
    - other half-precision cases: q * s + b in fp32 (q * s exact for bf16/fp16 scales), then one convert: the
      fused kernel's own formula, double rounding included.
    - fp32 x: fp32 q * s + b (the verification path). With fp32 scales q * s is inexact and whether the GPU
      contracts it into an FMA is the compiler's choice in both implementations.
    """
    w_dtype, _, bf16_fma = _arith(x_dtype, w.scales.dtype, w.bits)
    n, k = w.shape
    q = unpack(natural_words(w), w.bits).astype(jnp.float32).reshape(n, k // w.group_size, w.group_size)
    prod = q * w.scales.astype(jnp.float32)[..., None]
    bias = jnp.broadcast_to(w.biases.astype(jnp.float32)[..., None], prod.shape)
    deq = add_rounded_once_to_bf16(prod, bias) if bf16_fma else (prod + bias).astype(w_dtype)
    return deq.reshape(n, k)


# The dequantization pass as a Pallas kernel (4-bit weights, bf16 scales and x: the 27B's case). XLA's fusion of
# `dequantize_for_matmul` ran at 1.7-2.1 TB/s on the H200 (session 5: 106-135 us for a 50 MB weight whose pass moves
# 228 MB, floor 53 us), and the prompt path runs it once per weight per chunk. The kernel reads 16-byte words,
# builds eight bf16 weights a word in registers with the fused kernel's arithmetic (field pairs by lop3, natural
# order by prmt, then the two bf16x2 FMAs: rounded once, so the same bits as `dequantize_for_matmul`), and stores
# them as uint32 pairs [N, K/2], which the caller bitcasts to bf16 [N, K] (free). Blocks (H200, session 5, the pass
# alone, 64 chained calls): 32 rows x 128 words 62-85 us at 5120->17408 and 74 us at 17408->5120 (XLA: 116-182 and
# 116-119); 8 x 128 (asked as 8 x 256, which both K halve to 128) 58 and 55 us, the fastest of five, so shipped.
DEQUANT_PASS_ROWS = 8  # weight rows a program
DEQUANT_PASS_WORDS = 128  # packed words (1024 columns) a program, halved until it divides K/8


def _dequant_pass_words(c: int, words: int) -> int:
    bc = words
    while c % bc:
        bc //= 2
    return bc


def _bf16_pair(v: jax.Array) -> jax.Array:
    """bf16 [...] -> uint32 [...] holding the value twice (both halves of a bf16x2 operand)."""
    u = jax.lax.bitcast_convert_type(v, jnp.uint16).astype(jnp.uint32)
    return u | (u << jnp.uint32(16))


def _dequant_pass_kernel(w_ref, s_ref, b_ref, o_ref, *, n: int, bn: int, bc: int, words_per_group: int,
                         interpret: bool, lanes: bool = False, halves: bool = False):
    # w_ref uint32 [N, C] (eight 4-bit fields a word); s_ref, b_ref bf16 [N, G]; o_ref uint32 [N, 4C]: word c's
    # weights 2i and 2i + 1 in o[:, 4c + i] (low half first); with halves (lane words in that order: pair i is
    # fields i and i + 4), its pair i.
    rows = pl.ds(pl.program_id(0) * bn, bn)
    row_ok = (pl.program_id(0) * bn + jnp.arange(bn, dtype=jnp.int32)) < n
    words = plt.load(w_ref.at[rows, pl.ds(pl.program_id(1) * bc, bc)],
                     mask=jnp.broadcast_to(row_ok[:, None], (bn, bc)), other=0)
    gb = bc // words_per_group
    gcols = pl.ds(pl.program_id(1) * gb, gb)

    def per_word(ref):  # [bn, gb] -> [bn, bc]: each group's value for each of its words
        v = plt.load(ref.at[rows, gcols], mask=jnp.broadcast_to(row_ok[:, None], (bn, gb)), other=0)
        return jnp.broadcast_to(v[:, :, None], (bn, gb, words_per_group)).reshape(bn, bc)

    s, b = per_word(s_ref), per_word(b_ref)
    if interpret:
        # Same values by jnp (no inline PTX on the CPU): q * s exact in fp32, + b rounded once to bf16.
        def weight(f):
            q = ((words >> jnp.uint32(4 * f)) & jnp.uint32(15)).astype(jnp.int32).astype(jnp.float32)
            w = add_rounded_once_to_bf16(q * s.astype(jnp.float32), b.astype(jnp.float32))
            return jax.lax.bitcast_convert_type(w, jnp.uint16).astype(jnp.uint32)

        ws = [weight(f) for f in range(8)]
        pair = (lambda i: (i, i + 4)) if halves else (lambda i: (2 * i, 2 * i + 1))  # output i's two fields
        outs = [ws[pair(i)[0]] | (ws[pair(i)[1]] << jnp.uint32(16)) for i in range(4)]
    else:
        # Output i = weights (2i, 2i + 1) of each word: p = fields (j, j + 4) and p' = fields (j + 1, j + 5) as
        # bf16 128 + q (lop3, j = 2i mod 4), prmt takes both low halves (i < 2) or both high halves (i >= 2), then
        # 1 * w' - 128 (exact) and w * s + b (rounded once) as bf16x2 FMAs. One asm call an output (the Pallas
        # Triton lowering takes one result an asm); ptxas merges the field pairs the calls share.
        as_i32 = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.int32)
        args = [as_i32(words), as_i32(_bf16_pair(s)), as_i32(_bf16_pair(b))]
        lop = f"0x000F000F, {_BF16_128_PAIR:#010x}, 0xEA;"
        outs = []
        for i in range(4):
            j = 2 * i % 4
            if halves:  # the pair is fields (i, i + 4) already: one lop3
                fields = [f"shr.u32 t, $1, {4 * i};", f"lop3.b32 $0, t, {lop}"] if i else [f"lop3.b32 $0, $1, {lop}"]
            else:
                fields = [*([f"shr.u32 t, $1, {4 * j};", f"lop3.b32 p, t, {lop}"] if j else
                            [f"lop3.b32 p, $1, {lop}"]),
                          f"shr.u32 t, $1, {4 * j + 4};", f"lop3.b32 q, t, {lop}",
                          f"prmt.b32 $0, p, q, {0x5410 if i < 2 else 0x7632:#06x};"]
            asm = ["{ .reg .b32 p, q, t, one, m128;", "mov.b32 one, 0x3F803F80;", "mov.b32 m128, 0xC300C300;",
                   *fields, "fma.rn.bf16x2 $0, $0, one, m128;", "fma.rn.bf16x2 $0, $0, $2, $3; }"]
            out, = plt.elementwise_inline_asm(" ".join(asm), args=args, constraints="=r,r,r,r", pack=1,
                                              result_shape_dtypes=[jax.ShapeDtypeStruct((bn, bc), jnp.int32)])
            outs.append(jax.lax.bitcast_convert_type(out, jnp.uint32))
    # Interleave to natural order: [bn, bc, 2, 2] with element (c, i, o) = outs[2i + o], i.e. outs 0..3 in a row.
    pairs = jnp.stack([jnp.stack([outs[0], outs[2]], axis=-1), jnp.stack([outs[1], outs[3]], axis=-1)], axis=-1)
    if lanes:
        # lane order (`to_lane_words`): byte j of the block's word 8g + 2q + h holds the row's pair 32g + 16h + 4j + q
        pairs = pairs.reshape(bn, bc // 8, 4, 2, 4).transpose(0, 1, 3, 4, 2)
    plt.store(o_ref.at[rows, pl.ds(pl.program_id(1) * 4 * bc, 4 * bc)], pairs.reshape(bn, 4 * bc),
              mask=jnp.broadcast_to(row_ok[:, None], (bn, 4 * bc)))


def _pass_takes(w: QuantizedWeight) -> bool:
    return w.bits == 4 and w.scales.dtype == jnp.bfloat16 and w.biases.dtype == jnp.bfloat16


def dequant_pass(w: QuantizedWeight, *, interpret: bool = False, rows: int = DEQUANT_PASS_ROWS,
                 words: int = DEQUANT_PASS_WORDS, num_warps: int = 4) -> jax.Array:
    """The whole weight [N, K] in bf16 for bf16 x, by the Pallas dequantization kernel: the same bits as
    `dequantize_for_matmul(w, jnp.bfloat16)` (each weight q * s + b rounded once). 4-bit weights with bf16 scales
    and biases only; ValueError otherwise. Lane-ordered words (`w.lanes`) come out in natural order as well. rows /
    words / num_warps: a program's block (benchmarks; elementwise, so they cannot change a bit)."""
    if not _pass_takes(w):
        raise ValueError(f"qmm dequant pass: needs 4-bit weights with bf16 scales and biases, got bits={w.bits}, "
                         f"scales {w.scales.dtype}, biases {w.biases.dtype}")
    n, k = w.shape
    c = w.words.shape[1]
    bc = _dequant_pass_words(c, words)
    bn = rows
    kernel = functools.partial(_dequant_pass_kernel, n=n, bn=bn, bc=bc, words_per_group=w.group_size // 8,
                               interpret=bool(interpret), lanes=w.lanes, halves=w.halves)
    out = pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n, 4 * c), jnp.uint32),
        grid=(pl.cdiv(n, bn), c // bc),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"qmm_dequant_pass_g{w.group_size}",
    )(w.words, w.scales, w.biases)
    return jax.lax.bitcast_convert_type(out, jnp.bfloat16).reshape(n, k)


def _dequantize_weight(w: QuantizedWeight, x_dtype, interpret: bool) -> jax.Array:
    """The dequant implementation's weight: the Pallas pass where it applies (4-bit, bf16 x and scales), else
    XLA's `dequantize_for_matmul`. Same values either way."""
    if x_dtype == jnp.bfloat16 and _pass_takes(w):
        return dequant_pass(w, interpret=interpret)
    return dequantize_for_matmul(w, x_dtype)


def _matmul_kernel(x_ref, w_ref, *out_refs, m: int, n: int, k: int, tiles: Tiles, m_tiles: int, n_tiles: int,
                   precision):
    # x_ref [M, K]; w_ref [N, K] (dequantized, x's dtype); o_ref [M, N] (preceded by the unread `after` operand
    # and by the aliased input buffer when the caller poisons it).
    o_ref = out_refs[-1]
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    # 1-D grid in groups of group_m row tiles: program p of a group takes row tile p % rows, weight tile p // rows,
    # so the (up to) group_m programs that run side by side read one weight tile (from HBM once, then L2), and a
    # wave of the GPU covers group_m row tiles x (programs / group_m) weight tiles. Which program computes a tile
    # depends on M; what a tile computes does not.
    pid = pl.program_id(0)
    split = tiles.k_splits > 1
    steps = k // bk // tiles.k_splits  # block_k steps a program: its split's contiguous range of K
    step0 = pl.program_id(1) * steps if split else 0  # (a Python 0 unsplit: the loop below is as it always was)
    per_group = tiles.group_m * n_tiles
    first_m = (pid // per_group) * tiles.group_m
    rows_here = jnp.minimum(m_tiles - first_m, tiles.group_m)
    local = pid % per_group
    row0 = pl.multiple_of((first_m + local % rows_here) * bm, bm)
    n0 = pl.multiple_of((local // rows_here) * bn, bn)
    row_ok = (row0 + jnp.arange(bm, dtype=jnp.int32)) < m
    col_ok = (n0 + jnp.arange(bn, dtype=jnp.int32)) < n
    rows, cols = pl.ds(row0, bm), pl.ds(n0, bn)

    def step(i, acc):
        kcols = pl.ds(pl.multiple_of(i * bk, bk), bk)
        xt = plt.load(x_ref.at[rows, kcols], mask=jnp.broadcast_to(row_ok[:, None], (bm, bk)), other=0)
        if n % bn:
            wt = plt.load(w_ref.at[cols, kcols], mask=jnp.broadcast_to(col_ok[:, None], (bn, bk)), other=0)
        else:
            wt = w_ref[cols, kcols]
        # x [bm, bk] . w [bn, bk] over k: both operands k-major, as wgmma reads them from shared memory; dot first,
        # so Triton folds the accumulator into the MMA.
        return jax.lax.dot_general(xt, wt, (((1,), (1,)), ((), ())), precision=precision,
                                   preferred_element_type=jnp.float32) + acc

    acc = jax.lax.fori_loop(step0, step0 + steps, step, jnp.zeros((bm, bn), jnp.float32))
    dst = o_ref.at[pl.program_id(1), rows, cols] if split else o_ref.at[rows, cols]
    plt.store(dst, acc.astype(o_ref.dtype), mask=row_ok[:, None] & col_ok[None, :])


def _matmul_call(x: jax.Array, wd: jax.Array, out_dtype, tiles: Tiles, interpret: bool, poison: bool = False,
                 after: jax.Array | None = None) -> jax.Array:
    """x [M, K] @ wd [N, K]^T -> [M, N] out_dtype, fp32 accumulation (wd already dequantized, x's dtype).
    poison / after: as in `_qmm_call`."""
    m, k = x.shape
    n = wd.shape[0]
    assert wd.dtype == x.dtype and wd.shape[1] == k, (wd.shape, wd.dtype, x.shape, x.dtype)
    if k % (tiles.block_k * tiles.k_splits):
        raise ValueError(f"qmm tiles: block_k={tiles.block_k} x k_splits={tiles.k_splits} does not divide K={k} "
                         "into whole steps (qmm.fit_dequant_tiles picks ones that do)")
    m_tiles, n_tiles = pl.cdiv(m, tiles.block_m), pl.cdiv(n, tiles.block_n)
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    split = tiles.k_splits > 1
    out_shape = jax.ShapeDtypeStruct((tiles.k_splits, m, n) if split else (m, n),
                                     jnp.float32 if split else out_dtype)
    kernel = functools.partial(_matmul_kernel, m=m, n=n, k=k, tiles=tiles, m_tiles=m_tiles, n_tiles=n_tiles,
                               precision=precision)
    operands = (x, wd) + (() if after is None else (after,))
    if poison:
        operands += (jnp.full(out_shape.shape, jnp.nan, out_shape.dtype),)
    y = pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(m_tiles * n_tiles,) + ((tiles.k_splits,) if split else ()),
        compiler_params=plt.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        input_output_aliases={len(operands) - 1: 0} if poison else {},
        interpret=interpret,
        name=f"qmm_dequant_mm_{tiles.block_m}x{tiles.block_n}x{tiles.block_k}"
             + (f"_split{tiles.k_splits}" if split else ""),
    )(*operands)
    return _sum_splits(y, out_dtype) if split else y


# a new array: the natural words live on until the caller drops its params
_to_lanes = jax.jit(to_lane_words, static_argnames=("halves",))


def _subnormal(w: QuantizedWeight, abstract: bool) -> QuantizedWeight:
    """w (with raw scales_t, biases_t) with the "subnormal" conversion's rows in their place (`qmm_mgpu.
    subnormal_scales`) and its row scale where some row needs one; w unchanged where they would not be exact (the
    kernel then takes the "words" conversion for it). Reads two flags back from the device per weight."""
    if abstract:  # lowering without a device: the common form (no row scale)
        return dataclasses.replace(w, subnormal=True)
    s_up, b_down, row_scale, exact = qmm_mgpu.subnormal_scales(w.scales_t, w.biases_t)
    exact, needed = jax.device_get((exact, jnp.any(row_scale != 1.0)))
    if not exact:
        return w
    return dataclasses.replace(w, scales_t=s_up, biases_t=b_down, subnormal=True,
                               row_scale=row_scale if needed else None)


def decode_layout(params, x_dtype=jnp.bfloat16):
    """params with every packed weight the Mosaic GPU decode kernel takes given its scales and biases transposed
    (`QuantizedWeight.scales_t`, `biases_t`: made once here, 1/8 of the 4-bit weights' bytes more memory; under the
    "subnormal" and "halves" conversions the shifted rows they read, `_subnormal`) and, under the lane conversions,
    its words in the kernel's lane order (`lanes`: the same fields permuted, in place of the natural order; under
    "halves" that conversion's order, `halves`; the prompt path's dequantization pass reads them too) when the
    decode calls go to it
    (`decode_impl()` is "mgpu") with activations of x_dtype (the model's dtype: fp32 activations stay on the Triton
    kernels, so their weights are left alone); otherwise params unchanged. The kernel's bits are the same either
    way."""
    if decode_impl() != "mgpu":
        return params

    def one(w):
        if not isinstance(w, QuantizedWeight) or w.scales_t is not None:
            return w
        if not decode_on_mgpu(jax.ShapeDtypeStruct((1, w.in_features), x_dtype), w):
            return w
        abstract = isinstance(w.words, jax.ShapeDtypeStruct)  # abstract params (lowering without a device)
        t = lambda a: jax.ShapeDtypeStruct(a.shape[::-1], a.dtype) if abstract else jnp.asarray(a.T)
        w = dataclasses.replace(w, scales_t=t(w.scales), biases_t=t(w.biases))
        if qmm_mgpu.CONVERSION in qmm_mgpu.SUBNORMAL_CONVERSIONS:
            w = _subnormal(w, abstract)
        if qmm_mgpu.CONVERSION in qmm_mgpu.LANE_CONVERSIONS and not w.lanes:
            # the halves order only beside the shifted rows: a weight without them takes "words" (the pair order)
            halves = qmm_mgpu.CONVERSION == "halves" and w.subnormal
            w = dataclasses.replace(w, words=w.words if abstract else _to_lanes(w.words, halves=halves), lanes=True,
                                    halves=halves)
        return w

    return jax.tree_util.tree_map(one, params, is_leaf=lambda v: isinstance(v, QuantizedWeight))


def qmm(x: jax.Array, w: QuantizedWeight, *, prompt: bool = False, interpret: bool = False,
        tiles: Tiles | None = None) -> jax.Array:
    """x [M, K] -> y [M, N] = x @ dequantize(w)^T in x.dtype, fp32 accumulation, through the Pallas kernel.

    w: the packed weight [N, K] exactly as the checkpoint loader hands it (no repack needed).
    prompt: static choice of the call site -- False for decode/verify rows (memory-bound, any M), True for prompt
        chunks (compute-bound, M >= 64 typical; `PROMPT_IMPL` picks the implementation). Within a path, a row's
        bits are independent of M and of the other rows; the two paths may differ from each other in the last
        bits (different tiles), and so may the two prompt implementations (different k order).
    tiles: override the shape-derived tiles (tests and benchmarks; a caller that overrides must keep it fixed).
    """
    return _qmm(x, w, prompt=prompt, interpret=interpret, tiles=tiles)


def _qmm(x: jax.Array, w: QuantizedWeight, *, prompt: bool, interpret: bool, tiles: Tiles | None,
         poison: bool = False) -> jax.Array:
    """`qmm`; poison: the kernel writes into NaN-filled memory (tests catch elements it never writes)."""
    _validate(x, w)
    n, k = w.shape
    if not prompt and tiles is None and not poison and decode_on_mgpu(x, w, interpret):
        with jax.named_scope("qmm_decode_mgpu"):
            return qmm_mgpu.qmm_rows(x, w, interpret=interpret)
    if tiles is None:
        tiles = (prompt_tiles if prompt else decode_tiles)(n, k, w.bits, w.group_size)
    tiles.check()
    if x.shape[0] == 0:
        return jnp.zeros((0, n), x.dtype)
    if tiles.impl == "dequant":
        with jax.named_scope("qmm_prompt_dequant" if prompt else "qmm_decode_dequant"):
            with jax.named_scope("qmm_dequantize"):
                wd = _dequantize_weight(w, x.dtype, interpret)
            return _matmul_call(x, wd, x.dtype, tiles, interpret, poison)
    with jax.named_scope("qmm_prompt" if prompt else "qmm_decode"):
        kp = _padded_k(k, w.bits)
        xk = x if kp == k else jnp.pad(x, ((0, 0), (0, kp - k)))
        wp = _pad_weight(w)
        if not tiles.x_natural:
            xk = _to_kernel_order(xk, block_cols(kp, w.bits), w.bits)
        return _qmm_call(xk, wp.words, wp.scales, wp.biases, n, w.bits, w.group_size, x.dtype, tiles, interpret,
                         poison)


# ---------------------------------------------------------------------------------------------------------------
# quantized embedding


def embed_reference(w: QuantizedWeight, ids: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Quantized embedding gather: ids int [...] -> [..., K] rows of the dequantized table."""
    return dequantize_rows(w, ids, dtype)


def embed(w: QuantizedWeight, ids: jax.Array, dtype=jnp.float32, *, interpret: bool = False) -> jax.Array:
    """ids int [...] -> [..., K]: gathers only the rows asked for (T x K/2 bytes at 4 bits), then dequantizes them.

    An XLA gather + elementwise fusion reads just those rows once, so a Pallas kernel would not move fewer bytes;
    `interpret` is accepted for symmetry with `qmm`.
    """
    del interpret
    if not isinstance(w, QuantizedWeight):
        raise ValueError(f"embed: table must be a QuantizedWeight, got {type(w).__name__}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"embed: ids must be integers, got {ids.dtype}")
    w.validate("embedding")
    return embed_reference(w, ids, dtype)
