"""Decode qmm on Mosaic GPU (the default decode kernel on a GPU since session 11: `qmm.DECODE_IMPL` "auto" routes
the decode calls it supports here outside interpret mode; "triton" keeps them on the Triton tiles):
y [M, N] = x [M, K] @ dequantize(w)^T for decode/verify rows (pieces of 8, 16, 32 or 64 rows: `pieces`), 4-bit MLX
weights with bf16 scales and biases, group 64, bf16 x.

Why a second kernel: the Triton decode kernel (`qmm.py`) runs at 35-44 % of copy on the H200 because its loads and
its dequantize-and-MMA chain share one instruction stream and each chunk's wgmma is waited before the next chunk
is built (docs/kernels/qmm.md, runs 4-5). Here the structure is Mosaic GPU's warp-specialised pipeline: a memory
warpgroup keeps `stages` TMA copies in flight, `COMPUTE_WGS` = 3 compute warpgroups each own `TILE_N` = 64 output
features of a CTA's `CTA_N` = 192 (N need not be a multiple: past N, TMA reads zeros and clips the stores).

Schedule (`flat_schedule`): the weight is `CTA_N`-row tiles, each tile's K is L steps of `BLOCK_GROUPS` groups
(a step moves [192, 256] 4-bit weights = 128-byte rows, x [16, 256] and the step's scale and bias rows). All
tiles' steps, tile-major, form one sequence cut into equal chunks of S consecutive steps, one chunk a persistent
CTA (at most `SMS`), and each CTA runs one pipeline over its chunk, so no CTA waits at a tile's edge and no wave is
left part-empty. A tile's K is summed in pieces, one for each chunk that touches it; the pieces are added in one
fixed order afterwards (pieces a tile lacks are selected away).

Arithmetic (`CONVERSION`, "subnormal" since session 29, "words" in sessions 13-28): the words come in the kernel's
lane order (`to_lane_words`, made once at load by `qmm.decode_layout`), so a compute warpgroup loads its [64, 256]
tile as uint32 words in the MMA's register layout and each lane's two words hold exactly its weight pairs; each bf16
pair is built in inline PTX as the wgmma A operand in registers: "words" with prmt, lop3 (bf16 128 + q), sub and one
bf16x2 FMA (s q + b rounded once, MLX's dequantization); "subnormal" with prmt, and (the bf16 subnormal q 2^-133)
and the FMA against scale and bias rows shifted once at load (`subnormal_scales`), the same bits; "halves"
(prepared in session 34) with one and a pair over words whose pairs lie in the words' two 16-bit halves. x [R, K]
(rows padded to the piece height R) is the B operand, read transposed from shared memory. A step's MMAs go into a fresh
fp32 accumulator whose value is added to the warpgroup's running fp32 sum (restarted where a tile starts); the sum
is stored where the tile or the chunk ends. ("nibbles", sessions 6-12: the natural
words viewed as uint4, loaded a byte a pair, XOR 8 read as signed int4, + 8, s q + b as bf16 ops; "unsigned": the
fields converted as unsigned.)

Exactness: every row is one column of the MMAs (a row's bits are the same whatever the piece height: shown on the
H200), and the schedule, the pieces and their order come from the weight's shape alone, so a row's bits do not
depend on M or on the other rows. The bits differ from the Triton kernel's (another accumulation order); a model
uses one kernel for all its decode and verify programs.

Status (docs/kernels/qmm.md runs 6, 9-11): right on the H200 (oracle and row invariance at the 27B's shapes and
the tiny checkpoint's; the engine's gates pass with it since session 7, when the output's rounding was first kept
from its consumers, see `_decode`), the default decode kernel since session 11. With the words conversion (session
13): isolated at M = 1, 73-93 % of copy on the two big 27B shapes, 48-81 % on the others; 1.1-1.9x the Triton
tiles at M = 16 and 3.5-6.3x at 64-256 rows. With 3 compute warpgroups (session 14; timed from a profiler trace):
the kernel alone 34.9 us at 5120 -> 34816 (2.9 TB/s) where its copies alone take 27; in the 27B decode program 5.6
of a one-stream round's 8.3 ms of kernels, at ~60 % of copy. With the "subnormal" conversion (session 29): 32.5 us
at 5120 -> 34816; 5.2 of a one-stream round's 6.9 ms of device work.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.mosaic import gpu as mgpu
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, vector

from pallas_kernels import mgpu_lowering
from pallas_kernels.mgpu_lowering import CachedKernel
from pallas_kernels.qweight import (QuantizedWeight, add_rounded_once_to_bf16, from_lane_words, natural_words,
                                    to_lane_words, unpack)

ROWS = 16  # x rows a call carries (the MMA's N); M <= ROWS
# Wider pieces for calls of more than ROWS rows (verify windows, --parallel > 16): `qmm_rows` cuts M rows into
# pieces of at most WIDE_ROWS rows (`pieces`), each reading the weight once. A row's bits are the same in a 16-, 32-
# or 64-row piece (the pieces differ only in the MMA's N, and a row is one column of it): shown on the H200 by
# `test_gpu_wide_pieces_same_bits` (session 12), so the cut is free to follow M. On the H200 (session 12, 5120->17408)
# 64-row pieces took 30 us at M = 64 against 75 in 16-row pieces, 134 against 265 at M = 256; at M = 16 a 32-row
# piece costs what a 16-row one does and a 64-row one 1.3x. None: 16-row pieces only.
# PIECE_ROWS: the piece heights the kernel takes. NARROW_ROWS: the least height `pieces` cuts. 8 since session 30:
# calls of up to 8 rows, the one-stream decode among them, carry half the x bytes a step and run MMAs of half the N;
# a row's bits are the same as in 16-row pieces on the H200 (`test_gpu_wide_pieces_same_bits`). Session 13 saw no
# gain beyond noise with the "words" conversion; with "subnormal" the kernel alone took 31.0 against 32.3 us at
# 5120 -> 34816 and the traced one-stream round's qmm 4962 against 5132 us (session 30). 16 in sessions 6-29.
WIDE_ROWS: int | None = 64
NARROW_ROWS = 8
PIECE_ROWS = (8, 16, 32, 64)
GROUP = 64
TILE_N = 64  # output features a compute warpgroup
# Compute warpgroups a CTA. The kernel alone on the H200 (session 14, profiler durations): with 2 the conversion
# and MMAs are the limit (5120 -> 34816: 38.0 us, 27 us with copies only), 3 take 34.3-35.2 us (17408 -> 5120:
# 20.5-20.9 -> 19.2-19.7 us); 4 did not finish compiling and running within 150 s. The schedule's pieces follow
# CTA_N, so this changes a model's bits once (still a function of the weight's shape alone).
COMPUTE_WGS = 3
CTA_N = TILE_N * COMPUTE_WGS
STAGES = 4
BLOCK_GROUPS = 4  # groups of K a pipeline step carries (a 128-byte row of weight words, 24 KB a CTA)
SMS = 132  # the H200's; chunks of work are spread over this many persistent CTAs (a constant: never a device query)
# How a compute warpgroup turns its [64, 256] 4-bit tile into the MMA's bf16 A operand:
# - "words" (default since session 13): the weight's words come repacked at load (`QuantizedWeight.lanes`, made by
#   `qmm.decode_layout`: in each group of 8 words the bytes transposed so that the words a lane holds in
#   the MMA's register layout carry exactly the pairs of weights it needs). A thread then loads its 16 words a step
#   as 8 8-byte shared-memory loads and builds each bf16 pair with four instructions (prmt, lop3, sub, and one
#   bf16x2 FMA: q s + b rounded once, the Triton kernels' and the dequant pass's weights) in inline PTX.
# - "nibbles" (sessions 6-12): the natural words viewed as uint4, loaded in the MMA's layout (one byte, two weights,
#   a shared-memory load: 64 loads a thread a step), XOR 8 read as signed int4 (Mosaic GPU's int4 -> bf16
#   conversion), + 8, then s q + b as bf16 ops. "unsigned": the same with the fields converted as unsigned.
# - "subnormal" (session 29): the "words" loads with three instructions a pair instead of four. The pair's fields
#   masked into the low bits of each half (prmt, and) are the bf16 subnormals q 2^-133, exactly; one bf16x2 FMA with
#   the scale row made s 2^(133 - d) and the bias b 2^-d once at load (`subnormal_scales`) gives RN(q s + b) 2^-d, the
#   "words" weight scaled by a power of two (d = 0 unless a row's scales reach 2^-5, where s 2^133 would leave bf16's
#   range). The MMA's fp32 sums of scaled products are the unscaled sums scaled, so the stored pieces, multiplied
#   back by 2^d (`row_scale`, only where some d > 0), are the "words" pieces bit for bit away from fp32's
#   underflow. Needs bf16 FMAs that keep subnormal inputs (sm_90's do: the gpu tests compare it with "words").
# - "halves" (session 34; the default since session 36): "subnormal" with two instructions a pair. The lane words
#   come with each pair's first field in the word's low 16 bits and its second in the high 16
#   (`to_lane_words(halves=True)`, made once by `qmm.decode_layout`): pair j of a word is nibbles (j, j + 4).
#   Pairs 0 and 2 are one and with 0x000F000F (of w, of w >> 8): q 2^-133 in each half, as "subnormal". Pairs 1
#   and 3 are one and with 0x00F000F0: q sits in bits 4-7 of each half, where the top one is the exponent's lowest
#   bit, and that bf16 is exactly q 2^-129 for every q
#   (for q >= 8 the exponent field is 1: 2^-126 + (q - 8) 2^-129 = q 2^-129). Their FMA takes the scale 2^-4
#   lower (s 2^(129 - d), exact), so every product is the "subnormal" one and the FMA the same: its bits. Per
#   word: one shift, four ands, four FMAs, against a shift and four prmt, and and FMA (64 prmt a step fewer, 8 bf16
#   multiplies for the lower scales more). On the H100 (session 36, run.sh hundred-forty-seventh, -sixth): the kernel
#   alone 1-6 % faster at the 27B's five shapes (8 rows), the one-stream round's qmm 6561 -> 6439 µs, the engine's
#   one stream 123.4 forwards/s against 121.5 / 121.6 with "subnormal" in the same process.
CONVERSION = "halves"
CONVERSIONS = ("words", "subnormal", "halves", "nibbles", "unsigned")
LANE_CONVERSIONS = ("words", "subnormal", "halves")  # the conversions that read lane-ordered words
SUBNORMAL_CONVERSIONS = ("subnormal", "halves")  # the conversions that read `subnormal_scales`' rows
SUBNORMAL_EXP = 133  # a bf16 with exponent field 0 and mantissa field q is q * 2^-133
# How a compute warpgroup loads its lane words: Mosaic GPU's staggered plan (True; each thread's 8-byte loads go
# to rotating registers to spread shared-memory banks, then 16 selects a step put them in place: seen in the SASS,
# session 29) or each in place (False). Same values either way (`test_gpu_unstaggered_loads_same_bits`).
STAGGERED_LOADS = False
# Where a pipeline step's weight block lies in memory: "rows" (the weight's own [N, K / 8] words: a step's
# [CTA_N, 8 G'] block is CTA_N runs of 128 bytes, K / 2 bytes apart, and its scale and bias rows are 2 G' runs of
# 256 bytes of [G, N]) or "tiles" (`tile_layout`: each step's words one contiguous block, 24 KB at CTA_N 192, its
# scale and bias rows one contiguous 1.5 KB block beside; one copy fewer a step). Same values, same bits. On the
# H200 (session 14) 1-3 % faster alone; not wired into the loader (every reader of the words would have to learn it),
# so only `qmm_decode(layout="tiles")` uses it, re-laying the weight each call.
LAYOUT = "rows"
LAYOUTS = ("rows", "tiles")
# How the summed fp32 output keeps its rounding to x.dtype in every program (see `_decode`): "barrier" (the
# conversion behind an optimization barrier, so nothing fuses across it; sessions 7-11) or "reduce_precision" (the
# value rounded to x.dtype's precision by an op XLA keeps, then converted: a consumer that skips the conversion
# still reads the rounded value, and the kernel's epilogue may fuse with its consumers). Same bits (CPU test); on
# the H200 (session 12) the engine's gates passed with it, and the 27B decode program at one stream went from 1153
# to 912 fusions (1775 to 1534 launches a round) and its pipelined round from 13.3 to 11.2 ms.
ROUNDING = "reduce_precision"
ROUNDINGS = ("barrier", "reduce_precision")


def _unsupported(x: jax.Array, w: QuantizedWeight) -> str | None:
    """What keeps this call (any M) off the kernel, or None: it takes 4-bit group-64 weights with bf16 scales and
    biases, bf16 x [M, K], N a multiple of 8 (a last CTA past N reads zeros and its stores are clipped: TMA's
    bounds handling)."""
    n, k = w.shape
    if w.bits != 4 or w.group_size != GROUP or w.scales.dtype != jnp.bfloat16 or w.biases.dtype != jnp.bfloat16:
        return (f"needs 4-bit weights, group {GROUP}, bf16 scales and biases; got bits={w.bits}, "
                f"group={w.group_size}, scales {w.scales.dtype}, biases {w.biases.dtype}")
    if x.ndim != 2 or x.dtype != jnp.bfloat16 or x.shape[1] != k:
        return f"x must be bf16 [M, {k}], got {x.dtype} {tuple(x.shape)}"
    if n % 8:
        return f"N={n} must be a multiple of 8"
    return None


def supports(x: jax.Array, w: QuantizedWeight) -> bool:
    """Whether `qmm_rows` takes this call (`_unsupported`); everything else stays on the Triton kernels."""
    return _unsupported(x, w) is None


def qmm_rows(x: jax.Array, w: QuantizedWeight, *, interpret: bool = False) -> jax.Array:
    """`qmm_decode` for any M: the pieces `pieces(M)` names, each padded like a lone row (so a row's bits never
    depend on which piece it rides in), outputs concatenated. Every piece re-reads the weight."""
    if x.shape[0] == 0:
        return jnp.zeros((0, w.out_features), x.dtype)
    return _rows(x, w, interpret=interpret, heights=pieces(x.shape[0]), rounding=ROUNDING)


def pieces(m: int) -> tuple[int, ...]:
    """The piece heights `qmm_rows` cuts M rows into, in order: pieces of WIDE_ROWS while more than that is left,
    then the least height of PIECE_ROWS, NARROW_ROWS or more, that holds the rest (ROWS-row pieces only where
    WIDE_ROWS is None)."""
    widest = ROWS if WIDE_ROWS is None else WIDE_ROWS
    if widest not in PIECE_ROWS or NARROW_ROWS not in PIECE_ROWS or NARROW_ROWS > widest:
        raise ValueError(f"qmm_mgpu: WIDE_ROWS={WIDE_ROWS} and NARROW_ROWS={NARROW_ROWS} must be heights of "
                         f"{PIECE_ROWS}, the narrow one no wider")
    out = [widest] * ((m - 1) // widest)
    rest = m - widest * len(out)
    return tuple(out + [next(r for r in PIECE_ROWS if NARROW_ROWS <= r and r >= rest)]) if m > 0 else ()


def row_pieces(heights: tuple[int, ...]) -> list[tuple[int, int]]:
    """(first row, height) of each piece of `heights` (`pieces`), in order."""
    return list(zip(np.cumsum((0,) + heights[:-1]).tolist(), heights))


@functools.partial(jax.jit, static_argnames=("interpret", "heights", "rounding"))
def _rows(x: jax.Array, w: QuantizedWeight, *, interpret: bool, heights: tuple[int, ...], rounding: str
          ) -> jax.Array:
    # One program (see `qmm_decode` on eager calls).
    return jnp.concatenate([qmm_decode(x[i:i + r], w, interpret=interpret, rows=r, rounding=rounding)
                            for i, r in row_pieces(heights)], axis=0)


def _check(x: jax.Array, w: QuantizedWeight, rows: int) -> None:
    why = _unsupported(x, w)
    if why is None and rows not in PIECE_ROWS:
        why = f"rows={rows} is not one of {PIECE_ROWS}"
    if why is None and not 1 <= x.shape[0] <= rows:
        why = f"x must be bf16 [M <= {rows}, {w.in_features}], got {x.dtype} {tuple(x.shape)}"
    if why is not None:
        raise ValueError(f"qmm_mgpu: {why}")


SMEM_BYTES = 227 * 1024  # the H200's shared memory a CTA may take


def stages_for(rows: int, stages: int, block_groups: int = BLOCK_GROUPS, row_scale: bool = False) -> int:
    """Pipeline stages for a piece height: as many of `stages` as fit in SMEM_BYTES beside the output tile (fp32
    [COMPUTE_WGS, TILE_N, rows]). A stage holds x [rows, block_k] bf16, the weight tile [CTA_N, block_k] int4 and
    its scale and bias rows (and, with row_scale, the "subnormal" conversion's fp32 row scale): at 4 groups a step
    and 3 compute warpgroups 7 stages fit at 8 rows, 6 at 16, 4 at 32, 3 at 64. The stage count changes no bits
    (only how far the copies run ahead)."""
    block_k = GROUP * block_groups
    stage = rows * block_k * 2 + CTA_N * block_k // 2 + 2 * block_groups * CTA_N * 2 + row_scale * CTA_N * 4
    fit = (SMEM_BYTES - COMPUTE_WGS * TILE_N * rows * 4) // stage
    return max(1, min(stages, fit))


def _div(a: jax.Array, b: int) -> jax.Array:
    """a // b for a traced a >= 0 and b > 0 as one integer division: jnp's floor division adds a sign correction
    (a jitted helper with sign ops) that Mosaic GPU lowers at every index map, about a sixth of the kernel's
    lowering time, for the same value here."""
    return lax.div(a, jnp.asarray(b, a.dtype))


def _smem_transforms(cols: int, bits: int, operand: str) -> tuple:
    """Tiling and swizzle of a shared-memory tile with rows of `cols` elements of `bits` bits (a wgmma operand)."""
    swizzle = plgpu.find_swizzle(cols * bits, operand)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def flat_schedule(n: int, k: int, block_groups: int, sms: int | None = None) -> tuple[int, int, int, np.ndarray]:
    """The schedule's shape-derived numbers: (steps a tile's K takes L, steps a CTA S, CTAs, pieces of each tile).

    The tiles' steps, tile-major, are one sequence of tiles x L steps cut into chunks of S consecutive steps, one a
    CTA (the last chunk may be shorter); S is the least that needs at most `sms` CTAs (None: SMS). A tile's K is
    summed in pieces, one for each chunk that touches it, added in one fixed order afterwards."""
    sms = SMS if sms is None else sms
    tiles = -(-n // CTA_N)
    length = k // GROUP // block_groups
    per_cta = -(-tiles * length // sms)
    ctas = -(-tiles * length // per_cta)
    t = np.arange(tiles)
    return length, per_cta, ctas, ((t + 1) * length - 1) // per_cta - (t * length) // per_cta + 1


def tile_layout(lane_words: jax.Array, scales_t: jax.Array, biases_t: jax.Array, block_groups: int
                ) -> tuple[jax.Array, jax.Array]:
    """The "tiles" layout (LAYOUTS) of a weight: lane words [N, K / 8], scales and biases [G, N] -> (words
    [tiles L CTA_N, 8 G'], scale and bias rows [tiles L 2 G', CTA_N]) with G' = block_groups groups a step, the
    steps tile-major (`flat_schedule`'s order) and N padded with zeros to whole tiles (outputs past N are clipped).
    Block f of each is step f = tile L + s: the words of rows tile CTA_N ... and groups s G' ..., then that step's
    G' scale rows and G' bias rows."""
    n, c = lane_words.shape
    g = scales_t.shape[0]
    assert c == 8 * g and g % block_groups == 0 and scales_t.shape == biases_t.shape == (g, n), (
        lane_words.shape, scales_t.shape, biases_t.shape, block_groups)
    tiles, length = -(-n // CTA_N), g // block_groups
    pad = tiles * CTA_N - n
    q = jnp.pad(lane_words, ((0, pad), (0, 0))).reshape(tiles, CTA_N, length, 8 * block_groups)
    q = q.transpose(0, 2, 1, 3).reshape(tiles * length * CTA_N, 8 * block_groups)

    def rows(t):  # [G, N] -> [tiles, L, G', CTA_N]
        t = jnp.pad(t, ((0, 0), (0, pad))).reshape(length, block_groups, tiles, CTA_N)
        return t.transpose(2, 0, 1, 3)

    sb = jnp.concatenate([rows(scales_t), rows(biases_t)], axis=2)
    return q, sb.reshape(tiles * length * 2 * block_groups, CTA_N)


def _pieces_written(n: int, k: int, block_groups: int, sms: int) -> np.ndarray:
    """[P, tiles] bool: whether piece p of tile t was written."""
    counts = flat_schedule(n, k, block_groups, sms)[3]
    return np.arange(counts.max())[:, None] < counts[None, :]


def written_columns(n: int, k: int, block_groups: int, sms: int) -> np.ndarray:
    """[P, N] bool: whether piece p of output column j was written (the rest hold whatever the buffer held)."""
    return np.repeat(_pieces_written(n, k, block_groups, sms), CTA_N, axis=1)[:, :n]


def sum_pieces(load, n_pieces: int) -> jax.Array:
    """The pieces' fp32 sum in the one fixed order every consumer of the kernel's output uses: load(p) -> (piece p's
    values, whether they were written); a piece a tile did not have is selected as 0.0 (a select, so garbage
    cannot leak), then added."""
    vals, ok = load(0)
    total = jnp.where(ok, vals, 0.0)
    for p in range(1, n_pieces):
        vals, ok = load(p)
        total = total + jnp.where(ok, vals, 0.0)
    return total


@functools.partial(jax.tree_util.register_dataclass, data_fields=["parts", "valid"], meta_fields=["lead"])
@dataclasses.dataclass(frozen=True)
class Pieces:
    """A projection's decode rows before their epilogue, for a kernel that finishes them itself (`piece_row`): the
    pieces `qmm_parts` gives, parts [P, N, R] fp32 and valid [P, N] bool, of live rows lead (their leading shape,
    row-major: prod(lead) <= R). Their values are y [*lead, N] = the pieces summed in piece order (`sum_pieces`),
    rounded to bf16: the projection's output bit for bit."""
    parts: jax.Array
    valid: jax.Array
    lead: tuple[int, ...]

    def materialize(self) -> jax.Array:
        m = int(np.prod(self.lead))
        total = sum_pieces(lambda i: (self.parts[i], self.valid[i][:, None]), self.parts.shape[0])
        return total[:, :m].T.astype(jnp.bfloat16).reshape(*self.lead, -1)

    def check(self, who: str, dims: int) -> tuple[int, ...]:
        """The rows' shape (*lead, N), or a ValueError naming `who` (a kernel taking `dims` leading axes)."""
        p = self.parts
        if (p.ndim != 3 or self.valid.shape != p.shape[:2] or p.dtype != jnp.float32 or len(self.lead) != dims
                or int(np.prod(self.lead)) > p.shape[2]):
            raise ValueError(f"{who}: Pieces must hold fp32 parts [P, N, R], valid [P, N] and {dims} leading axes of "
                             f"at most R live rows, got {p.dtype} {p.shape}, {self.valid.shape}, lead {self.lead}")
        return (*self.lead, p.shape[1])


def piece_row(parts_ref, valid_ref, n_pieces: int, row, cols, dtype) -> jax.Array:
    """Inside a Triton kernel: row `row`'s columns `cols` (an index or a `pl.ds`) of `Pieces`' values, from refs
    of its valid [P, N] (int8) and parts [P, N, R]: summed in piece order (`sum_pieces`), rounded to dtype."""
    return sum_pieces(lambda p: (parts_ref[p, cols, row], valid_ref[p, cols] != 0), n_pieces).astype(dtype)


def rows_shape(y, who: str) -> tuple[tuple[int, ...], jnp.dtype]:
    """For a Triton kernel reading rows y [S, R, N] or their `Pieces`: (y's shape, its dtype), or a ValueError
    naming `who`."""
    if isinstance(y, Pieces):
        return y.check(who, 2), jnp.dtype(jnp.bfloat16)
    if y.ndim != 3:
        raise ValueError(f"{who}: y must be [S, R, N], got {y.shape}")
    return y.shape, y.dtype


def rows_operands(y) -> tuple[tuple[jax.Array, ...], int]:
    """The operands that stand for y [S, R, N] in such a kernel's call and P for `piece_row`: (y,) and 0, or the
    pieces' valid [P, N] as int8 and parts, and P."""
    if isinstance(y, Pieces):
        return (y.valid.astype(jnp.int8), y.parts), y.parts.shape[0]
    return (y,), 0


def qmm_parts(x: jax.Array, w: QuantizedWeight, *, rows: int, interpret: bool = False
              ) -> tuple[jax.Array, np.ndarray]:
    """`qmm_decode` before its epilogue, for a consumer that sums the pieces itself (`swiglu`): x bf16 [M <= rows,
    K] -> (pieces [P, N, rows] fp32, written [P, N] bool); `sum_pieces` of them, rounded to bf16, is `qmm_decode`'s
    output (its rows < M)."""
    n, k = w.shape
    return (qmm_decode(x, w, rows=rows, interpret=interpret, epilogue=False),
            written_columns(n, k, block_groups_for(k), SMS))


def _pow2(e: jax.Array) -> jax.Array:
    """2.0 ** e as fp32, exactly, for int32 e in [-126, 127] (built from its bits: XLA's exp2 need not be exact)."""
    return lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def _times_pow2(x: jax.Array, e) -> jax.Array:
    """fp32 x times 2^e for integer e (an int or an int32 array broadcasting with x) in [-252, 254], as two factors
    each in fp32's range, exact wherever x 2^e is a normal fp32. The barrier keeps XLA from folding the two factors
    into one (2^133 is inf in fp32, 2^-133 subnormal)."""
    e = jnp.asarray(e, jnp.int32)
    lo = e // 2
    return lax.optimization_barrier(x * _pow2(lo)) * _pow2(e - lo)


@jax.jit
def subnormal_scales(scales_t: jax.Array, biases_t: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The "subnormal" conversion's scale and bias rows (CONVERSIONS): s, b [G, N] bf16 -> (s 2^(133 - d), b 2^-d
    [G, N] bf16, 2^d [1, N] fp32, exact). d, per output column, is the least d >= 0 that keeps the column's largest
    s 2^(133 - d) in bf16's range. exact (a bool scalar): every scaled value scales back to its source, so nothing
    left bf16's normal range (false only for scales or biases near 2^-126 or 2^122; the kernel must not use them)."""
    s, b = scales_t.astype(jnp.float32), biases_t.astype(jnp.float32)
    _, e = jnp.frexp(jnp.max(jnp.abs(s), axis=0))  # max |s| < 2^e
    d = jnp.clip(e.astype(jnp.int32) + SUBNORMAL_EXP - 128, 0, 127)
    s_up = _times_pow2(s, SUBNORMAL_EXP - d).astype(jnp.bfloat16)
    b_down = (b * _pow2(-d)).astype(jnp.bfloat16)
    exact = (jnp.all(_times_pow2(s_up.astype(jnp.float32), d - SUBNORMAL_EXP) == s)
             & jnp.all(b_down.astype(jnp.float32) * _pow2(d) == b) & jnp.all(d < 127))
    return s_up, b_down, _pow2(d)[None, :], exact


# bf16x2 of one weight pair from a lane word (see CONVERSION): byte j of the word holds the pair's fields (low
# nibble first); prmt puts byte j of w in the low half and byte j of w >> 4 in the high half, lop3 keeps each half's
# low nibble and ORs in 0x4300 (bf16 128 + q, exact), sub takes 128 away (exact), and the FMA rounds q s + b once.
# The scale and bias come as bf16 halves ($3, $4) splatted here: ptxas folds the splats into the FMA's operand
# selectors (.H0_H0), where a splat built outside the asm cost an integer multiply each (session 29).
_PAIR_PTX = """{{ .reg .b32 t, c, s, b;
prmt.b32 t, $1, $2, {sel:#06x};
lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;
mov.b32 c, 0x43004300;
sub.bf16x2 t, t, c;
mov.b32 s, {{$3, $3}};
mov.b32 b, {{$4, $4}};
fma.rn.bf16x2 $0, t, s, b; }}"""


# The "subnormal" conversion's pair: the same bytes, each half's low nibble kept (q 2^-133 as a bf16 subnormal), and
# the FMA with the shifted scale and bias rows.
_SUBNORMAL_PAIR_PTX = """{{ .reg .b32 t, s, b;
prmt.b32 t, $1, $2, {sel:#06x};
and.b32 t, t, 0x000F000F;
mov.b32 s, {{$3, $3}};
mov.b32 b, {{$4, $4}};
fma.rn.bf16x2 $0, t, s, b; }}"""


def _half(reg) -> ir.Value:
    """A vector<1 x bf16> register -> its i16 bits (a b16 operand of the pair's PTX)."""
    i16 = ir.IntegerType.get_signless(16)
    return arith.bitcast(i16, vector.extract(reg, dynamic_position=[], static_position=[0]))


# The "halves" conversion's pair: one mask (0x000F000F or 0x00F000F0) of a word, then the FMA with the scale (for
# 0x00F000F0 the scale row 2^-4 lower) and bias rows of "subnormal".
_HALVES_PAIR_PTX = """{{ .reg .b32 t, s, b;
and.b32 t, $1, {mask:#010x};
mov.b32 s, {{$2, $2}};
mov.b32 b, {{$3, $3}};
fma.rn.bf16x2 $0, t, s, b; }}"""
# A scale half 2^-4 lower (exact: the "subnormal" rows are far above bf16's smallest normal).
_SIXTEENTH_PTX = "{ .reg .b16 c; mov.b16 c, 0x3D80; mul.rn.bf16 $0, $1, c; }"


def _lane_dequant(block_groups: int, transforms: tuple, subnormal: bool = False, staggered: bool = True,
                  halves: bool = False):
    """inline_mgpu function (words ref [TILE_N, 8 G] of lane words in shared memory, G scale rows, G bias rows, each
    [TILE_N] in the MMA's row layout) -> bf16 A tile [TILE_N, 64 G] in the MMA's register layout: s q + b rounded
    once. A thread's lane words are its A registers' weights in order (`to_lane_words`), so no value crosses lanes.
    subnormal: the "subnormal" conversion (scale and bias rows from `subnormal_scales`). staggered: the words'
    loads as Mosaic GPU plans them against bank conflicts (each load then blended into place with selects), or
    each lane's words loaded in place (STAGGERED_LOADS). halves: the "halves" conversion (words in that order, the
    "subnormal" rows)."""
    ptx = _SUBNORMAL_PAIR_PTX if subnormal else _PAIR_PTX
    row = plgpu.Layout.WGMMA.reduce(1)
    swizzle = next(t.swizzle for t in transforms if isinstance(t, plgpu.SwizzleTransform))

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(transforms), [row] * block_groups, [row] * block_groups),
                       return_type=plgpu.ShapeDtypeStruct((TILE_N, GROUP * block_groups), jnp.bfloat16,
                                                          layout=plgpu.Layout.WGMMA))
    def dequant(_, words_ref, s_rows, b_rows):
        i32 = ir.IntegerType.get_signless(32)
        pair_ty = ir.VectorType.get((2,), ir.BF16Type.get())
        words = mgpu.FragmentedArray.load_tiled(words_ref, swizzle=swizzle, is_signed=False, optimized=staggered,
                                                layout=mgpu.WGMMA_LAYOUT)
        # registers: [.., column tile, .., .., row half, ..]; a u32 column tile is one group's 8 words, a bf16
        # column tile 8 weights, each a vector of the lane's 2 adjacent columns
        regs = np.empty(mgpu.WGMMA_LAYOUT.registers_shape((TILE_N, GROUP * block_groups)), dtype=object)
        for g in range(block_groups):
            for half in range(2):
                s2 = _half(s_rows[g].registers[0, 0, half, 0, 0])
                b2 = _half(b_rows[g].registers[0, 0, half, 0, 0])
                both = words.registers[0, g, 0, 0, half, 0, 0, 0, 0]
                if halves:
                    s16 = llvm.inline_asm(s2.type, [s2], _SIXTEENTH_PTX, "=h,h")
                for h in range(2):
                    w = vector.extract(both, dynamic_position=[], static_position=[h])
                    if halves:  # pair j: (w or w >> 8) and one of two masks
                        w8 = arith.shrui(w, arith.constant(i32, 8))
                        outs = [llvm.inline_asm(i32, [w8 if j >= 2 else w, s16 if j % 2 else s2, b2],
                                                _HALVES_PAIR_PTX.format(mask=0x00F000F0 if j % 2 else 0x000F000F),
                                                "=r,r,h,h") for j in range(4)]
                    else:
                        hi = arith.shrui(w, arith.constant(i32, 4))
                        outs = [llvm.inline_asm(i32, [w, hi, s2, b2], ptx.format(sel=0xF0F0 | (j + 4) << 8 | j),
                                                "=r,r,r,h,h") for j in range(4)]
                    for j, out in enumerate(outs):
                        regs[0, 8 * g + 4 * h + j, 0, 0, half, 0, 0, 0, 0] = mgpu.utils.bitcast(out, pair_ty)
        return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

    return dequant


def _lane_dequant_jnp(words: jax.Array, s_rows, b_rows, subnormal: bool = False, halves: bool = False
                      ) -> jax.Array:
    """`_lane_dequant`'s values by jnp (interpret mode): lane words [R, 8 G] (halves: in that order) -> bf16
    [R, 64 G]. subnormal: the rows are `subnormal_scales`' (q 2^-133 times s 2^(133 - d) is q s 2^-d, exact in
    fp32)."""
    q = unpack(from_lane_words(words, halves=halves), 4).astype(jnp.float32)
    r = q.shape[0]
    q = q.reshape(r, len(s_rows), GROUP)
    s = jnp.stack(s_rows, axis=1).astype(jnp.float32)[:, :, None]
    if subnormal:
        s = _times_pow2(s, -SUBNORMAL_EXP)
    b = jnp.broadcast_to(jnp.stack(b_rows, axis=1).astype(jnp.float32)[:, :, None], q.shape)
    return add_rounded_once_to_bf16(q * s, b).reshape(r, -1)


@functools.partial(jax.jit, static_argnames=("stages", "block_groups", "sms", "interpret", "conversion", "probe",
                                             "layout", "n", "staggered"))
def _partials(xp: jax.Array, qw: jax.Array, st: jax.Array, bt: jax.Array | None, rs: jax.Array | None = None, *,
              stages: int, block_groups: int, sms: int, interpret: bool, conversion: str = "words",
              probe: str | None = None, layout: str = "rows", n: int | None = None, staggered: bool = True
              ) -> jax.Array:
    """`_kernel_call`, through the lowering cache (`_PARTIALS`) when compiled for the GPU."""
    kw = dict(stages=stages, block_groups=block_groups, sms=sms, conversion=conversion, probe=probe, layout=layout,
              n=n, row_scale=rs is not None, staggered=staggered)
    args = ((xp, qw, st) if layout == "tiles" else (xp, qw, st, bt)) + (() if rs is None else (rs,))
    if interpret:
        return _kernel_call(*args, interpret=True, **kw)
    return _PARTIALS(*args, **kw)[0]


def _kernel_call(xp: jax.Array, qw: jax.Array, st: jax.Array, *rest: jax.Array, stages: int, block_groups: int,
                 sms: int, interpret: bool, conversion: str = "words", probe: str | None = None, layout: str = "rows",
                 n: int | None = None, row_scale: bool = False, staggered: bool = True) -> jax.Array:
    """The kernel (`flat_schedule`): xp [R, K] bf16 (x padded to a piece height R, PIECE_ROWS); layout "rows": qw
    the weight as lane words uint32 [N, K / 8] (conversion "words") or as uint4 [N, K] (the others), st, bt [G, N]
    bf16; layout "tiles" (`tile_layout`, conversion "words"): qw the lane words [tiles L CTA_N, 8 G'] with each
    step's [CTA_N, 8 G'] block contiguous, st the step's scale rows then bias rows [tiles L 2 G', CTA_N], bt None,
    n the weight's N -> fp32 pieces [P, N, R] (only those `_pieces_written` marks are written). Each CTA runs one
    pipeline over its S steps, so the memory warpgroup never waits at a tile's edge; a step's MMAs go into a fresh
    accumulator whose value the compute warpgroup adds to its running fp32 sum (restarted where a tile starts), and
    the sum is stored where the tile or the chunk ends. row_scale: a last operand rs [1, N] fp32 (the "subnormal"
    conversion's 2^d, `subnormal_scales`) multiplies each stored sum's rows."""
    rows, k = xp.shape
    tiled = layout == "tiles"
    rest = list(rest)
    rs = rest.pop() if row_scale else None
    bt = None if tiled else rest.pop(0)
    assert not rest and (not row_scale or conversion in SUBNORMAL_CONVERSIONS), (len(rest), row_scale, conversion)
    assert layout in LAYOUTS and (not tiled or (conversion in LANE_CONVERSIONS and n is not None)), layout
    n = n if tiled else qw.shape[0]
    block_k = GROUP * block_groups
    length, per_cta, ctas, counts = flat_schedule(n, k, block_groups, sms)
    pieces = int(counts.max())
    total = -(-n // CTA_N) * length
    words = conversion in LANE_CONVERSIONS
    subnormal = conversion in SUBNORMAL_CONVERSIONS
    halves = conversion == "halves"
    q_block = (CTA_N, block_k // 8) if words else (CTA_N, block_k)
    q_transforms = _smem_transforms(block_k // 8, 32, "lhs") if words else _smem_transforms(block_k, 4, "lhs")
    x_transforms = _smem_transforms(GROUP, 16, "rhs")
    a_transforms = _smem_transforms(GROUP, 16, "lhs")  # interpret mode's A tile
    # probe (timing only, wrong numbers; tools/gpu/mgpu_probe.py; the "nibbles" conversion): leave a part of the step
    # out -- "no_xor", "no_affine" (the scale FMA), "no_load" (a constant A tile: no shared-memory read or
    # conversion), "no_compute" (no MMA either).
    # "no_compute" also applies to the other conversions.
    assert conversion in CONVERSIONS and probe in (None, "no_xor", "no_affine", "no_load", "no_compute"), probe
    assert probe in (None, "no_compute") or conversion == "nibbles", (probe, conversion)
    dequant = (_lane_dequant(block_groups, q_transforms, subnormal, staggered, halves) if words and not interpret
               else None)

    def kernel(x_gmem, q_gmem, s_gmem, *refs):
        refs = list(refs)
        b_gmem = None if tiled else refs.pop(0)
        rs_gmem = refs.pop(0) if row_scale else None
        out_gmem, out_smem, *a_smem = refs
        cta = lax.axis_index("cta")

        def locate(i):  # step i of this CTA -> (tile, step within the tile's K); past the end: the last step again
            f = lax.min(cta * per_cta + i, jnp.int32(total - 1))
            return _div(f, length), lax.rem(f, jnp.int32(length))

        def step_block(i):  # tiles layout: the step's block, tile-major (the flat step index)
            return lax.min(cta * per_cta + i, jnp.int32(total - 1)), 0

        x_spec = plgpu.BlockSpec((rows, block_k), lambda i: (0, locate(i)[1]), transforms=x_transforms,
                                 memory_space=plgpu.SMEM)
        if tiled:
            specs = [x_spec,
                     plgpu.BlockSpec(q_block, step_block, transforms=q_transforms, memory_space=plgpu.SMEM),
                     plgpu.BlockSpec((2 * block_groups, CTA_N), step_block, memory_space=plgpu.SMEM)]
        else:
            specs = [x_spec,
                     plgpu.BlockSpec(q_block, lambda i: locate(i), transforms=q_transforms, memory_space=plgpu.SMEM),
                     plgpu.BlockSpec((block_groups, CTA_N), lambda i: locate(i)[::-1], memory_space=plgpu.SMEM),
                     plgpu.BlockSpec((block_groups, CTA_N), lambda i: locate(i)[::-1], memory_space=plgpu.SMEM)]
        if row_scale:  # the tile's 2^d row, copied with each step
            specs.append(plgpu.BlockSpec((1, CTA_N), lambda i: (0, locate(i)[0]), memory_space=plgpu.SMEM))

        def pipeline(body, context):
            return plgpu.emit_pipeline_warp_specialized(
                body, grid=(per_cta,), memory_registers=40, wg_axis="wg", num_compute_wgs=COMPUTE_WGS,
                max_concurrent_steps=stages, compute_context=context, in_specs=specs)

        ignore = lambda *_, **__: None
        operands = ((x_gmem, q_gmem, s_gmem) + (() if tiled else (b_gmem,))
                    + ((rs_gmem,) if row_scale else ()))

        @functools.partial(pl.run_scoped, allocs=pipeline(ignore, ignore).get_allocations(*operands),
                           collective_axes="wg")
        def _scope(allocs):
            wg = lax.axis_index("wg")
            wg_slice = pl.ds(wg * TILE_N, TILE_N)

            def context(run):
                run(jnp.zeros((TILE_N, rows), jnp.float32))

            def a_tiles(q_smem, s_smem, b_smem):  # the step's A operand, one [TILE_N, GROUP] tile a group
                if words:
                    s_rows = [s_smem[j, wg_slice] for j in range(block_groups)]
                    b_rows = [(s_smem if tiled else b_smem)[(block_groups if tiled else 0) + j, wg_slice]
                              for j in range(block_groups)]
                    a = (_lane_dequant_jnp(q_smem[wg_slice], s_rows, b_rows, subnormal, halves) if interpret
                         else dequant(q_smem.at[wg_slice], s_rows, b_rows))
                    return [a[:, j * GROUP:(j + 1) * GROUP] for j in range(block_groups)]
                # "nibbles"/"unsigned": q XOR 8 read as signed int4 is q - 8 (Mosaic GPU's fast int4 -> bf16
                # conversion); + 8 in bf16 is exact, and s q + b is the MLX dequantization.
                if probe == "no_load":
                    return [jnp.ones((TILE_N, GROUP), jnp.bfloat16)] * block_groups
                if conversion == "unsigned":
                    q = q_smem[wg_slice].astype(jnp.bfloat16)
                else:
                    q = q_smem[wg_slice]
                    q = lax.bitcast_convert_type(q if probe == "no_xor" else q ^ jnp.uint4(8), jnp.int4)
                    q = q.astype(jnp.bfloat16) + jnp.bfloat16(8)
                out = []
                for j in range(block_groups):
                    a = q[:, j * GROUP:(j + 1) * GROUP]
                    if probe != "no_affine":
                        a = a * s_smem[j, wg_slice][:, None] + b_smem[j, wg_slice][:, None]
                    out.append(a)
                return out

            def body(idx, x_smem, q_smem, s_smem, *rest):
                (i,) = idx
                rest = list(rest)
                carry = rest.pop()
                b_smem = None if tiled else rest.pop(0)
                rs_smem = rest.pop(0) if row_scale else None
                f = cta * per_cta + i
                tile, ks = locate(i)
                if probe == "no_compute":
                    step = carry
                else:
                    tiles = a_tiles(q_smem, s_smem, b_smem)

                    def mmas(acc):
                        for j, a in enumerate(tiles):
                            if interpret:
                                a_smem[0][wg] = a
                                plgpu.commit_smem()
                                a = a_smem[0].at[wg]
                            plgpu.wgmma(acc, a, x_smem.at[:, pl.ds(j * GROUP, GROUP)].transpose((1, 0)))
                            if interpret:
                                plgpu.wgmma_wait(0)
                        return acc[...]  # waits for the MMAs: the stage's buffers are handed back after the body

                    step = pl.run_scoped(mmas, plgpu.ACC((TILE_N, rows), jnp.float32))
                # restart where a tile starts: carry x 0 (no select: Mosaic GPU's warpgroup lowering broadcasts no
                # scalar predicate). A non-finite carry could only come from non-finite x in the same rows, whose
                # outputs are non-finite anyway, so no row's bits depend on another's.
                keep = jnp.where((ks == 0) | (i == 0), 0.0, 1.0).astype(jnp.float32)
                carry = carry * lax.broadcast(keep, (TILE_N, rows)) + step

                @pl.when((f < total) & ((ks == length - 1) | (i == per_cta - 1)))
                def _store():
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last store has read out_smem
                    out_smem[wg] = (carry if rs_smem is None
                                    else carry * lax.broadcast_in_dim(rs_smem[0, wg_slice], (TILE_N, rows), (0,)))
                    plgpu.commit_smem()
                    piece = cta - _div(tile * length, per_cta)
                    plgpu.copy_smem_to_gmem(out_smem.at[wg],
                                            out_gmem.at[piece, pl.ds(tile * CTA_N, CTA_N)].at[wg_slice])

                return carry

            pipeline(body, context)(*operands, allocations=allocs)

        plgpu.wait_smem_to_gmem(0)

    call = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((pieces, n, rows), jnp.float32),
        grid=(ctas,), grid_names=("cta",), num_threads=COMPUTE_WGS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        scratch_types=[plgpu.SMEM((COMPUTE_WGS, TILE_N, rows), jnp.float32)]
        + ([plgpu.SMEM((COMPUTE_WGS, TILE_N, GROUP), jnp.bfloat16, transforms=a_transforms)] if interpret else []),
        interpret=plgpu.InterpretGPUParams() if interpret else None)
    return call(xp, qw, st, *(() if tiled else (bt,)), *(() if rs is None else (rs,)))


# The lowering cache (`mgpu_lowering`): the kernel's custom call lowered once a process per operand shapes and
# static parameters. LOWERING_CACHE is read when a program is lowered.
LOWERING_CACHE = True


def _partials_shape(xp, qw, block_groups: int, sms: int, n: int | None) -> tuple[int, int, int]:
    n = qw.shape[0] if n is None else n
    return int(flat_schedule(n, xp.shape[1], block_groups, sms)[3].max()), n, xp.shape[0]


_PARTIALS = CachedKernel(
    "qmm_mgpu_partials", _kernel_call,
    lambda xp, qw, *_, block_groups, sms, n=None, layout="rows", **__: [jax.core.ShapedArray(
        _partials_shape(xp, qw, block_groups, sms, n if layout == "tiles" else None), jnp.float32)],
    enabled=lambda: LOWERING_CACHE)
_LOWERED = _PARTIALS.lowered  # (the tools clear it between variants)
custom_calls = mgpu_lowering.custom_calls


def _default_conversion(w: QuantizedWeight, transposed) -> str:
    """The conversion a call without one takes: CONVERSION, except that a weight laid out by `qmm.decode_layout`
    decides where CONVERSION would repack it every call. Its transposed scales without the shifted rows
    (`decode_layout` keeps them so where those would not be exact): "words". Lane words in the halves order
    (`w.halves`): "halves"; in the pair order under CONVERSION "halves": "subnormal". All give the same bits."""
    conversion = CONVERSION
    if conversion in SUBNORMAL_CONVERSIONS and transposed is None and w.scales_t is not None and not w.subnormal:
        return "words"
    if w.lanes and conversion in LANE_CONVERSIONS:
        if w.halves:
            return "halves"
        if conversion == "halves":
            return "subnormal"
    return conversion


def block_groups_for(k: int) -> int:
    """Groups a pipeline step carries: BLOCK_GROUPS, or the largest power of two below it dividing K's groups."""
    bg = BLOCK_GROUPS
    while (k // GROUP) % bg:
        bg //= 2
    return bg


def qmm_decode(x: jax.Array, w: QuantizedWeight, *, stages: int = STAGES, block_groups: int | None = None,
               transposed: tuple[jax.Array, jax.Array] | None = None,
               conversion: str | None = None, interpret: bool = False, rows: int = ROWS,
               rounding: str | None = None, layout: str | None = None, epilogue: bool = True) -> jax.Array:
    """x bf16 [M <= rows, K] -> y bf16 [M, N] (see the module docstring; epilogue False: the kernel's pieces
    [P, N, rows] as it wrote them, `qmm_parts`); rows: the piece height x is padded to
    (PIECE_ROWS; the MMA's N). block_groups: None for the shape-derived
    `block_groups_for` (a caller that overrides must keep it fixed per weight shape). transposed: the scales and
    biases as [G, N], made once beforehand (default: the weight's `scales_t`, `biases_t` where it has them; else
    each call transposes them: for 5120 -> 34816 that is 22 MB of extra traffic beside the weight's 89 MB, 0.85 ms a
    27B forward). conversion: CONVERSIONS (None for CONVERSION); "words" reads lane-ordered words (`w.lanes`,
    made once by `qmm.decode_layout`; else each call repacks them), "subnormal" reads them too with the scale
    and bias rows `subnormal_scales` makes (`w.subnormal`, made once by `qmm.decode_layout`; else each call
    makes them), "halves" the same rows with the words in its own lane order (`w.halves`), the others natural ones
    (else each call restores that order). conversion None: `_default_conversion`, CONVERSION as the weight's
    layout allows.
    interpret: Mosaic GPU's interpreter on the CPU. rounding: how the output keeps its rounding (ROUNDINGS; None for
    ROUNDING). layout: where a step's blocks lie (LAYOUTS; None for LAYOUT; "tiles" needs the "words" conversion
    and here re-lays the weight every call)."""
    w.validate("qmm_mgpu weight")
    _check(x, w, rows)
    n, k = w.shape
    bg = block_groups_for(k) if block_groups is None else block_groups
    if bg < 1 or (k // GROUP) % bg:
        raise ValueError(f"qmm_mgpu: block_groups={bg} must divide K's {k // GROUP} groups")
    if conversion is None:
        conversion = _default_conversion(w, transposed)
    if conversion not in CONVERSIONS:
        raise ValueError(f"qmm_mgpu: conversion {conversion!r} is not one of {CONVERSIONS}")
    row_scale = None
    if transposed is None and w.subnormal and conversion in SUBNORMAL_CONVERSIONS:
        transposed, row_scale = (w.scales_t, w.biases_t), w.row_scale
    else:
        if transposed is None and w.scales_t is not None and not w.subnormal:
            transposed = (w.scales_t, w.biases_t)
        if transposed is None:
            transposed = (w.scales.T, w.biases.T)
        elif tuple(t.shape for t in transposed) != 2 * ((k // GROUP, n),):
            raise ValueError(f"qmm_mgpu: transposed scales and biases must be [{k // GROUP}, {n}], got "
                             f"{[tuple(t.shape) for t in transposed]}")
        if conversion in SUBNORMAL_CONVERSIONS:
            *transposed, row_scale, _ = subnormal_scales(*transposed)
    if conversion in LANE_CONVERSIONS:
        halves = conversion == "halves"
        q = w.words if w.lanes and w.halves == halves else to_lane_words(natural_words(w), halves=halves)
    else:
        q = lax.bitcast_convert_type(natural_words(w), jnp.uint4).reshape(n, k)
    rounding = ROUNDING if rounding is None else rounding
    if rounding not in ROUNDINGS:
        raise ValueError(f"qmm_mgpu: rounding {rounding!r} is not one of {ROUNDINGS}")
    layout = LAYOUT if layout is None else layout
    if layout not in LAYOUTS or (layout == "tiles" and conversion not in LANE_CONVERSIONS):
        raise ValueError(f"qmm_mgpu: layout {layout!r} must be one of {LAYOUTS} ('tiles' with the conversions "
                         f"{LANE_CONVERSIONS})")
    operands = (q, *transposed)
    if layout == "tiles":
        operands = (*tile_layout(q, *transposed, bg), None)
    return _decode(x, *operands, row_scale, stages=stages_for(rows, stages, bg, row_scale is not None),
                   block_groups=bg, conversion=conversion, sms=SMS, interpret=interpret, rows=rows, rounding=rounding,
                   layout=layout, n=n, staggered=STAGGERED_LOADS, epilogue=epilogue)


@functools.partial(jax.jit, static_argnames=("stages", "block_groups", "conversion", "sms", "interpret", "rows",
                                             "rounding", "layout", "n", "epilogue", "staggered"))
def _decode(x: jax.Array, q: jax.Array, st: jax.Array, bt: jax.Array | None, rs: jax.Array | None = None, *,
            stages: int, block_groups: int, conversion: str, sms: int, interpret: bool, rows: int, rounding: str,
            layout: str, n: int, epilogue: bool = True, staggered: bool = True) -> jax.Array:
    # One program around the kernel: called eagerly, separate dispatches of the small ops around an interpreted
    # kernel deadlocked the CPU client now and then (the interpreter's callbacks dispatch jax ops themselves).
    m, k = x.shape
    xp = jnp.pad(x, ((0, rows - m), (0, 0)))
    parts = _partials(xp, q, st, bt, rs, stages=stages, block_groups=block_groups, sms=sms, interpret=interpret,
                      conversion=conversion, layout=layout, n=n, staggered=staggered)
    if not epilogue:
        return parts
    valid = jnp.asarray(written_columns(n, k, block_groups, sms))
    total = sum_pieces(lambda i: (parts[i], valid[i][:, None]), parts.shape[0])
    # The rounding to x.dtype must happen in every program: under XLA's default excess precision a consumer that
    # widens the result again (log-softmax, the MLP's activation) may be fused with this conversion and skip it,
    # in some programs and not others (on the H200 the stream-bucket gate failed so: row 0 of lm_head + log-softmax
    # differed between S = 1 and S = 16 while lm_head alone did not). ROUNDING says how it is kept.
    y = total[:, :m].T
    if rounding == "barrier":
        return lax.optimization_barrier(y.astype(x.dtype))
    info = jnp.finfo(x.dtype)
    return lax.reduce_precision(y, exponent_bits=info.nexp, mantissa_bits=info.nmant).astype(x.dtype)
